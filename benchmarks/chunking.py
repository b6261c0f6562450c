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
quiet phases of long prompts (``build_schedule``). Rivals: ``--max-num-batched-tokens`` 256 /
512 / 1024 / 2048 / 4096, and
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
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from common.plotting import pyplot

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec

logger = logging.getLogger("benchmarks.chunking")

SCHEDULER_CLS = "splitserve.schedulers.vllm.AdaptiveChunkScheduler"


@dataclass
class RequestResult:
    kind: str  # "short" | "long"
    sent: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


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


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, result
) -> None:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.first_token is None:
                    result.first_token = now
                result.token_times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = repr(exc)


def build_schedule(args: argparse.Namespace, rng: random.Random) -> list[tuple[float, str]]:
    """(arrival offset s, "short" | "long"), sorted.

    ``poisson``: shorts as a Poisson stream over the whole window, a long prompt every
    ``--long-every`` s. ``phased``: the load alternates, every ``--period`` s: a busy phase
    (the first ``--busy-fraction`` of the period) of Poisson shorts with one long prompt in its
    middle, then a quiet phase without shorts where ``--quiet-longs`` long prompts arrive
    together ``--drain`` s after the busy phase ended (the decodes have finished by then). A
    fixed budget must choose: small chunks protect the busy phase's streams, large ones the
    quiet phase's long prompts."""
    schedule: list[tuple[float, str]] = []
    if args.workload == "poisson":
        t = 0.0
        while True:
            t += rng.expovariate(args.short_rate)
            if t >= args.duration:
                break
            schedule.append((t, "short"))
        n_long = int(args.duration // args.long_every)
        schedule += [(k * args.long_every + 0.5, "long") for k in range(n_long)]
        return sorted(schedule)
    busy = args.period * args.busy_fraction
    start = 0.0
    while start < args.duration:
        t = start
        while True:
            t += rng.expovariate(args.short_rate)
            if t >= start + busy:
                break
            schedule.append((t, "short"))
        schedule.append((start + busy / 2, "long"))
        schedule += [(start + busy + args.drain, "long")] * args.quiet_longs
        start += args.period
    return sorted(schedule)


async def drive(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """The seeded mixed workload; returns the results and the window length (s)."""
    rng = random.Random(args.seed)
    schedule = build_schedule(args, rng)

    results: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=args.duration * 20 + 600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        start = time.perf_counter()
        for offset, kind in schedule:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if kind == "short":
                prompt = [rng.randint(5, 1000) for _ in range(args.short_prompt)]
                max_tokens = args.short_output
            else:
                prompt = [rng.randint(5, 1000) for _ in range(args.long_prompt)]
                max_tokens = args.long_output
            result = RequestResult(kind, time.perf_counter())
            results.append(result)
            tasks.append(asyncio.create_task(_stream(session, url, prompt, max_tokens, result)))
        await asyncio.gather(*tasks)
        window = time.perf_counter() - start
    return results, window


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(results: list[RequestResult], window: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.error is None and r.first_token is not None]
    gaps = [g for r in ok for g in r.gaps]
    short_ttft = [r.ttft for r in ok if r.kind == "short"]
    long_ttft = [r.ttft for r in ok if r.kind == "long"]
    tokens = sum(len(r.token_times) for r in ok)

    def good(r: RequestResult) -> bool:
        bound = args.slo_ttft_short_s if r.kind == "short" else args.slo_ttft_long_s
        if r.ttft is None or r.ttft > bound:
            return False
        own = r.gaps
        return not own or _pct(own, 99) <= args.slo_itl_ms / 1e3

    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "itl_p50_ms": 1e3 * (_pct(gaps, 50) or 0),
        "itl_p99_ms": 1e3 * (_pct(gaps, 99) or 0),
        "itl_max_ms": 1e3 * (max(gaps) if gaps else 0),
        "ttft_short_p50_s": _pct(short_ttft, 50),
        "ttft_short_p99_s": _pct(short_ttft, 99),
        "ttft_long_p50_s": _pct(long_ttft, 50),
        "ttft_long_p99_s": _pct(long_ttft, 99),
        "throughput_tok_s": tokens / window,
        "goodput_req_s": sum(good(r) for r in ok) / window,
        "good_fraction": sum(good(r) for r in ok) / max(len(results), 1),
        "window_s": window,
        "mean_itl_ms": 1e3 * statistics.fmean(gaps) if gaps else 0,
    }


async def _warm_up(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        result = RequestResult("warmup", time.perf_counter())
        await _stream(session, url, list(range(10, 300)), 8, result)
        if result.error:
            raise RuntimeError(f"warm-up request failed: {result.error}")


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
        asyncio.run(_warm_up(server.url))
        results, window = asyncio.run(drive(server.url, args))
    finally:
        group.stop()
    summary = summarize(results, window, args)
    summary["config"] = config.name
    summary["server_args"] = config.args
    return summary


def markdown_table(rows: list[dict], best_rival: str | None) -> str:
    head = (
        "| config | ITL p50 ms | ITL p99 ms | ITL max ms | TTFT short p50/p99 s "
        "| TTFT long p50/p99 s | tok/s | goodput req/s | good % |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = []
    for r in rows:
        name = r["config"] + (" (best rival)" if r["config"] == best_rival else "")
        lines.append(
            f"| {name} | {f(r['itl_p50_ms'], '.0f')} | {f(r['itl_p99_ms'], '.0f')} "
            f"| {f(r['itl_max_ms'], '.0f')} "
            f"| {f(r['ttft_short_p50_s'], '.2f')} / {f(r['ttft_short_p99_s'], '.2f')} "
            f"| {f(r['ttft_long_p50_s'], '.2f')} / {f(r['ttft_long_p99_s'], '.2f')} "
            f"| {f(r['throughput_tok_s'], '.0f')} | {f(r['goodput_req_s'], '.2f')} "
            f"| {100 * r['good_fraction']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def maybe_plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        logger.warning("matplotlib is not installed: no PNG plot (the table has the figures)")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["config"] for r in rows]
    ax1.bar(names, [r["goodput_req_s"] for r in rows])
    ax1.set_ylabel("goodput (req/s)")
    ax2.bar(names, [r["itl_p99_ms"] for r in rows])
    ax2.set_ylabel("ITL p99 (ms)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def text_plot(rows: list[dict]) -> str:
    """Goodput as text bars (kept in docs/benchmarks.md next to the table)."""
    top = max((r["goodput_req_s"] for r in rows), default=0) or 1
    width = max(len(r["config"]) for r in rows)
    return "\n".join(
        f"{r['config']:<{width}} {'#' * round(40 * r['goodput_req_s'] / top):<40} "
        f"{r['goodput_req_s']:.2f} req/s"
        for r in rows
    )


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
