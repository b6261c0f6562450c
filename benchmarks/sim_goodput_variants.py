"""The goodput benchmark's contenders in the fleet simulator over several seeds, beside variants
of (e)'s per-request rule and of the adaptive budget's floor (issue #18's design choices).

A script, not a test, and a simulation, not a measurement: ``benchmarks/goodput.py`` measures;
this asks the simulator (validated against it: ``sim_vs_goodput.py``) what a rule change would
do across seeds, which one measured sweep cannot. Step times come from
``benchmarks/calibrate_engine.py``'s file (the served engine's step model on this machine), the
workload and the SLO are goodput.py's own (``--slo-scale`` as goodput.py's), the fleets are
``sim_vs_goodput.fleet_spec``'s (vLLM's CPU block of 128 tokens included).

Variants of (e), each one change from the shipped rule:

- ``busy-uncapped``: the ``prefill_busy`` rule without ``busy_max_tokens`` (the rule before
  session 24: any prompt, documents included, goes to D when P's queue is long);
- ``busy-off``: no ``prefill_busy`` rule;
- ``floor-256``: the adaptive budget's floor fixed at 256 tokens (the fleet's
  ``adaptive_min_chunk``, the policy's ``min_chunk``: the default before session 24) on D (and
  on (c)'s servers, printed as ``(c) floor-256``);
- ``share-off``: the adaptive budget first come, first served instead of shared max-min fairly
  among pending prompts (the policy's ``share_prefill``, on by default), on D and on (c)'s
  servers.

Prints, per contender and rate, the mean attainment over the seeds and the worst seed's.

Usage:

    .venv/bin/python benchmarks/sim_goodput_variants.py --calibration runs/engine-cal-mid.json \\
        --slo-scale 1.6 --rates 0.2,0.3,0.4,0.5,0.6,0.7 --seeds 18,19,20,21,22
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from splitserve.planner.calibration_file import load_calibration
from splitserve.planner.catalog import get_model
from splitserve.planner.sim import Fleet, PoolSpec, Simulation, parse_fleet
from splitserve.planner.sim.fleet import LinkSpec, ServerSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput as gp  # noqa: E402
import sim_vs_goodput as svg  # noqa: E402

UNCAPPED = 10**9
VARIANTS: dict[str, dict[str, Any]] = {
    "busy-uncapped": {"routing": {"decide_busy_max_tokens": UNCAPPED}},
    "busy-off": {"routing": {"decode_prefill_cost_ratio": float(UNCAPPED)}},
    "floor-256": {"server": {"adaptive_min_chunk": 256}},
    "share-off": {"server": {"adaptive_share_prefill": False}},
}


def attainments(
    fleet: Fleet, ctx: dict[str, Any], rate: float, seeds: list[int], duration: float
) -> list[float]:
    """Simulated attainment of ``fleet`` at ``rate``, one per seed."""
    out = []
    for seed in seeds:
        reqs = svg.bench_requests(rate, duration, seed)
        sim = Simulation(ctx["model"], fleet, ctx["workload"], reqs, ctx["accelerators"],
                         ctx["link"], step_models=ctx["step_models"])  # fmt: skip
        svg.warm_decider(sim)
        out.append(sim.run().attainment)
    return out


def _with_server(fleet: Fleet, change: dict[str, Any]) -> Fleet:
    return fleet.model_copy(update={"server": fleet.server.model_copy(update=change)})


def fleets(ctx: dict[str, Any]) -> list[tuple[str, Fleet]]:
    """(row name, fleet): the five contenders, then the variants."""
    base = Fleet(
        pools=[PoolSpec(role="colocated", count=1, gpu=ctx["gpu"])],
        server=ServerSettings(max_num_seqs=svg.VLLM_CPU_SEQS, kv_dtype="fp32",
                              block_size=svg.VLLM_CPU_BLOCK, weight_bytes=ctx["weight_bytes"],
                              adaptive_target_itl_ms=gp.ADAPTIVE_TARGET_MS),
        link=LinkSpec(name=ctx["link"].name),
    )  # fmt: skip
    rows: list[tuple[str, Fleet]] = []
    built: dict[str, Fleet] = {}
    for c in gp.CONTENDERS:
        spec, budget, lpt = svg.fleet_spec(c, ctx["gpu"])
        settings = base.server.model_copy(
            update={"max_num_batched_tokens": budget, "long_prefill_token_threshold": lpt}
        )
        built[c.name] = parse_fleet(spec, base.model_copy(update={"server": settings}))
        rows.append((c.label.split(" ")[0] + " " + c.name, built[c.name]))
    for name in ("floor-256", "share-off"):
        rows.append(
            (f"(c) {name}", _with_server(built["colocated-adaptive"], VARIANTS[name]["server"]))
        )
    e = built["pd-decide"]
    for name, change in VARIANTS.items():
        fleet = e
        if "routing" in change:
            fleet = e.model_copy(update={"routing": e.routing.model_copy(update=change["routing"])})
        if "server" in change:
            fleet = _with_server(fleet, change["server"])
        rows.append((f"(e) {name}", fleet))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibration", type=Path, required=True,
                    help="benchmarks/calibrate_engine.py's file")  # fmt: skip
    ap.add_argument("--slo-scale", type=float, default=1.0, help="as goodput.py's")
    ap.add_argument("--rates", default="0.2,0.3,0.4,0.5,0.6,0.7")
    ap.add_argument("--seeds", default="18,19,20,21,22")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument("--preset", default="mid")
    args = ap.parse_args(argv)
    gp.scale_slo(args.slo_scale)
    cal = load_calibration(args.calibration)
    if cal.step_model is None:
        ap.error(f"{args.calibration} has no step_model: run benchmarks/calibrate_engine.py")
    model = get_model(f"splitserve-{args.preset}")
    gpu = "calibrated"
    ctx = {
        "model": model, "gpu": gpu, "link": cal.link or svg.get_link("NVLink4"),
        "accelerators": {gpu: svg.kv_limited(cal.accelerator, model, cal.weight_bytes)},
        "step_models": {gpu: cal.step_model}, "workload": svg.bench_workload(),
        "weight_bytes": cal.weight_bytes,
    }  # fmt: skip
    rates = [float(x) for x in args.rates.split(",") if x]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    print(gp.slo_text())
    print(f"simulated, {len(seeds)} seeds x {args.duration:g} s; mean attainment (worst seed)")
    print("| contender | " + " | ".join(f"{r:g}/s" for r in rates) + " |")
    print("|---|" + "---:|" * len(rates))
    for name, fleet in fleets(ctx):
        cells = []
        for rate in rates:
            a = attainments(fleet, ctx, rate, seeds, args.duration)
            cells.append(f"{statistics.mean(a):.0%} ({min(a):.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
