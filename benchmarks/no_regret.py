"""No-regret table for the adaptive chunk scheduler alone, on unified (single) vLLM servers
(issue #18): two model sizes x two ITL targets x two workloads = 8 cells; in each cell the
adaptive budget's goodput against every fixed budget and vLLM's ``long_prefill_token_threshold``.

A script, not a test. Everything below the "stated before any run" line is fixed before a server
starts and printed with the results.

- **Contenders** (one CPU vLLM server each, pinned to one core with ``taskset`` and
  ``VLLM_CPU_OMP_THREADS_BIND``, chunked prefill, prefix caching off so no prompt is ever a cache
  hit): ``fixed-N`` = ``--max-num-batched-tokens N`` for N in 256 / 512 / 1024 / 2048 / 4096;
  ``lpt-256`` = budget 4096 with ``--long-prefill-token-threshold 256``; ``adaptive`` = budget
  4096 with ``AdaptiveChunkScheduler`` and ``target_itl_ms`` = 0.6 x the cell's ITL target (the
  tuning docs/scheduler.md gives).
- **Workloads**, seeded, the same for every contender of a model size: ``mixed`` is
  ``benchmarks/goodput.py``'s open-loop Poisson mix (80% chat: prompts 32-512, outputs 64-256;
  20% documents: prompts 1,500-4,000, outputs 16-64) at the model's rate; ``phased`` is
  ``benchmarks/chunking.py``'s phased load (busy phases of short streams with one long prompt in
  their middle, quiet phases where long prompts arrive together), which makes a fixed budget
  choose between the busy phase's gaps and the quiet phase's TTFT.
- **SLO per cell**: a request meets it when it did not fail, its TTFT is within its class's
  bound (the model size's, below) and the 99th percentile of its own inter-token gaps is within
  the cell's ITL target. **Goodput** = requests meeting the SLO per second of the arrival window
  (every contender gets the same arrivals, so goodputs compare like attainments).
- **Verdict** (``verdict``): a cell's best fixed setting is the best of the five fixed budgets
  and ``lpt-256``; the adaptive budget is "within 5%" when its goodput >= 0.95 x that best; a
  fixed setting "falls >= 20% short" in a cell when its goodput <= 0.8 x the best. The issue's
  target holds when the adaptive budget is within 5% in every cell and every fixed setting falls
  >= 20% short in at least one cell.

**Time scale** (``--time-scale S``, default 1): a machine S times slower than the one the
cells were stated for runs the same experiment S times slower: every arrival time, arrival
window, TTFT bound, ITL target and adaptive target is multiplied by S (the requests themselves are
the stated ones). ``benchmarks/calibrate_engine.py`` prints the machine's factor (goodput.py's
``--slo-scale``); the cells keep their stated names and the report records S.

The fixed settings do not depend on the ITL target, so one run of each serves both targets'
cells of its (model, workload); only the adaptive budget runs once per target. Runs of a
(model, workload) rotate their order by its index; results are written to ``--out`` after every
run, so a hold of the lock that ends early keeps what it measured, and ``--from-json`` merges the
runs of several holds into one table.

Usage:

    .venv/bin/python benchmarks/no_regret.py --dry-run                  # the plan, no servers
    .venv/bin/python benchmarks/no_regret.py --quick --out runs/no-regret-quick.json
    .venv/bin/python benchmarks/no_regret.py --quick --cells mid-mixed-400,mid-mixed-1200 --out ...
    .venv/bin/python benchmarks/no_regret.py --from-json A.json B.json --out AB.json --plot AB.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chunking import SCHEDULER_CLS
from common.metrics import metrics_text
from common.scheduler_settings import HELP as SCHEDULER_SET_HELP
from common.scheduler_settings import parse_scheduler_sets
from goodput import MAX_MODEL_LEN
from goodputbench.client import Arrival, Result, drive
from noregretbench.cells import (
    CELLS,
    MODELS,
    QUICK_CELLS,
    SEED,
    Cell,
    arrivals,
    definition,
    plan,
    scaled,
)
from noregretbench.cells import PHASED as PHASED
from noregretbench.cells import WORKLOADS as WORKLOADS
from noregretbench.slo import goodput, record, table
from noregretbench.verdict import BASELINES as BASELINES
from noregretbench.verdict import markdown, plot, verdict
from prometheus_client.parser import text_string_to_metric_families

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec
from splitserve.netutil import free_ports

logger = logging.getLogger("benchmarks.no_regret")

# ---------------------------------------------------------------------- stated before any run
# The seed, the models' cells, their workloads and the run plan: noregretbench/cells.py; the
# verdict's thresholds: noregretbench/verdict.py. Here: the contenders' servers.

LARGE_BUDGET = 4096  # start-up budget of lpt-256 and adaptive (the scheduler only lowers it)

# Adaptive options beyond the defaults (--scheduler-set), recorded in the report.
SCHEDULER_EXTRA: dict[str, Any] = {}


def server_args(run: str) -> list[str]:
    """Engine flags of one contender's server (``run``: a baseline or ``adaptive-<target>ms``)."""
    base = ["--max-model-len", str(MAX_MODEL_LEN), "--enable-chunked-prefill"]
    base.append("--no-enable-prefix-caching")
    if run.startswith("fixed-"):
        return [*base, "--max-num-batched-tokens", run.removeprefix("fixed-")]
    base += ["--max-num-batched-tokens", str(LARGE_BUDGET)]
    if run == "lpt-256":
        return [*base, "--long-prefill-token-threshold", "256"]
    target = float(run.removeprefix("adaptive-").removesuffix("ms"))
    settings = {"splitserve_scheduler": {"target_itl_ms": target, **SCHEDULER_EXTRA}}
    return [*base, "--scheduler-cls", SCHEDULER_CLS, "--additional-config", json.dumps(settings)]


