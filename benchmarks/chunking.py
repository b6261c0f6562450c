"""Adaptive chunk size vs fixed token budgets vs vLLM's own long-prefill cap, on one vLLM server.

A script, not a test. For each configuration it starts one CPU vLLM server, drives the same
seeded mixed workload with a small streaming driver of ours, stops the server, and reports:

- ITL p50 / p99 over *all* inter-token gaps of all requests (a stream's p99 would hide its one
  worst stall);
- TTFT p50 / p99 of the short requests and of the long prompts;
- output throughput (tokens/s) over the measurement window;
- goodput: requests per second that met the SLO (TTFT bound by class, and the request's own p99
  inter-token gap under ``--slo-itl-ms``); the SLO is stated in the output.

Workload: short prompts with long outputs, arriving as a seeded Poisson stream, plus a long
prompt every ``--long-every`` seconds (fresh random token ids; prefix caching off, so no prompt
is ever a cache hit); or, with ``--workload phased``, busy phases of shorts alternating with
quiet phases of long prompts (``build_schedule``, in ``chunkingbench/load.py``). Rivals:
``--max-num-batched-tokens`` 256 / 512 / 1024 / 2048 / 4096, and
``--long-prefill-token-threshold`` 256 with a 4096 budget, plain and with
``--long-prefill-token-threshold-adaptive``. vLLM's ``prefill_schedule_interval`` applies only to
data-parallel MoE engines (``DPEngineCoreProc``), so it has no effect on one dense-model engine and
is not a rival here.

Usage (the shared machine: see docs/benchmarks.md for the recorded run):

    .venv/bin/python benchmarks/chunking.py --duration 30 --out results/chunking.json

Writes JSON (and a PNG when matplotlib is importable) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from chunkingbench.load import build_schedule as build_schedule
from chunkingbench.load import drive, warm_up
from chunkingbench.report import markdown_table, maybe_plot, summarize, text_plot

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec

logger = logging.getLogger("benchmarks.chunking")

SCHEDULER_CLS = "splitserve.schedulers.vllm.AdaptiveChunkScheduler"


@dataclass(frozen=True)
class Config:
    name: str
    args: list[str]


def configs(adaptive_target_ms: float, max_tokens: int) -> list[Config]:
    budget = ["--max-num-batched-tokens", str(max_tokens)]
    settings = {"splitserve_scheduler": {"target_itl_ms": adaptive_target_ms}}
    out = [
        Config(
            "adaptive",
            [
                *budget,
                "--scheduler-cls",
                SCHEDULER_CLS,
                "--additional-config",
                json.dumps(settings),
            ],
        )
    ]
    out += [Config(f"fixed-{n}", ["--max-num-batched-tokens", str(n)]) for n in FIXED_BUDGETS]
    out.append(Config("lpt-256", [*budget, "--long-prefill-token-threshold", "256"]))
    out.append(
        Config(
            "lpt-256-adaptive",
            [
                *budget,
                "--long-prefill-token-threshold",
                "256",
                "--long-prefill-token-threshold-adaptive",
            ],
        )
    )
    return out


FIXED_BUDGETS = (256, 512, 1024, 2048, 4096)


def run_config(config: Config, model: Path, log_dir: Path, args: argparse.Namespace) -> dict:
    group = ServerGroup(log_dir)
    try:
        server = group.add_vllm(
            config.name,
            str(model),
            served_model_name="bench",
            extra_args=[*config.args, "--no-enable-prefix-caching", *args.extra_server_arg],
        )
        group.wait(args.start_timeout)
        asyncio.run(warm_up(server.url))
        results, window = asyncio.run(drive(server.url, args))
    finally:
        group.stop()
    summary = summarize(results, window, args)
    summary["config"] = config.name
    summary["server_args"] = config.args
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: build --preset)")
    p.add_argument("--preset", default="tiny", help="splitserve.models preset to build")
    p.add_argument("--duration", type=float, default=30.0, help="arrival window (s)")
    p.add_argument("--short-rate", type=float, default=2.0, help="short requests per second")
    p.add_argument("--short-prompt", type=int, default=32)
    p.add_argument("--short-output", type=int, default=96)
    p.add_argument("--long-prompt", type=int, default=3000)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-every", type=float, default=5.0, help="seconds between long prompts")
    p.add_argument("--workload", choices=("poisson", "phased"), default="poisson")
    p.add_argument("--period", type=float, default=12.0, help="phased: busy + quiet (s)")
    p.add_argument("--busy-fraction", type=float, default=0.5, help="phased: busy share")
    p.add_argument("--quiet-longs", type=int, default=2, help="phased: long prompts when quiet")
    p.add_argument("--drain", type=float, default=2.0, help="phased: quiet longs' delay (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=4096, help="budget of adaptive and lpt runs")
    p.add_argument("--adaptive-target-ms", type=float, default=None, help="default: SLO ITL x 0.6")
    p.add_argument("--slo-itl-ms", type=float, default=150.0)
    p.add_argument("--slo-ttft-short-s", type=float, default=1.0)
    p.add_argument("--slo-ttft-long-s", type=float, default=4.0)
    p.add_argument("--only", default="", help="comma-separated config names to run")
    p.add_argument("--extra-server-arg", action="append", default=[])
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--out", type=Path, default=Path("results/chunking.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    target = args.adaptive_target_ms or 0.6 * args.slo_itl_ms
    work = Path(tempfile.mkdtemp(prefix="chunking-bench-"))
    model = args.model or build_model(resolve_spec(args.preset), work / args.preset)
    chosen = [
        c
        for c in configs(target, args.max_tokens)
        if not args.only or c.name in args.only.split(",")
    ]
    rows = []
    for config in chosen:
        logger.info("running %s: %s", config.name, " ".join(config.args))
        rows.append(run_config(config, model, work / "logs", args))
        logger.info("%s: %s", config.name, json.dumps(rows[-1]))
    rivals = [r for r in rows if r["config"] != "adaptive"]
    best = max(rivals, key=lambda r: r["goodput_req_s"], default=None)
    adaptive = next((r for r in rows if r["config"] == "adaptive"), None)
    ratio = None
    if best and adaptive and best["goodput_req_s"] > 0:
        ratio = adaptive["goodput_req_s"] / best["goodput_req_s"]
    report = {
        "slo": {
            "itl_p99_per_request_ms": args.slo_itl_ms,
            "ttft_short_s": args.slo_ttft_short_s,
            "ttft_long_s": args.slo_ttft_long_s,
        },
        "adaptive_target_itl_ms": target,
        "workload": {k: v for k, v in vars(args).items() if k not in ("out", "model")},
        "model": str(model),
        "rows": rows,
        "best_rival": best["config"] if best else None,
        "adaptive_over_best_rival_goodput": ratio,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plotted = maybe_plot(rows, args.out.with_suffix(".png"))
    sys.stdout.write(markdown_table(rows, report["best_rival"]))
    sys.stdout.write("\n```\n" + text_plot(rows) + "\n```\n")
    sys.stdout.write(
        f"\nSLO: short TTFT <= {args.slo_ttft_short_s} s, long TTFT <= {args.slo_ttft_long_s} s, "
        f"each request's p99 inter-token gap <= {args.slo_itl_ms} ms; adaptive target "
        f"{target:.0f} ms. adaptive / best rival goodput: "
        f"{'n/a' if ratio is None else f'{ratio:.2f}x'}"
        f"{'' if plotted else ' (no PNG: matplotlib not installed)'}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
