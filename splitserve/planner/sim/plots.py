"""Plots of simulated runs (matplotlib, imported only when a plot is asked for).

Runs in the CLI or benchmark process; writes PNG files. Two figures:
- attainment vs request rate, one line per configuration, the target as a dashed line;
- cost per hour of the cheapest fleet per layout vs the SLO's scale (1 = the workload's SLO).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from splitserve.planner.sim.metrics import RunResult


def _pyplot():  # noqa: ANN202 - matplotlib's module
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def attainment_vs_rate(
    curves: Mapping[str, Sequence[RunResult]], target: float, path: Path, title: str = ""
) -> Path:
    """One line per configuration: SLO attainment against request rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, runs in curves.items():
        pts = sorted((r.rate, r.attainment) for r in runs)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", ms=3, label=label)
    ax.axhline(100 * target, ls="--", c="gray", lw=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.set_title(title or "SLO attainment vs request rate")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cost_vs_slo(
    series: Mapping[str, Sequence[tuple[float, float]]], path: Path, title: str = ""
) -> Path:
    """One line per layout: the cheapest fleet's dollars per hour against the SLO scale."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, pts in series.items():
        pts = sorted(p for p in pts if p[1] == p[1] and p[1] != float("inf"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
    ax.set_xlabel("SLO scale (x the workload's TTFT and inter-token targets)")
    ax.set_ylabel("cheapest fleet meeting the SLO ($/h)")
    ax.set_title(title or "cost vs SLO")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
