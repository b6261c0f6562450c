"""The fleet simulator against this machine's goodput benchmark (issue #24, validation).

Reads what ``benchmarks/goodput.py`` wrote (``--goodput FILE``: its ``rows`` of measured
attainment per contender and rate, its ``args``: preset, rates, duration, seed) and simulates
the same deployments serving **the same requests**: ``goodput.workload(rate, duration, seed)``
gives each measured rate's arrivals (times, prompt and output lengths, class), replayed as they
are. The request classes and the SLO are goodput.py's own constants (chat / document ranges,
``DOC_SHARE``, ``SLO_TTFT_*``, ``SLO_GAP_P99_S``, ``ATTAINMENT_GOAL``), and capacity is its
``capacity()`` rule applied to both curves at the measured rates. Step times come from
``--calibration FILE`` (``splitserve plan --model splitserve-<preset> --kv-dtype fp32
--calibrate --json``: this machine's CPU as the accelerator ``calibrated``, and its NIXL link;
or, better, ``benchmarks/calibrate_engine.py``'s file, whose ``step_model`` times whole steps
of the served model and replaces the roofline unless ``--roofline`` is given); without one,
from the catalog roofline of ``--gpu`` (default H100), which says nothing about this machine
(the output says which was used). Simulation is ``splitserve.planner.sim``'s
``Simulation``, the code ``splitserve simulate`` runs; fleets are ``parse_fleet`` specs.

``--gflops`` / ``--gbps`` replace the accelerator's figures (a what-if, said in the output):
they tell a miss of the calibration (torch's layer timing is not vLLM's CPU kernels) from a
miss of the model, e.g. with the FLOP/s that vLLM's own measured prefill time implies.

Targets (the issue's): attainment within 10 points at each measured rate, capacity within 15%.

Contender -> fleet (derived from goodput.py's ``server_args`` and ``proxy_settings``):

- ``colocated``: ``2C:<gpu>``, budget 2048 and 128 sequences (vLLM's CPU defaults for the API
  server; goodput.py passes no budget), least-outstanding routing;
- ``colocated-lpt``: ``2C:<gpu>``, budget 4096 and ``long_prefill_token_threshold`` 256 (no
  prompt gets more than 256 tokens of a step; the fleet's server setting of that name);
- ``colocated-adaptive``: ``2C:<gpu>/adaptive``, budget 4096, the policy's target
  ``goodput.ADAPTIVE_TARGET_MS`` (the fleet's ``adaptive_target_itl_ms``), as the servers run;
- ``pd``: ``1P:<gpu>,1D:<gpu>/adaptive,first-token-from-prefill`` (the concurrent flow sends
  P's first token; D runs the adaptive scheduler in the benchmark too, idle with nothing to
  prefill);
- ``pd-decide``: ``1P:<gpu>,1D:<gpu>/adaptive,per-request,first-token-from-prefill`` (the
  proxy's ``decide`` with its default threshold; the prompts share no prefix, so block size
  and prefix lookups do not matter).

The SLO's gap figure is the simulator's ``itl_metric: p99``: each request's own 99th
percentile gap by goodput.py's nearest-rank rule.

Every server: vLLM's CPU KV block (128 tokens: the adaptive budget's alignment, as on the
servers), fp32 KV and weights (the calibration's width), KV capacity 2 GiB
(``VLLM_CPU_KVCACHE_SPACE`` in goodputbench/servers.py's ``start_group``; the simulator's
``mem x 0.9 - weights`` rule is fed a memory that leaves exactly that), layer-wise handoff.

Not modelled (where to look when a cell misses):

- one CPU core per server beside the proxy and the load generator on the same two cores: a
  ``plan --calibrate`` file is one layer timed in torch, not vLLM's CPU kernels under that
  contention; a ``calibrate_engine.py`` step model times the served engine's whole steps (its
  per-step work included) with only its client beside it;
- with the roofline, vLLM's per-step Python overhead (scheduler, sampling, detokenizing,
  streaming): ``--step-overhead-ms`` adds a fixed cost per step (default 0);
- the proxy's own latency per request and per streamed token (its warm-up requests are not
  simulated, but what they teach the per-request rule's queue estimate is: ``warm_decider``);
- handoff: the planner's link formula (no NIXL notification or D's recompute of the last
  token), one link per P->D pair, and in the pull used on host memory D's core does the copy
  (D's steps are not slowed by it here); vLLM's CPU prefix cache (the prompts share nothing).

Usage:

    .venv/bin/python benchmarks/calibrate_engine.py --preset mid --out runs/engine-cal-mid.json
    .venv/bin/python benchmarks/sim_vs_goodput.py --goodput runs/goodput-mid.json \\
        --calibration runs/engine-cal-mid.json [--json runs/sim-vs-goodput-mid.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from splitserve.planner.calibration_file import EngineStepModel, load_calibration
from splitserve.planner.catalog import ACCELERATORS, Accelerator, Link, get_link, get_model
from splitserve.planner.pools import MEMORY_UTILISATION
from splitserve.planner.roofline import weight_bytes_total
from splitserve.planner.sim import Fleet, PoolSpec, Simulation, parse_fleet
from splitserve.planner.sim.fleet import LinkSpec, ServerSettings
from splitserve.planner.sim.workload import RequestClass, Requests, Workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput as gp  # noqa: E402  (benchmarks/goodput.py: workload, SLO, contenders)

ATTAINMENT_POINTS = 10.0  # the targets
CAPACITY_SHARE = 0.15
VLLM_CPU_BUDGET, VLLM_CPU_SEQS = 2048, 128  # vllm arg_utils: CPU, OPENAI_API_SERVER defaults
VLLM_CPU_BLOCK = 128  # vLLM's CPU KV block: the adaptive budget's alignment and floor
KV_SPACE_BYTES = 2 * 2**30  # VLLM_CPU_KVCACHE_SPACE=2 in goodputbench/servers.py
CLASSES = ("chat", "doc")


def bench_workload() -> Workload:
    """goodput.py's two classes and SLO as simulator request classes."""

    def cls(name: str, share: float, prompt: tuple, output: tuple, ttft_s: float) -> Any:
        return RequestClass(name=name, share=share, prompt_min=prompt[0], prompt_max=prompt[1],
                            output_min=output[0], output_max=output[1], ttft_ms=ttft_s * 1e3,
                            itl_ms=gp.SLO_GAP_P99_S * 1e3)  # fmt: skip

    return Workload(
        classes=[
            cls("chat", 1 - gp.DOC_SHARE, gp.CHAT_PROMPT, gp.CHAT_OUTPUT, gp.SLO_TTFT_CHAT_S),
            cls("doc", gp.DOC_SHARE, gp.DOC_PROMPT, gp.DOC_OUTPUT, gp.SLO_TTFT_DOC_S),
        ],
        itl_metric="p99",  # each request's own p99 gap, nearest rank, as goodput.py's pct
    )