# ---------------------------------------------------------------------- running


def _check_warm(results: list[Result]) -> None:
    bad = [r.error for r in results if r.error or r.ttft is None]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad}")


def scheduler_decisions(text: str) -> dict[str, float]:
    """The adaptive scheduler's budget decisions by reason (fits / min_chunk / no_decodes),
    warm-up included: how often the target left it the whole budget or only its floor."""
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "splitserve_scheduler_budget_decisions_total"
    }


def run_one(model_dir: Path, run: str, reqs: list[Arrival], log_dir: Path, core: int) -> dict:
    """Start one contender's server on ``core``, warm it, drive ``reqs``, stop it."""
    args = server_args(run)
    metrics_port = None
    if run.startswith("adaptive-"):
        metrics_port = free_ports(1)[0]
        i = args.index("--additional-config") + 1
        settings = json.loads(args[i])
        settings["splitserve_scheduler"]["metrics_port"] = metrics_port
        args[i] = json.dumps(settings)
    group = ServerGroup(log_dir)
    try:
        t0 = time.perf_counter()
        server = group.add_vllm(
            run,
            str(model_dir),
            served_model_name="bench",
            extra_args=args,
            cpu_core=core,
            cpus=[core],
            env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        )
        group.wait(900.0)
        started = time.perf_counter() - t0
        warm = [tuple(10 + i % 900 for i in range(n)) for n in (64, 2000)]
        _check_warm(asyncio.run(drive(server.url, [Arrival(0, "chat", p, 4) for p in warm])))
        t1 = time.perf_counter()
        results = asyncio.run(drive(server.url, reqs))
        wall = time.perf_counter() - t1
        scheduler = None
        if metrics_port is not None:
            scheduler = scheduler_decisions(metrics_text(f"http://127.0.0.1:{metrics_port}"))
    finally:
        group.stop()
    return {
        "server_args": args,
        "start_s": started,
        "wall_s": wall,
        "scheduler": scheduler,
        "requests": [record(r) for r in results],
    }


