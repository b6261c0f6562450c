"""benchmarks/soak.py's report, pure (no servers): errors inside and outside kill windows,
latency per minute, RSS and fd growth per process, the issue's targets, and the PNG."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from common.plotting import pyplot

from soakbench.load import Record

logger = logging.getLogger("soak")

TARGETS = {
    "errors_outside_pct": 1.0,
    "proxy_rss_growth_mb": 50.0,
    "engine_rss_growth_mb": 200.0,
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_window(r: Record, t0: float, windows: list[list[float]]) -> bool:
    s, e = r.start - t0, r.end - t0
    return any(s <= w1 and e >= w0 for w0, w1 in windows)


def growth(rows: list[dict[str, Any]], name: str, warmup_s: float) -> dict[str, Any]:
    """RSS and fd growth of each process that held ``name``: its last sample minus its first
    sample at least ``warmup_s`` after that process first showed up (a restarted server's warm
    up is not growth)."""
    per_pid: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        entry = row.get(name)
        if entry and entry["pid"]:
            per_pid.setdefault(entry["pid"], []).append({**entry, "t": row["t"]})
    out = {}
    for pid, entries in per_pid.items():
        start = entries[0]["t"] + warmup_s
        steady = [e for e in entries if e["t"] >= start]
        if len(steady) >= 2:
            out[str(pid)] = {
                "rss_mb": round(steady[-1]["rss_mb"] - steady[0]["rss_mb"], 1),
                "fds": steady[-1]["fds"] - steady[0]["fds"],
                "seconds": round(steady[-1]["t"] - steady[0]["t"]),
            }
    return out


def summarize(
    records: list[Record],
    rows: list[dict[str, Any]],
    windows: list[list[float]],
    t0: float,
    checks: list[dict[str, Any]],
    idle_kv: dict[str, float | None],
    args: argparse.Namespace,
) -> dict[str, Any]:
    sent = [r for r in records if r.outcome != "left"]
    outside = [r for r in sent if not in_window(r, t0, windows)]
    inside = [r for r in sent if in_window(r, t0, windows)]
    err_out = [r for r in outside if r.outcome == "error"]
    err_in = [r for r in inside if r.outcome == "error"]
    minutes: dict[int, list[float]] = {}
    for r in sent:
        if r.outcome == "ok":
            minutes.setdefault(int((r.start - t0) // 60), []).append(r.end - r.start)
    per_minute = [
        {
            "minute": m,
            "requests": len(v),
            "p50_s": round(percentile(v, 0.5) or 0, 3),
            "p99_s": round(percentile(v, 0.99) or 0, 3),
        }
        for m, v in sorted(minutes.items())
    ]
    growths = {name: growth(rows, name, args.warmup_s) for name in rows[0] if name != "t"}
    proxy_growth = max((g["rss_mb"] for g in growths.get("proxy", {}).values()), default=None)
    engine_growth = max(
        (g["rss_mb"] for n, gs in growths.items() if n != "proxy" for g in gs.values()),
        default=None,
    )
    equal = sum(1 for c in checks if c["equal"])
    summary = {
        "minutes": args.minutes,
        "pairs": args.pairs,
        "concurrency": args.concurrency,
        "requests": len(records),
        "left_by_client": len(records) - len(sent),
        "ok": sum(1 for r in sent if r.outcome == "ok"),
        "errors_inside_windows": len(err_in),
        "requests_inside_windows": len(inside),
        "errors_outside_windows": len(err_out),
        "requests_outside_windows": len(outside),
        "errors_outside_pct": round(100 * len(err_out) / max(1, len(outside)), 3),
        "kill_windows_s": [[round(a, 1), round(b, 1)] for a, b in windows],
        "per_minute": per_minute,
        "growth": growths,
        "proxy_rss_growth_mb": proxy_growth,
        "engine_rss_growth_mb": engine_growth,
        "idle_kv": idle_kv,
        "checked": len(checks),
        "checked_equal": equal,
        "error_examples_outside": sorted({r.error[:160] for r in err_out})[:10],
        "error_examples_inside": sorted({r.error[:160] for r in err_in})[:10],
    }
    summary["targets_met"] = targets_met(summary)
    return summary


def targets_met(s: dict[str, Any]) -> dict[str, bool]:
    return {
        "errors_outside_lt_1pct": s["errors_outside_pct"] < TARGETS["errors_outside_pct"],
        "idle_kv_zero": all(v == 0.0 for v in s["idle_kv"].values()),
        "proxy_rss_growth_lt_50mb": (s["proxy_rss_growth_mb"] or 0.0)
        < TARGETS["proxy_rss_growth_mb"],
        "engine_rss_growth_lt_200mb": (s["engine_rss_growth_mb"] or 0.0)
        < TARGETS["engine_rss_growth_mb"],
        "checked_all_equal": s["checked"] > 0 and s["checked_equal"] == s["checked"],
    }


def plot(path: Path, records: list[Record], rows: list, windows: list, t0: float) -> None:
    plt = pyplot()
    if plt is None:
        logger.warning("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ok = [r for r in records if r.outcome == "ok"]
    bad = [r for r in records if r.outcome == "error"]
    axes[0].scatter([r.start - t0 for r in ok], [r.end - r.start for r in ok], s=3, label="ok")
    axes[0].scatter(
        [r.start - t0 for r in bad], [r.end - r.start for r in bad], s=12, c="red", label="error"
    )
    axes[0].set_ylabel("latency (s)")
    axes[0].set_yscale("log")
    axes[0].legend(loc="upper right")
    names = [n for n in rows[0] if n != "t"]
    ts = [row["t"] for row in rows]
    for name in names:
        if name != "proxy":
            axes[1].plot(ts, [(row[name].get("kv") or 0) * 100 for row in rows], label=name)
        axes[2].plot(ts, [row[name]["rss_mb"] for row in rows], label=name)
        axes[3].plot(ts, [row[name]["fds"] for row in rows], label=name)
    axes[1].set_ylabel("KV usage (%)")
    axes[2].set_ylabel("RSS of tree (MB)")
    axes[3].set_ylabel("open fds")
    axes[3].set_xlabel("seconds since load start")
    for ax in axes:
        for w0, w1 in windows:
            ax.axvspan(w0, min(w1, ts[-1]), color="orange", alpha=0.2)
        if ax is not axes[0]:
            ax.legend(loc="upper right", fontsize=7)
    fig.suptitle("soak: latency, KV, RSS, fds (orange: kill windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
