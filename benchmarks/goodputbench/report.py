"""benchmarks/goodput.py's report, pure (no servers): capacity under the SLO, the markdown
tables, sweeps merged, the attainment plot. ``goal``: the SLO's attainment goal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from goodputbench.contenders import CONTENDERS

# Stated before any run (benchmarks/goodput.py's SLO): capacity is the highest swept rate with at
# least this share of requests within the SLO there and at every lower rate.
ATTAINMENT_GOAL = 0.90


def capacity(attainment_by_rate: dict[float, float], goal: float = ATTAINMENT_GOAL) -> float:
    """The highest swept rate at which this and every lower swept rate reach ``goal`` (0 when
    the lowest rate already misses it)."""
    best = 0.0
    for rate in sorted(attainment_by_rate):
        if attainment_by_rate[rate] < goal:
            break
        best = rate
    return best


def markdown(report: dict[str, Any]) -> str:
    lines = [
        report["slo"],
        "",
        "| contender | rate/s | attainment (chat / doc) | chat TTFT p50/p99 s | doc TTFT p50/p99 s "
        "| chat gap-p99 p50/p90 ms | doc gap-p99 p50/p90 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for r in sorted(report["rows"], key=lambda r: (r["contender"], r["rate"])):
        ch, doc = r["chat"], r["doc"]
        lines.append(
            f"| {r['contender']} | {r['rate']:g} | {r['attainment']:.0%} "
            f"({ch['attainment']:.0%} of {ch['n']} / {doc['attainment']:.0%} of {doc['n']}) | "
            f"{f(ch['ttft_p50_s'])} / {f(ch['ttft_p99_s'])} | "
            f"{f(doc['ttft_p50_s'])} / {f(doc['ttft_p99_s'])} | "
            f"{f(ch['gap_p99_p50_ms'], 0)} / {f(ch['gap_p99_p90_ms'], 0)} | "
            f"{f(doc['gap_p99_p50_ms'], 0)} / {f(doc['gap_p99_p90_ms'], 0)} | {r['errors']} |"
        )
    caps = report["capacity"]
    best_rival = max((v for k, v in caps.items() if k != "pd-decide"), default=0.0)
    lines += ["", "| contender | capacity under SLO (req/s) |", "|---|---:|"]
    lines += [f"| {k} | {v:g} |" for k, v in caps.items()]
    if "pd-decide" in caps and best_rival > 0:
        lines.append(f"\n(e) / best of (a)-(d): {caps['pd-decide'] / best_rival:.2f}x")
    sched = [r for r in report["rows"] if r.get("scheduler") or r.get("decisions")]
    if sched:
        lines += [
            "",
            "Adaptive scheduler (cumulative per server group and rate; D for pd) and the proxy's"
            " decisions:",
            "",
            "| contender | rate/s | steps | budget decisions | steps predicted within 10/20/50% "
            "| proxy decisions |",
            "|---|---:|---:|---|---:|---|",
        ]
        for r in sorted(sched, key=lambda r: (r["contender"], r["rate"])):
            s = r.get("scheduler") or {}
            under = s.get("share_under") or {}
            within = " / ".join(
                f"{under[k]:.0%}" if k in under else "-" for k in ("0.1", "0.2", "0.5")
            )
            dec = ", ".join(f"{k} {v:g}" for k, v in (s.get("decisions") or {}).items()) or "-"
            prox = ", ".join(f"{k} {v:g}" for k, v in (r.get("decisions") or {}).items()) or "-"
            lines.append(
                f"| {r['contender']} | {r['rate']:g} | {s.get('steps', 0):g} | {dec} | {within} "
                f"| {prox} |"
            )
    return "\n".join(lines)


def merge(reports: list[dict[str, Any]], goal: float = ATTAINMENT_GOAL) -> dict[str, Any]:
    """One report from sweeps of the same workload (preset, duration, seed) at different rates:
    their rows together, capacity recomputed over the union of rates (a rate measured twice is
    an error: which run would count?)."""
    first = reports[0]
    same = ("preset", "duration", "seed")
    for r in reports[1:]:
        if any(r["args"].get(k) != first["args"].get(k) for k in same):
            raise SystemExit(f"cannot merge: {same} differ ({r['args']} vs {first['args']})")
    rows = [row for r in reports for row in r["rows"]]
    seen: set[tuple[str, float]] = set()
    for row in rows:
        key = (row["contender"], float(row["rate"]))
        if key in seen:
            raise SystemExit(f"cannot merge: {key} measured twice")
        seen.add(key)
    names = [c.name for c in CONTENDERS if any(r["contender"] == c.name for r in rows)]
    caps = {
        n: capacity({r["rate"]: r["attainment"] for r in rows if r["contender"] == n}, goal)
        for n in names
    }
    rates = sorted({float(r["rate"]) for r in rows})
    args = {**first["args"], "rates": rates, "merged_from": len(reports)}
    return {"slo": first["slo"], "args": args, "rows": rows, "capacity": caps}


def plot(report: dict[str, Any], path: Path, goal: float = ATTAINMENT_GOAL) -> None:
    """Attainment vs arrival rate, one line per contender, the 90% goal drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {c.name: c.label for c in CONTENDERS}
    for name in report["capacity"]:
        rows = sorted(
            (r for r in report["rows"] if r["contender"] == name), key=lambda r: r["rate"]
        )
        ax.plot([r["rate"] for r in rows], [100 * r["attainment"] for r in rows], "o-",
                label=labels.get(name, name))  # fmt: skip
    ax.axhline(100 * goal, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(f"goodput.py, preset {report['args'].get('preset')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