def run(args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="no-regret-"))
    scale = args.time_scale
    report: dict[str, Any] = {
        "definition": definition(scale),
        "args": _jsonable(vars(args)),
        "time_scale": scale,
        "scheduler_settings": dict(SCHEDULER_EXTRA),
        "runs": {},
    }
    models: dict[str, Path] = {}
    for model, wl, order in plan(cells, args.only):
        m = MODELS[model]
        stated = m.quick_duration_s if args.quick else (args.duration or m.duration_s)
        reqs = arrivals(model, wl, stated, args.seed, scale)
        duration = stated * scale
        if model not in models:
            models[model] = build_model(resolve_spec(model), work / model)
        logger.info("%s/%s: %d requests over %g s; order %s", model, wl, len(reqs), duration, order)
        for name in order:
            key = f"{model}-{wl}-{name}"
            one = run_one(models[model], name, reqs, work / "logs" / key, args.core)
            one.update(
                {
                    "model": model,
                    "workload": wl,
                    "contender": name,
                    "duration_s": duration,
                    "at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                }
            )
            report["runs"][key] = one
            for c in cells:
                if (c.model, c.workload) == (model, wl):
                    logger.info("%s in %s: goodput %.2f req/s", name, c.name, goodput(one, c))
            _write(args.out, report, cells)
    return report


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _write(path: Path | None, report: dict[str, Any], cells: list[Cell]) -> None:
    g = table(report["runs"], cells)
    report["goodput"], report["verdict"] = g, verdict(g)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


def merge(reports: list[dict[str, Any]], replace_runs: bool = False) -> dict[str, Any]:
    """The runs of several reports as one (a run measured twice is an error: which counts?,
    unless ``replace_runs``: a later report's run replaces an earlier one, and the report lists
    it; a mix of time scales is always an error: which bounds apply?)."""
    scales = {report_scale(r) for r in reports}
    if len(scales) > 1:
        raise SystemExit(f"cannot merge: the reports ran at different time scales {sorted(scales)}")
    runs: dict[str, Any] = {}
    replaced: list[str] = []
    for r in reports:
        for key, one in r["runs"].items():
            if key in runs:
                if not replace_runs:
                    raise SystemExit(f"cannot merge: {key} measured twice (--replace: the later)")
                replaced.append(key)
            runs[key] = one
    return {
        "definition": reports[0]["definition"],
        "args": {"merged_from": len(reports), "replaced": replaced},
        "time_scale": scales.pop(),
        "runs": runs,
    }


def report_scale(report: dict[str, Any]) -> float:
    """A report's time scale (reports written before ``--time-scale`` existed ran at 1)."""
    return float(report.get("time_scale", 1.0))


def dry_run(
    cells: list[Cell], quick: bool, duration: float | None, seed: int, only: str = "all"
) -> str:
    scale = cells[0].scale if cells else 1.0
    lines = [definition(scale), "cells: " + ", ".join(c.name for c in cells)]
    for model, wl, order in plan(cells, only):
        m = MODELS[model]
        stated = m.quick_duration_s if quick else (duration or m.duration_s)
        d = stated * scale
        # The stated window, as the run passes it: d / scale is not always the stated float
        # (48 * 1.6 / 1.6 > 48), and one ulp more let a phased schedule start another period.
        reqs = arrivals(model, wl, stated, seed, scale)
        docs = sum(a.kind == "doc" for a in reqs)
        lines.append(
            f"{model}/{wl}: {len(reqs)} requests ({docs} documents/long) over {d:g} s, "
            f"{sum(len(a.prompt) for a in reqs)} prompt tokens; runs in order: {', '.join(order)}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Cell]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--cells",
        default="",
        help="comma-separated cell names (default: all 8; "
        f"--quick: {','.join(QUICK_CELLS)}); one of {[c.name for c in CELLS]}",
    )
    ap.add_argument("--quick", action="store_true", help="short runs (the model's quick window)")
    ap.add_argument("--duration", type=float, help="arrival window (s) of full runs")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--core", type=int, default=0, help="the CPU core every server is pinned to")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="how many times slower this machine is than the stated one "
        "(calibrate_engine.py prints it): multiplies every time of the experiment",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    ap.add_argument("--out", type=Path, help="JSON results (rewritten after every run)")
    ap.add_argument("--from-json", type=Path, nargs="+", help="merge written reports, run nothing")
    ap.add_argument(
        "--only",
        choices=("all", "adaptive", "baselines"),
        default="all",
        help="run only the adaptive budget's runs or only the baselines (merge them later)",
    )
    ap.add_argument(
        "--replace", action="store_true", help="--from-json: a later report's run replaces"
    )
    ap.add_argument("--plot", type=Path, help="PNG: each cell's goodputs over its best fixed one")
    ap.add_argument("--scheduler-set", action="append", default=[], metavar="KEY=VALUE",
                    help=SCHEDULER_SET_HELP)  # fmt: skip
    args = ap.parse_args(argv)
    SCHEDULER_EXTRA.clear()
    try:
        SCHEDULER_EXTRA.update(parse_scheduler_sets(args.scheduler_set))
    except ValueError as e:
        ap.error(str(e))
    by_name = {c.name: c for c in CELLS}
    names = [x for x in args.cells.split(",") if x] or (
        list(QUICK_CELLS) if args.quick else list(by_name)
    )
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        ap.error(f"--cells: unknown cell(s) {unknown}")
    if not args.time_scale > 0:
        ap.error(f"--time-scale must be positive, got {args.time_scale}")
    return args, scaled([by_name[n] for n in names], args.time_scale)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args, cells = parse_args(argv)
    if args.from_json:
        report = merge([json.loads(p.read_text()) for p in args.from_json], args.replace)
        _write(args.out, report, scaled(CELLS, report["time_scale"]))
        _show(report, args.plot)
        return 0
    print(dry_run(cells, args.quick, args.duration, args.seed, args.only), flush=True)
    if SCHEDULER_EXTRA:
        print(f"adaptive scheduler settings beyond its defaults: {SCHEDULER_EXTRA}", flush=True)
    if args.dry_run:
        return 0
    report = run(args, cells)
    _write(args.out, report, cells)
    _show(report, args.plot)
    return 0


def _show(report: dict[str, Any], plot_path: Path | None) -> None:
    print(markdown(report["goodput"], report["verdict"]))
    if plot_path is not None and plot(report["goodput"], report["verdict"], plot_path):
        print(f"plot: {plot_path}")


if __name__ == "__main__":
    sys.exit(main())