def bench_requests(rate: float, duration_s: float, seed: int) -> Requests:
    """The benchmark's own arrivals at ``rate`` as simulator request columns."""
    out = Requests()
    for a in gp.workload(rate, duration_s, seed):
        out.t.append(a.at_s)
        out.prompt.append(len(a.prompt))
        out.output.append(a.max_tokens)
        out.cls.append(CLASSES.index(a.kind))
        out.prefix.append(-1)
        out.prefix_len.append(0)
    return out


def _flag_value(args: list[str], flag: str) -> int | None:
    return int(args[args.index(flag) + 1]) if flag in args else None


def fleet_spec(c: Any, gpu: str) -> tuple[str, int, int]:
    """(``--fleet`` spec, budget, ``long_prefill_token_threshold`` or 0) of one goodput
    contender, read from goodput.py's own server flags and proxy settings."""
    pd = c.group == "pd"
    role = "d" if pd else "s0"
    flags = gp.server_args(c.group, role)
    budget = _flag_value(flags, "--max-num-batched-tokens") or VLLM_CPU_BUDGET
    urls = {r: "http://x" for r in ("p", "d", "s0", "s1")}
    proxy = gp.proxy_settings(c, urls, 1)
    extra = []
    if "--scheduler-cls" in flags:
        extra.append("adaptive")
    if pd and "decide" in proxy:
        extra.append("per-request")
    if pd and proxy["flow"] == "concurrent":
        extra.append("first-token-from-prefill")
    pools = f"1P:{gpu},1D:{gpu}" if pd else f"2C:{gpu}"
    lpt = _flag_value(flags, "--long-prefill-token-threshold") or 0
    return pools + ("/" + ",".join(extra) if extra else ""), budget, lpt


def warm_decider(sim: Simulation) -> None:
    """Show the simulated proxy goodput.py's warm-up prompts, as the measured proxy saw them
    before the run: its queue estimate (the per-request rule's mean prompt sent to P) starts
    from what they taught it (the 2,000-token one goes through P), not from nothing."""
    if sim.decider is not None:
        for tokens in gp.WARM_PROMPTS:
            sim.decider.decide(tokens, 0, 0)


def kv_limited(acc: Accelerator, model: Any, weight_bytes: int) -> Accelerator:
    """``acc`` with the memory that leaves the servers' KV space after the simulator's rule."""
    mem = (KV_SPACE_BYTES + weight_bytes_total(model, weight_bytes)) / MEMORY_UTILISATION
    return acc.model_copy(update={"mem_bytes": mem})


