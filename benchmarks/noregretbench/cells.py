"""benchmarks/no_regret.py's experiment as stated before any run: the seed, the two model sizes'
cells (``MODELS``: ITL targets, TTFT bounds, loads and windows; ``Cell``, ``CELLS``), the
adaptive target's share of a cell's ITL target, the run plan (``plan``: the baselines once per
(model, workload), one adaptive run per target, the order rotated), the seeded workloads
(``arrivals``: goodput.py's mixed one, chunking.py's phased one), the time scale (``scaled``)
and the definition printed with the results."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from chunkingbench.load import build_schedule
from goodputbench.client import Arrival
from goodputbench.workload import workload as mixed_workload

from noregretbench.verdict import BASELINES

# ---------------------------------------------------------------------- stated before any run

SEED = 18
ADAPTIVE_TARGET_SHARE = 0.6  # target_itl_ms = 0.6 x the cell's ITL target (docs/scheduler.md)
WORKLOADS = ("mixed", "phased")


@dataclass(frozen=True)
class ModelCells:
    """One model size's part of the table: its two ITL targets, TTFT bounds and load.

    The targets are set from the model's cost per prefill token on one core (tiny ~0.1 ms, mid
    ~1 ms: docs/benchmarks.md): the tight one lets only the smaller fixed chunks beside decodes,
    the loose one most of them, so the best fixed budget can differ from cell to cell."""

    itl_ms: tuple[float, float]
    ttft_short_s: float  # chat (mixed) / short (phased) requests
    ttft_long_s: float  # documents (mixed) / long prompts (phased)
    mixed_rate: float  # req/s of the mixed workload
    phased_short_rate: float  # req/s of short streams in a busy phase
    period_s: float  # phased: busy + quiet
    duration_s: float  # arrival window of a full run
    quick_duration_s: float  # arrival window of a --quick run


MODELS: dict[str, ModelCells] = {
    "tiny": ModelCells((50.0, 150.0), 1.0, 3.0, 2.0, 3.0, 12.0, 48.0, 24.0),
    "mid": ModelCells((400.0, 1200.0), 1.5, 8.0, 0.5, 1.0, 20.0, 80.0, 40.0),
}
PHASED = {"busy_fraction": 0.5, "quiet_longs": 2, "drain": 2.0}
SHORT_PROMPT, SHORT_OUTPUT, LONG_PROMPT, LONG_OUTPUT = 32, 96, 3000, 8  # phased requests
QUICK_CELLS = ("tiny-mixed-50", "tiny-mixed-150")

# ---------------------------------------------------------------------- cells and the run plan


@dataclass(frozen=True)
class Cell:
    """One cell as stated (``itl_ms``, named after it) and the machine's time scale: every
    bound the cell checks is the stated one times ``scale``."""

    model: str
    workload: str
    itl_ms: float
    scale: float = 1.0

    @property
    def name(self) -> str:
        return f"{self.model}-{self.workload}-{self.itl_ms:g}"

    @property
    def itl_s(self) -> float:
        return self.itl_ms * self.scale / 1e3

    @property
    def ttft_bounds_s(self) -> tuple[float, float]:
        """(chat/short, document/long) TTFT bounds, scaled."""
        m = MODELS[self.model]
        return m.ttft_short_s * self.scale, m.ttft_long_s * self.scale

    @property
    def adaptive_run(self) -> str:
        return f"adaptive-{round(ADAPTIVE_TARGET_SHARE * self.itl_ms * self.scale, 3):g}ms"


CELLS = [Cell(m, w, t) for m in MODELS for w in WORKLOADS for t in MODELS[m].itl_ms]


def scaled(cells: list[Cell], scale: float) -> list[Cell]:
    return [replace(c, scale=scale) for c in cells]


def plan(cells: list[Cell], only: str = "all") -> list[tuple[str, str, list[str]]]:
    """(model, workload, runs in order) for the selected cells: the baselines once per
    (model, workload), one adaptive run per ITL target, the order rotated by the pair's index
    among all eight cells' pairs (so no contender always runs first). ``only``: "adaptive" or
    "baselines" keeps those runs of the rotated order."""
    pairs = [(m, w) for m in MODELS for w in WORKLOADS]
    out = []
    for k, pair in enumerate(pairs):
        mine = [c for c in cells if (c.model, c.workload) == pair]
        if not mine:
            continue
        runs = BASELINES + sorted({c.adaptive_run for c in mine})
        shift = k % len(runs)
        order = runs[shift:] + runs[:shift]
        if only != "all":
            order = [r for r in order if r.startswith("adaptive-") == (only == "adaptive")]
        out.append((*pair, order))
    return out


# ---------------------------------------------------------------------- workloads (pure)


def arrivals(
    model: str, workload: str, duration_s: float, seed: int = SEED, scale: float = 1.0
) -> list[Arrival]:
    """The seeded arrivals of one (model, workload) over the stated ``duration_s``: the same for
    every contender; ``scale`` stretches their times (the same requests, ``scale`` x later)."""
    stated = _stated_arrivals(model, workload, duration_s, seed)
    if scale == 1.0:
        return stated
    return [replace(a, at_s=a.at_s * scale) for a in stated]


def _stated_arrivals(model: str, workload: str, duration_s: float, seed: int) -> list[Arrival]:
    m = MODELS[model]
    if workload == "mixed":
        return mixed_workload(m.mixed_rate, duration_s, seed)
    rng = random.Random(f"{seed}-phased-{model}")
    ns = argparse.Namespace(
        workload="phased",
        duration=duration_s,
        period=m.period_s,
        short_rate=m.phased_short_rate,
        **PHASED,
    )
    out = []
    for at, kind in build_schedule(ns, rng):
        n, k = (SHORT_PROMPT, SHORT_OUTPUT) if kind == "short" else (LONG_PROMPT, LONG_OUTPUT)
        prompt = tuple(rng.randint(5, 1000) for _ in range(n))
        out.append(Arrival(at, "chat" if kind == "short" else "doc", prompt, k))
    return out


# ---------------------------------------------------------------------- printed with the results


def definition(scale: float = 1.0) -> str:
    parts = [
        f"goodput = requests meeting the cell's SLO per second of arrivals (seed {SEED}); SLO: no "
        "error, TTFT within the class bound, the request's own p99 inter-token gap <= the cell's "
        f"ITL target; adaptive target_itl_ms = {ADAPTIVE_TARGET_SHARE:g} x ITL target"
    ]
    if scale != 1.0:
        parts.append(
            f"time scale {scale:g}: every arrival time, window, TTFT bound, ITL target and "
            "adaptive target below is multiplied by it (cells keep their stated names)"
        )
    for name, m in MODELS.items():
        parts.append(
            f"{name}: ITL targets {m.itl_ms[0]:g} / {m.itl_ms[1]:g} ms, TTFT <= "
            f"{m.ttft_short_s:g} s (chat/short), <= {m.ttft_long_s:g} s (document/long), mixed "
            f"at {m.mixed_rate:g} req/s, phased shorts at {m.phased_short_rate:g} req/s, period "
            f"{m.period_s:g} s"
        )
    return "; ".join(parts)
