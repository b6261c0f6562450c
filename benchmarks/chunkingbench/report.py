"""benchmarks/chunking.py's report: one configuration's figures from its requests
(``summarize``: ITL over all gaps, TTFT per class, throughput, goodput under the SLO), the
markdown table, the PNG and the text bars."""

from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path

from common.plotting import pyplot

from chunkingbench.load import RequestResult

logger = logging.getLogger("benchmarks.chunking")


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