def points_apart(measured: float, simulated: float) -> float:
    return 100.0 * (simulated - measured)


def capacity_ratio(measured: float, simulated: float) -> float:
    """Simulated over measured capacity (1 when both are 0; inf when only measured is 0)."""
    if measured == 0:
        return 1.0 if simulated == 0 else math.inf
    return simulated / measured


def compare(
    report: dict[str, Any],
    accelerator: Accelerator,
    link: Link,
    gpu: str,
    weight_bytes: int = 4,
    step_overhead_ms: float = 0.0,
    step_model: EngineStepModel | None = None,
) -> dict[str, Any]:
    """Simulate every contender of a goodput ``report`` at its measured rates; the result's
    ``rows`` and ``capacity`` compare them (see ``markdown``)."""
    args = report["args"]
    gp.scale_slo(float(args.get("slo_scale", 1.0)))  # the bounds the sweep was judged by
    model = get_model(f"splitserve-{args.get('preset') or 'tiny'}")
    accelerators = {gpu: kv_limited(accelerator, model, weight_bytes)}
    step_models = {gpu: step_model} if step_model is not None else {}
    workload = bench_workload()
    measured: dict[str, dict[float, dict[str, Any]]] = {}
    for row in report["rows"]:
        measured.setdefault(row["contender"], {})[float(row["rate"])] = row
    contenders = [c for c in gp.CONTENDERS if c.name in measured]
    base = Fleet(
        pools=[PoolSpec(role="colocated", count=1, gpu=gpu)],
        server=ServerSettings(max_num_seqs=VLLM_CPU_SEQS, kv_dtype="fp32",
                              block_size=VLLM_CPU_BLOCK,
                              weight_bytes=weight_bytes, step_overhead_ms=step_overhead_ms,
                              adaptive_target_itl_ms=gp.ADAPTIVE_TARGET_MS),
        link=LinkSpec(name=link.name),
    )  # fmt: skip
    rows, caps = [], []
    for c in contenders:
        spec, budget, lpt = fleet_spec(c, gpu)
        settings = base.server.model_copy(
            update={"max_num_batched_tokens": budget, "long_prefill_token_threshold": lpt}
        )
        fleet = parse_fleet(spec, base.model_copy(update={"server": settings}))
        sim_att: dict[float, float] = {}
        for rate in sorted(measured[c.name]):
            reqs = bench_requests(rate, float(args["duration"]), int(args.get("seed", gp.SEED)))
            sim = Simulation(model, fleet, workload, reqs, accelerators, link,
                             step_models=step_models)  # fmt: skip
            warm_decider(sim)
            res = sim.run()
            m = measured[c.name][rate]
            sim_att[rate] = res.attainment
            apart = points_apart(m["attainment"], res.attainment)
            per_class = {
                k["class"]: {
                    "measured_attainment": (m.get(k["class"]) or {}).get("attainment"),
                    "simulated_attainment": k["attainment"],
                    "measured_ttft_p90_s": (m.get(k["class"]) or {}).get("ttft_p90_s"),
                    "simulated_ttft_p90_s": k["ttft_ms"]["p90"] / 1e3,
                }
                for k in res.per_class
            }
            rows.append({"contender": c.name, "fleet": fleet.label(), "spec": spec,
                         "budget": budget, "rate": rate, "requests": len(reqs),
                         "measured": m["attainment"], "simulated": res.attainment,
                         "points": apart, "miss": abs(apart) > ATTAINMENT_POINTS,
                         "per_class": per_class, "preemptions": res.preemptions,
                         "decisions": res.decisions})  # fmt: skip
        m_att = {r: measured[c.name][r]["attainment"] for r in measured[c.name]}
        m_cap, s_cap = gp.capacity(m_att), gp.capacity(sim_att)
        ratio = capacity_ratio(m_cap, s_cap)
        caps.append({"contender": c.name, "spec": spec, "lpt": lpt,
                     "measured": m_cap, "simulated": s_cap, "ratio": ratio,
                     "top_rate": max(m_att),
                     "miss": not abs(ratio - 1) <= CAPACITY_SHARE})  # fmt: skip
    return {
        "slo": gp.slo_text(),
        "model": model.name,
        "accelerator": accelerator.model_dump(),
        "link": link.model_dump(),
        "step_overhead_ms": step_overhead_ms,
        "step_model": step_model.model_dump() if step_model is not None else None,
        "rows": rows,
        "capacity": caps,
    }


