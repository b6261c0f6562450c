"""benchmarks/no_regret.py's goodput under a cell's SLO, pure: what the SLO needs of one request
(``record``, kept in the JSON so any SLO can be re-read), whether it meets a cell's SLO
(``meets``), a run's goodput in a cell (``goodput``) and the table of goodputs per cell and
contender (``table``) that ``verdict`` judges."""

from __future__ import annotations

from typing import Any

from goodputbench.client import Result, pct

from noregretbench.cells import Cell
from noregretbench.verdict import BASELINES


def record(r: Result) -> dict[str, Any]:
    """What a cell's SLO needs of one request (kept in the JSON, so any SLO can be re-read)."""
    gap = pct(r.gaps, 99)
    return {
        "kind": r.kind,
        "ttft_s": r.ttft,
        "gap_p99_s": gap,
        "tokens": len(r.times),
        "error": r.error,
    }


def meets(rec: dict[str, Any], cell: Cell) -> bool:
    if rec["error"] is not None or rec["ttft_s"] is None:
        return False
    short, long = cell.ttft_bounds_s
    if rec["ttft_s"] > (long if rec["kind"] == "doc" else short):
        return False
    return rec["gap_p99_s"] is None or rec["gap_p99_s"] <= cell.itl_s


def goodput(run: dict[str, Any], cell: Cell) -> float:
    """Requests meeting ``cell``'s SLO per second of the run's arrival window."""
    return sum(meets(r, cell) for r in run["requests"]) / run["duration_s"]


def table(runs: dict[str, dict[str, Any]], cells: list[Cell]) -> dict[str, dict[str, float]]:
    """{cell: {contender: goodput}} for what was run (``adaptive`` is the cell's own target)."""
    out: dict[str, dict[str, float]] = {}
    for c in cells:
        row = {}
        for name in [*BASELINES, "adaptive"]:
            key = f"{c.model}-{c.workload}-{c.adaptive_run if name == 'adaptive' else name}"
            if key in runs:
                row[name] = goodput(runs[key], c)
        if row:
            out[c.name] = row
    return out
