"""What a run reports: a progress line per cell, the markdown table, the JSON and the PNG."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common.plotting import pyplot


def add_relative(row: dict[str, Any], names: list[str]) -> None:
    """Each contender's figures against ``direct``'s in the same cell (``names[0]``)."""
    d = row["direct"]
    for name in names[1:]:
        r = row[name]
        r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"]
        r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"]
        r["rps_vs_direct"] = r["rps"] / d["rps"]


def progress_line(row: dict[str, Any], names: list[str]) -> str:
    """One cell on one line: each contender's p50 (added to direct's) and req/s."""
    parts = [f"stream={row['stream']!s:5} c={row['concurrency']:<4}"]
    for name in names:
        r = row[name]
        parts.append(
            f"{name} p50 {r['p50_ms']:.2f} ms"
            + (f" ({r['added_p50_ms']:+.2f})" if name != "direct" else "")
            + f" {r['rps']:.0f}/s"
            + (f" (FAILED: {r['failed']})" if r["failed"] else "")
        )
    return " | ".join(parts)


def print_table(results: list[dict[str, Any]], names: list[str]) -> None:
    """A markdown table: per cell and contender, p50 / p99 / added p50 / req/s / CPU."""
    print("\n| stream | conc. | contender | p50 ms | p99 ms | added p50 ms | added p99 ms "
          "| req/s | req/s vs direct | CPU us/request |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for name in names:
            r = row[name]
            if name == "direct":
                added = ("", "", "")
            else:
                p50, p99, ratio = r["added_p50_ms"], r["added_p99_ms"], r["rps_vs_direct"]
                added = (f"{p50:+.2f}", f"{p99:+.2f}", f"x{ratio:.2f}")
            cpu = f"{r['cpu_us_per_request']:.0f}" if "cpu_us_per_request" in r else ""
            print(f"| {'yes' if row['stream'] else 'no'} | {row['concurrency']} | {name} "
                  f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added[0]} | {added[1]} "
                  f"| {r['rps']:.0f} | {added[2]} | {cpu} |")  # fmt: skip


def plot(results: list[dict[str, Any]], names: list[str], path: Path, title: str) -> bool:
    """Added p50, req/s and CPU per request against concurrency, streamed or not."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no PNG (the JSON has every figure)")
        return False
    concs = sorted({row["concurrency"] for row in results})
    color = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one color per contender
    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True)
    for col, stream in enumerate((False, True)):
        rows = {row["concurrency"]: row for row in results if row["stream"] == stream}
        xs = [c for c in concs if c in rows]
        what = "streamed" if stream else "not streamed"
        for name in names:
            style = {"color": color[name], "marker": "o", "label": name}
            if name != "direct":
                added = [max(rows[c][name]["added_p50_ms"], 1e-2) for c in xs]
                axes[0][col].plot(xs, added, **style)
                cpu = [rows[c][name]["cpu_us_per_request"] for c in xs]
                axes[2][col].plot(xs, cpu, **style)
            axes[1][col].plot(xs, [rows[c][name]["rps"] for c in xs], **style)
        axes[0][col].set_title(f"{what}: added p50 latency (dotted: 0.5 ms target)")
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("ms over direct (log)")
        axes[0][col].axhline(0.5, color="grey", ls=":", lw=1)
        axes[1][col].set_title(f"{what}: throughput")
        axes[1][col].set_ylabel("requests/s")
        axes[2][col].set_title(f"{what}: CPU time per request (proxy processes)")
        axes[2][col].set_ylabel("us")
        axes[2][col].set_xscale("log", base=2)
        axes[2][col].set_xticks(concs, [str(c) for c in concs])
        axes[2][col].set_xlabel("concurrent clients")
    axes[1][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def write_json(
    path: Path,
    results: list[dict[str, Any]],
    missing: list[str],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float] | None,
    load: str = "python",
    stub_server: str = "aiohttp",
) -> dict[str, Any]:
    """The results with the run's conditions (load generator, stubs, load average, argv)."""
    meta = {
        "load_generator": load,
        "stub_server": stub_server,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "argv": sys.argv[1:],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"meta": meta, "results": results, "not_measured": missing}, indent=2)
    )
    return meta