def _ttft(row: dict[str, Any], cls: str) -> str:
    k = row["per_class"].get(cls) or {}
    m, s = k.get("measured_ttft_p90_s"), k.get("simulated_ttft_p90_s")
    return " / ".join("-" if v is None or math.isnan(v) else f"{v:.2f}" for v in (m, s))


def markdown(result: dict[str, Any], source: str = "") -> str:
    acc = result["accelerator"]
    sm = result.get("step_model")
    if sm:
        timing = (
            f"the engine's measured step model ({sm['intercept_ms']:.3g} ms + "
            f"{sm['ms_per_1k_tokens']:.3g} ms/1k tokens + {sm['ms_per_100_sequences']:.3g} "
            f"ms/100 sequences + {sm['ms_per_1m_pairs']:.3g} ms/1M pairs) from {source}"
        )
    else:
        timing = (
            f"{source or acc['name']} ({acc['bf16_flops'] / 1e9:.3g} GFLOP/s, "
            f"{acc['mem_bytes_per_s'] / 1e9:.3g} GB/s)"
        )
    lines = [
        result["slo"],
        f"Model {result['model']}; step times: {timing}, "
        f"step overhead {result['step_overhead_ms']:g} ms; link {result['link']['name']}.",
        "",
        "| contender | fleet | rate (req/s) | measured | simulated | points apart "
        "| TTFT p90 chat, measured / sim (s) | TTFT p90 doc (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        flag = " **miss**" if r["miss"] else ""
        lines.append(
            f"| {r['contender']} | `{r['spec']}` budget {r['budget']} | {r['rate']:g} "
            f"| {r['measured']:.0%} | {r['simulated']:.0%} | {r['points']:+.0f}{flag} "
            f"| {_ttft(r, 'chat')} | {_ttft(r, 'doc')} |"
        )
    lines += [
        "",
        f"Capacity (highest measured rate with >= {gp.ATTAINMENT_GOAL:.0%} there and below; "
        "^ = the sweep's top rate, the true capacity may be higher):",
        "",
        "| contender | measured (req/s) | simulated (req/s) | simulated / measured |",
        "|---|---:|---:|---:|",
    ]
    for c in result["capacity"]:
        m_top = "^" if c["measured"] == c["top_rate"] else ""
        s_top = "^" if c["simulated"] == c["top_rate"] else ""
        ratio = "inf" if math.isinf(c["ratio"]) else f"{c['ratio']:.2f}"
        flag = " **miss**" if c["miss"] else ""
        note = f" (lpt {c['lpt']})" if c["lpt"] else ""
        lines.append(
            f"| {c['contender']}{note} | {c['measured']:g}{m_top} | {c['simulated']:g}{s_top} "
            f"| {ratio}{flag} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--goodput", required=True, type=Path, help="goodput.py's JSON")
    ap.add_argument("--calibration", type=Path, help="plan --calibrate --json output")
    ap.add_argument("--gpu", default="H100", help="catalog roofline without --calibration")
    ap.add_argument("--link", default="NVLink4", help="catalog link when the file has none")
    ap.add_argument("--step-overhead-ms", type=float, default=0.0)
    ap.add_argument("--gflops", type=float, help="what-if: replace the FLOP/s (GFLOP/s)")
    ap.add_argument("--gbps", type=float, help="what-if: replace the memory bandwidth (GB/s)")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    ap.add_argument(
        "--roofline", action="store_true",
        help="time steps by the calibration's roofline even when it holds a step model",
    )  # fmt: skip
    args = ap.parse_args(argv)
    report = json.loads(args.goodput.read_text())
    link = get_link(args.link)
    step_model = None
    if args.calibration:
        cal = load_calibration(args.calibration)
        acc, gpu, wbytes = cal.accelerator, "calibrated", cal.weight_bytes
        link = cal.link or link
        source = f"calibration {args.calibration}"
        if cal.step_model is not None and not args.roofline:
            step_model = cal.step_model
    else:
        acc, gpu, wbytes = ACCELERATORS[args.gpu], args.gpu, 4
        source = f"catalog roofline {args.gpu} (no calibration: not this machine)"
    what_if = {"bf16_flops": args.gflops and args.gflops * 1e9,
               "mem_bytes_per_s": args.gbps and args.gbps * 1e9}  # fmt: skip
    if any(what_if.values()):
        acc = acc.model_copy(update={k: v for k, v in what_if.items() if v})
        source += f", what-if {', '.join(f'{k}={v:g}' for k, v in what_if.items() if v)}"
    result = compare(report, acc, link, gpu, wbytes, args.step_overhead_ms, step_model)
    print(markdown(result, source))
    if args.json:
        args.json.write_text(json.dumps({"goodput": str(args.goodput), "source": source,
                                         **result}, indent=2, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
