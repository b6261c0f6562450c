"""The no-regret table's judgement, kept apart from running it: the issue's two conditions over
the cells (``verdict``), the markdown table (``markdown``) and the plot (``plot``). Pure: the
unit tests drive it with made-up goodputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chunking import FIXED_BUDGETS
from common.plotting import pyplot

# stated before any run (no_regret.py prints them with the results)
WITHIN = 0.95  # adaptive >= WITHIN x best fixed, in every cell
SHORT = 0.80  # a fixed setting <= SHORT x best somewhere "falls >= 20% short"
BASELINES = [f"fixed-{n}" for n in FIXED_BUDGETS] + ["lpt-256"]


def verdict(
    goodputs: dict[str, dict[str, float]], within: float = WITHIN, short: float = SHORT
) -> dict[str, Any]:
    """The issue's two conditions over the complete cells (adaptive and every baseline run).

    Per cell: the best baseline, adaptive / best, each baseline / best (None where the best is 0:
    nobody met the SLO, so nobody is short and the adaptive budget is not behind). Per baseline:
    its worst ratio over the cells and whether that is <= ``short``."""
    complete = {c: g for c, g in goodputs.items() if "adaptive" in g and set(BASELINES) <= set(g)}
    cells: dict[str, Any] = {}
    for name, g in complete.items():
        best_name = max(BASELINES, key=lambda b: g[b])
        best = g[best_name]
        ratios = {b: (g[b] / best if best > 0 else None) for b in BASELINES}
        cells[name] = {
            "best": best_name,
            "best_goodput": best,
            "adaptive_ratio": g["adaptive"] / best if best > 0 else None,
            "adaptive_within": g["adaptive"] >= within * best,
            "ratios": ratios,
        }
    worst: dict[str, float | None] = {}
    for b in BASELINES:
        seen = [c["ratios"][b] for c in cells.values() if c["ratios"][b] is not None]
        worst[b] = min(seen) if seen else None
    falls = {b: w is not None and w <= short for b, w in worst.items()}
    no_regret = bool(cells) and all(c["adaptive_within"] for c in cells.values())
    every_fixed = bool(cells) and all(falls.values())
    return {
        "complete_cells": sorted(cells),
        "incomplete_cells": sorted(set(goodputs) - set(complete)),
        "cells": cells,
        "worst_ratio": worst,
        "falls_short": falls,
        "adaptive_within_everywhere": no_regret,
        "every_fixed_falls_short_somewhere": every_fixed,
        "target_met": no_regret and every_fixed,
    }


def markdown(goodputs: dict[str, dict[str, float]], v: dict[str, Any]) -> str:
    cols = [*BASELINES, "adaptive"]
    lines = [
        "| cell | " + " | ".join(cols) + " | best fixed | adaptive / best |",
        "|---|" + "---:|" * len(cols) + "---|---:|",
    ]
    for name, g in goodputs.items():
        vals = " | ".join("-" if c not in g else f"{g[c]:.2f}" for c in cols)
        cell = v["cells"].get(name)
        if cell is None:
            lines.append(f"| {name} | {vals} | (incomplete) | - |")
            continue
        r = cell["adaptive_ratio"]
        mark = "" if cell["adaptive_within"] else " (miss)"
        lines.append(
            f"| {name} | {vals} | {cell['best']} | {'-' if r is None else f'{r:.3f}'}{mark} |"
        )
    worst = " | ".join(
        "-"
        if (w := v["worst_ratio"][b]) is None
        else f"{w:.3f}" + ("" if v["falls_short"][b] else " (never)")
        for b in BASELINES
    )
    lines.append(f"| worst / best over cells | {worst} | | | |")
    lines += [
        "",
        f"Goodput in good requests/s. Complete cells: {len(v['complete_cells'])} of 8"
        + (f"; incomplete: {', '.join(v['incomplete_cells'])}" if v["incomplete_cells"] else "")
        + ".",
        f"Adaptive within {1 - WITHIN:.0%} of the best fixed setting in every complete cell: "
        f"{'yes' if v['adaptive_within_everywhere'] else 'no'}.",
        f"Every fixed setting >= {1 - SHORT:.0%} short of the best in some complete cell: "
        f"{'yes' if v['every_fixed_falls_short_somewhere'] else 'no'}.",
        f"Target met (over the complete cells): {'yes' if v['target_met'] else 'no'}.",
    ]
    return "\n".join(lines)


def plot(goodputs: dict[str, dict[str, float]], v: dict[str, Any], path: Path) -> bool:
    """Each complete cell's goodputs over its best fixed setting's, one bar per contender, with
    the two thresholds drawn (0.95: the adaptive budget's; 0.80: a fixed setting's regret).
    False (nothing written) without matplotlib or without a complete cell."""
    plt = pyplot()
    names = [c for c in goodputs if c in v["cells"]]
    if plt is None or not names:
        return False
    cols = [*BASELINES, "adaptive"]
    width = 0.8 / len(cols)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names)) + 1.8, 4))
    for k, col in enumerate(cols):
        ys = [
            goodputs[n][col] / v["cells"][n]["best_goodput"]
            if v["cells"][n]["best_goodput"] > 0
            else 0.0
            for n in names
        ]
        xs = [i + (k - (len(cols) - 1) / 2) * width for i in range(len(names))]
        style = {"color": "black"} if col == "adaptive" else {}
        ax.bar(xs, ys, width, label=col, **style)
    ax.axhline(WITHIN, color="green", linestyle="--", linewidth=1, label=f"{WITHIN:g} x best")
    ax.axhline(SHORT, color="red", linestyle=":", linewidth=1, label=f"{SHORT:g} x best")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("goodput / best fixed setting's")
    ax.set_title("No-regret table: goodput per cell against the best fixed setting")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
