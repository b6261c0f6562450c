"""``splitserve simulate``: a fleet serving a workload, simulated event by event.

Runs in the CLI process; the only module of the simulator that prints. Three questions:
- the default: each configuration (``--fleet``, repeatable, or the pool counts) at each
  ``--rate``: attainment per class, TTFT / TPOT / gap percentiles, GPUs, cost;
- ``--goodput``: each configuration's capacity at ``--target`` attainment;
- ``--search``: the cheapest fleet over ``--search-gpus`` meeting ``--target`` at ``--rate``.
Every bad input ends in one ``Error:`` line naming the option (never a stack trace).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from splitserve.planner.calibration_file import EngineStepModel, load_calibration
from splitserve.planner.catalog import (
    ACCELERATORS,
    LINKS,
    Accelerator,
    PlannerInputError,
    custom_link,
    explain_validation,
    get_link,
    get_model,
)
from splitserve.planner.cli import WEIGHT_DTYPE_BYTES, _OneLineErrors, model_options, parse_prices
from splitserve.planner.sim.fleet import (
    Fleet,
    LinkSpec,
    PoolSpec,
    RoutingSpec,
    ServerSettings,
    parse_fleet,
)
from splitserve.planner.sim.metrics import RunResult
from splitserve.planner.sim.search import Context, SearchAnswer, cheapest, goodput
from splitserve.planner.sim.workload import Workload, load_workload, read_trace

logger = logging.getLogger(__name__)
_POSITIVE = click.FloatRange(min=0, min_open=True)
_POLICY = click.Choice(["least_outstanding", "power_of_two", "round_robin"])


def _floats(option: str, text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PlannerInputError(
            f"{option}: expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise PlannerInputError(f"{option}: expected positive numbers, got {text!r}")
    return values


@click.command(cls=_OneLineErrors)
@model_options
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--output-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--ttft-ms", type=_POSITIVE, default=2000.0, show_default=True)
@click.option("--itl-ms", type=_POSITIVE, default=50.0, show_default=True)
@click.option(
    "--workload",
    "workload_path",
    type=click.Path(dir_okay=False, exists=True),
    help="YAML/JSON workload: request classes with lengths, shares and SLOs.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, exists=True),
    help="JSON Lines trace (t, prompt_tokens, output_tokens[, class, prefix_id, "
    "prefix_tokens]); --rate time-scales it.",
)
@click.option("--arrival", type=click.Choice(["poisson", "bursty"]), default=None)
@click.option(
    "--burstiness",
    type=click.FloatRange(min=1.0),
    default=None,
    help="bursty: coefficient of variation of inter-arrival times.",
)
@click.option(
    "--itl-metric",
    type=click.Choice(["mean", "max", "p99"]),
    default=None,
    help="Per-request inter-token SLO on the mean gap (TPOT), the largest gap, or the 99th "
    "percentile of the request's own gaps.",
)
@click.option("--rate", default=None, help="Requests per second (comma list to sweep).")
@click.option("--requests", "count", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--min-duration-s",
    type=_POSITIVE,
    default=30.0,
    show_default=True,
    help="--goodput/--search: each run lasts at least this many seconds of arrivals.",
)
@click.option(
    "--fleet",
    "fleet_specs",
    multiple=True,
    metavar="SPEC",
    help="A configuration, e.g. '8C:H100' or '2P:H100,6D:A100/adaptive,per-request' "
    "(repeat to compare).",
)
@click.option("--colocated", type=click.IntRange(min=0), default=0)
@click.option("--prefill", type=click.IntRange(min=0), default=0)
@click.option("--decode", type=click.IntRange(min=0), default=0)
@click.option("--gpu", default="H100", show_default=True, help="Hardware of every pool.")
@click.option("--prefill-gpu", help="Hardware of the prefill pool (default --gpu).")
@click.option("--decode-gpu", help="Hardware of the decode pool (default --gpu).")
@click.option("--gpus-per-server", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--prefill-gpus-per-server", type=click.IntRange(min=1))
@click.option("--decode-gpus-per-server", type=click.IntRange(min=1))
@click.option(
    "--budget",
    type=click.Choice(["fixed", "adaptive"]),
    default="fixed",
    show_default=True,
    help="Decode/colocated servers' prefill budget.",
)
@click.option("--per-request", is_flag=True, help="Decide per request (D prefills short prompts).")
@click.option(
    "--decide-threshold",
    type=click.IntRange(min=0),
    help="The proxy's decide.threshold_tokens (default: the proxy's default).",
)
@click.option("--routing", "policy", type=_POLICY, default="least_outstanding", show_default=True)
@click.option("--prefix-affinity", is_flag=True)
@click.option(
    "--link",
    "link_name",
    default="NVLink4",
    show_default=True,
    help=f"KV link: {', '.join(LINKS)}.",
)
@click.option("--link-gbps", type=_POSITIVE)
@click.option(
    "--handoff", type=click.Choice(["layerwise", "bulk"]), default="layerwise", show_default=True
)
@click.option(
    "--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True
)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--no-chunked-prefill",
    is_flag=True,
    help="Whole prompts in prefill-only steps first (vLLM V0's default).",
)
@click.option(
    "--efficiency", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True
)
@click.option("--step-overhead-ms", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option(
    "--long-prefill-token-threshold",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="vLLM's cap on one prompt's tokens in a step (0: none).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="The engine's KV block (vLLM: 16 on GPU, 128 on CPU): the adaptive budget's alignment.",
)
@click.option(
    "--adaptive-target-ms",
    type=_POSITIVE,
    default=None,
    help="The adaptive budget's ITL target (default: the tightest class's ITL bound).",
)
@click.option(
    "--calibration",
    "calibration_path",
    type=click.Path(dir_okay=False, exists=True),
    help="Step times from a calibration file (plan --calibrate --json, or gpu_proof): "
    "it replaces the GPU it was measured on; name it 'calibrated' otherwise. A file with a "
    "step_model (benchmarks/calibrate_engine.py) times that model's steps by it.",
)
@click.option(
    "--price",
    "price_items",
    multiple=True,
    metavar="GPU=DOLLARS",
    help="Dollars per GPU-hour (repeatable); default: the catalog's.",
)
@click.option("--goodput", "do_goodput", is_flag=True, help="Find each configuration's capacity.")
@click.option("--search", "do_search", is_flag=True, help="Find the cheapest fleet at --rate.")
@click.option("--search-gpus", default="A100,H100", show_default=True)
@click.option(
    "--target",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.9,
    show_default=True,
    help="SLO attainment a configuration must keep.",
)
@click.option(
    "--slo-scales", default=None, help="--search: also at these SLO scales (cost vs SLO)."
)
@click.option("--plot-dir", type=click.Path(file_okay=False), help="Write PNG plots here.")
@click.option("--json", "as_json", is_flag=True)
def simulate(**kw: Any) -> None:
    """Simulate a fleet serving a workload: attainment, latencies, goodput, cost."""
    try:
        out = _run(**kw)
    except PlannerInputError as e:
        raise click.ClickException(str(e)) from None
    except ValidationError as e:
        raise click.ClickException(explain_validation(e)) from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(_finite(out), indent=2) if kw["as_json"] else out["text"])


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items() if k != "text"}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _run(**kw: Any) -> dict[str, Any]:
    model = get_model(kw["model_name"])
    workload = _workload(kw)
    accelerators, calibrated_link, step_models = _accelerators(kw["calibration_path"])
    if kw["link_gbps"] is not None:
        link = custom_link(kw["link_gbps"])
    elif calibrated_link is not None and _default(kw, "link_name"):
        link = calibrated_link
    else:
        link = get_link(kw["link_name"])
    base = _base_fleet(kw)
    fleets = [parse_fleet(s, base) for s in kw["fleet_specs"]] or [base]
    for f in fleets:
        for p in f.pools:
            if p.gpu not in accelerators:
                raise PlannerInputError(
                    f"unknown GPU {p.gpu!r}; choose one of: {', '.join(accelerators)}"
                )
    trace = read_trace(Path(kw["trace_path"]), workload) if kw["trace_path"] else None
    ctx = Context(model, workload, accelerators, link, kw["count"], kw["seed"], trace)
    ctx.min_duration_s = kw["min_duration_s"]
    ctx.step_models = step_models
    rates = _floats("--rate", kw["rate"]) if kw["rate"] else None
    plot_dir = Path(kw["plot_dir"]) if kw["plot_dir"] else None
    if kw["do_search"]:
        if not rates or len(rates) != 1:
            raise PlannerInputError("--search needs one --rate (the load the fleet must carry)")
        return _search(ctx, fleets[0], rates[0], kw, plot_dir)
    if kw["do_goodput"]:
        return _goodput(ctx, fleets, kw["target"], plot_dir)
    if rates is None:
        if trace is None:
            raise PlannerInputError("give --rate (requests per second), or --trace to replay")
        rates = [(len(trace) - 1) / max(trace.duration_s, 1e-9)]
    runs = {f.label(): [ctx.simulate(f, r) for r in rates] for f in fleets}
    if plot_dir is not None and len(rates) > 1:
        from splitserve.planner.sim.plots import attainment_vs_rate  # noqa: PLC0415

        attainment_vs_rate(runs, kw["target"], plot_dir / "attainment_vs_rate.png")
    return {
        "runs": [r.to_dict() for rs in runs.values() for r in rs],
        "text": render_runs([r for rs in runs.values() for r in rs]),
    }


def _default(kw: dict[str, Any], name: str) -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is None or ctx.get_parameter_source(name) != click.core.ParameterSource.COMMANDLINE


def _workload(kw: dict[str, Any]) -> Workload:
    if kw["workload_path"]:
        wl = load_workload(Path(kw["workload_path"]))
    else:
        wl = Workload.single(kw["prompt_tokens"], kw["output_tokens"], kw["ttft_ms"], kw["itl_ms"])
    update = {k: kw[k] for k in ("arrival", "burstiness", "itl_metric") if kw[k] is not None}
    return Workload.model_validate({**wl.model_dump(), **update}) if update else wl


def _accelerators(
    path: str | None,
) -> tuple[dict[str, Accelerator], Any, dict[str, EngineStepModel]]:
    """The catalog with the calibration's machine as ``calibrated`` (and as the catalog GPU it
    was measured on), its link, and its step model under the same names."""
    accelerators = dict(ACCELERATORS)
    if not path:
        return accelerators, None, {}
    loaded = load_calibration(Path(path))
    names = ["calibrated"] + [n for n in ACCELERATORS if loaded.matches(n)]
    for name in names:
        accelerators[name] = loaded.accelerator
    step_models = {n: loaded.step_model for n in names} if loaded.step_model else {}
    return accelerators, loaded.link, step_models


def _base_fleet(kw: dict[str, Any]) -> Fleet:
    gpu = kw["gpu"]
    per = kw["gpus_per_server"]
    pools = []
    if kw["prefill"] or kw["decode"]:
        pools += [
            PoolSpec(role="prefill", count=kw["prefill"], gpu=kw["prefill_gpu"] or gpu,
                     gpus=kw["prefill_gpus_per_server"] or per),
            PoolSpec(role="decode", count=kw["decode"], gpu=kw["decode_gpu"] or gpu,
                     gpus=kw["decode_gpus_per_server"] or per, budget=kw["budget"]),
        ]  # fmt: skip
    if kw["colocated"] or not pools:
        if not kw["colocated"] and not kw["fleet_specs"] and not kw["do_search"]:
            raise PlannerInputError(
                "no servers: give --colocated N, --prefill N --decode N, or --fleet SPEC"
            )
        pools.append(
            PoolSpec(role="colocated", count=kw["colocated"] or 1, gpu=gpu, gpus=per,
                     budget=kw["budget"])
        )  # fmt: skip
    return Fleet(
        pools=pools,
        server=ServerSettings(
            max_num_batched_tokens=kw["max_num_batched_tokens"],
            max_num_seqs=kw["max_num_seqs"],
            chunked_prefill=not kw["no_chunked_prefill"],
            efficiency=kw["efficiency"],
            step_overhead_ms=kw["step_overhead_ms"],
            long_prefill_token_threshold=kw["long_prefill_token_threshold"],
            adaptive_target_itl_ms=kw["adaptive_target_ms"],
            block_size=kw["block_size"],
            kv_dtype=kw["kv_dtype"].lower(),
            weight_bytes=WEIGHT_DTYPE_BYTES[kw["weight_dtype"].lower()],
        ),
        routing=RoutingSpec(
            prefill=kw["policy"],
            decode=kw["policy"],
            colocated=kw["policy"],
            prefix_affinity=kw["prefix_affinity"],
            per_request=kw["per_request"],
            decide_threshold_tokens=kw["decide_threshold"],
        ),
        link=LinkSpec(name=kw["link_name"], gbps=kw["link_gbps"], mode=kw["handoff"]),
        prices=parse_prices(kw["price_items"]),
    )


def _goodput(
    ctx: Context, fleets: list[Fleet], target: float, plot_dir: Path | None
) -> dict[str, Any]:
    curves: dict[str, list[RunResult]] = {}
    rows = []
    for f in fleets:
        cap, runs = goodput(ctx, f, target)
        curves[f.label()] = runs
        per_gpu = cap / f.gpu_count()
        at = max((r for r in runs if r.attainment >= target), key=lambda r: r.rate, default=None)
        rows.append(
            {
                "fleet": f.label(),
                "gpus": f.gpu_count(),
                "goodput_rps": cap,
                "goodput_per_gpu": per_gpu,
                "cost_per_hour": f.cost_per_hour(),
                "cost_per_million_tokens": at.cost_per_million_tokens if at else math.inf,
                "simulations": len(runs),
            }
        )
    if plot_dir is not None:
        from splitserve.planner.sim.plots import attainment_vs_rate  # noqa: PLC0415

        attainment_vs_rate(curves, target, plot_dir / "attainment_vs_rate.png")
    lines = [f"Goodput at {target:.0%} SLO attainment ({ctx.requests} requests per run)", ""]
    lines.append(
        f"{'fleet':<40} {'GPUs':>5} {'req/s':>9} {'req/s/GPU':>10} {'$/h':>8} {'$/Mtok':>8}"
    )
    for row in rows:
        lines.append(
            f"{row['fleet']:<40} {row['gpus']:>5} {row['goodput_rps']:>9.3g} "
            f"{row['goodput_per_gpu']:>10.3g} {_money(row['cost_per_hour']):>8} "
            f"{_money(row['cost_per_million_tokens'], 3):>8}"
        )
    return {"goodput": rows, "text": "\n".join(lines)}


def _search(
    ctx: Context, base: Fleet, rate: float, kw: dict[str, Any], plot_dir: Path | None
) -> dict[str, Any]:
    gpus = [g.strip() for g in kw["search_gpus"].split(",") if g.strip()]
    answer = cheapest(ctx, base, rate, gpus, kw["target"])
    out: dict[str, Any] = {"search": answer.to_dict(), "text": render_search(answer)}
    if kw["slo_scales"]:
        scales = _floats("--slo-scales", kw["slo_scales"])
        series: dict[str, list[tuple[float, float]]] = {}
        rows = []
        for s in scales:
            wl = ctx.workload.model_copy(
                update={
                    "classes": [
                        c.model_copy(update={"ttft_ms": c.ttft_ms * s, "itl_ms": c.itl_ms * s})
                        for c in ctx.workload.classes
                    ]
                }
            )
            sub = Context(ctx.model, wl, ctx.accelerators, ctx.link, ctx.requests, ctx.seed,
                          ctx.trace, min_duration_s=ctx.min_duration_s,
                          step_models=ctx.step_models)  # fmt: skip
            ans = cheapest(sub, base, rate, gpus, kw["target"])
            for c in ans.candidates:
                series.setdefault(c.layout, []).append((s, c.cost_per_hour))
            rows.append({"slo_scale": s, **ans.to_dict()})
        out["cost_vs_slo"] = rows
        if plot_dir is not None:
            from splitserve.planner.sim.plots import cost_vs_slo  # noqa: PLC0415

            cost_vs_slo(series, plot_dir / "cost_vs_slo.png")
    return out


def _money(x: float, digits: int = 2) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"


def render_runs(runs: list[RunResult]) -> str:
    head = (
        f"{'fleet':<36} {'req/s':>7} {'attain':>7} {'TTFT p90':>9} {'TPOT p90':>9} "
        f"{'gap p99':>8} {'GPUs':>5} {'$/h':>8} {'$/Mtok':>7} {'preempt':>7}"
    )
    lines = [head]
    for r in runs:
        c0 = r.per_class[0]
        lines.append(
            f"{r.label:<36} {r.rate:>7.3g} {r.attainment:>7.1%} "
            f"{c0['ttft_ms']['p90']:>7.0f}ms {c0['tpot_ms']['p90']:>7.1f}ms "
            f"{r.gap_ms['p99']:>6.1f}ms {r.gpus:>5} {_money(r.cost_per_hour):>8} "
            f"{_money(r.cost_per_million_tokens, 3):>7} {r.preemptions:>7}"
        )
        if len(r.per_class) > 1:
            for c in r.per_class:
                lines.append(
                    f"  {c['class']:<34} {'':>7} {c['attainment']:>7.1%} "
                    f"{c['ttft_ms']['p90']:>7.0f}ms {c['tpot_ms']['p90']:>7.1f}ms"
                )
    return "\n".join(lines)


def render_search(answer: SearchAnswer) -> str:
    lines = [f"Cheapest fleet at {answer.rate:g} req/s with {answer.target:.0%} SLO attainment"]
    lines.append(f"({answer.simulations} simulations)")
    lines.append("")
    for c in sorted(answer.candidates, key=lambda c: c.cost_per_hour):
        if c.fleet is None:
            lines.append(f"  {c.layout:<34} infeasible: {c.why}")
        else:
            att = c.result.attainment if c.result else math.nan
            lines.append(
                f"  {c.layout:<34} {c.fleet.label():<30} {c.fleet.gpu_count():>4} GPUs "
                f"${_money(c.cost_per_hour)}/h  attainment {att:.1%}"
            )
    lines.append("")
    if answer.best is None:
        lines.append("No configuration meets the target.")
    else:
        lines.append(f"Cheapest: {answer.best.fleet.label()}")  # type: ignore[union-attr]
        if answer.runner_up is not None:
            lines.append(f"Runner-up: {answer.why_runner_up}")
    return "\n".join(lines)
