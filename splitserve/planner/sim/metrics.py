"""What one simulated run measured: per-class SLO attainment, latency percentiles, costs.

Pure; runs in the simulating process. Per request the recorder keeps TTFT, the mean gap after
the first token (TPOT) and the largest gap; inter-token gaps over all tokens go into a
log-spaced histogram (1% wide bins, so a percentile is exact to 1%) weighted by the tokens each
step emitted, which costs O(1) per engine step however large its batch.

Invariant: every request the run admitted is counted once, as finished or as rejected (its
prompt and output cannot fit one server's KV memory); a rejected request misses its SLO.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any

BINS_PER_DECADE = 230  # 10 ** (1 / 230) = 1.0101: 1% bins
MIN_GAP_S = 1e-6
NBINS = BINS_PER_DECADE * 10  # 1 us to 10,000 s


def percentile(sorted_values: list[float] | array, q: float) -> float:
    """Nearest-rank percentile of already sorted values (NaN when empty)."""
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])


class GapHistogram:
    """Token-weighted inter-token gaps in 1% bins."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (NBINS + 1)
        self.total = 0

    def add(self, gap_s: float, tokens: int) -> None:
        if tokens <= 0:
            return
        i = int(math.log10(max(gap_s, MIN_GAP_S) / MIN_GAP_S) * BINS_PER_DECADE)
        self.counts[i if i < NBINS else NBINS] += tokens
        self.total += tokens

    def percentile(self, q: float) -> float:
        if not self.total:
            return math.nan
        need = q / 100 * self.total
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= need and c:
                return MIN_GAP_S * 10 ** ((i + 1) / BINS_PER_DECADE)  # bin's upper edge
        return math.inf


@dataclass
class ClassRecord:
    """Per-request figures of one class, in completion order."""

    name: str
    ttft_s: float
    itl_s: float
    ttft: array = field(default_factory=lambda: array("d"))
    tpot: array = field(default_factory=lambda: array("d"))
    max_gap: array = field(default_factory=lambda: array("d"))
    latency: array = field(default_factory=lambda: array("d"))
    attained: int = 0
    rejected: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def count(self) -> int:
        return len(self.ttft) + self.rejected


def p99_slow_allowed(gaps: int) -> int:
    """How many of a request's ``gaps`` may exceed the bound while the 99th percentile of its
    gaps stays within it: the percentile is the sorted gaps' element ``round(0.99 (n - 1))``
    (nearest rank, as ``benchmarks/goodput.py`` takes it), so every gap above that rank may."""
    if gaps <= 0:
        return 0
    return gaps - 1 - int(round(0.99 * (gaps - 1)))


class Recorder:
    """Collects a run's per-request and per-step figures."""

    def __init__(self, classes: list[tuple[str, float, float]], itl_metric: str) -> None:
        self.classes = [ClassRecord(n, ttft, itl) for n, ttft, itl in classes]
        self.use_max_gap = itl_metric == "max"
        self.use_p99 = itl_metric == "p99"
        # p99: the distinct ITL bounds and each class's index among them (servers count the
        # decode steps whose gap exceeds each bound)
        self.itl_bounds = sorted({c.itl_s for c in self.classes})
        self.bound_of_class = [self.itl_bounds.index(c.itl_s) for c in self.classes]
        self.gaps = GapHistogram()
        self.preemptions = 0
        self.local_prefills = 0  # per-request rule: prefilled on D
        self.remote_prefills = 0
        self.decisions: dict[str, int] = {}

    def finished(
        self,
        ci: int,
        arrival: float,
        first_t: float,
        last_t: float,
        prompt: int,
        output: int,
        max_gap: float,
        slow: int = 0,
    ) -> None:
        rec = self.classes[ci]
        ttft = first_t - arrival
        tpot = (last_t - first_t) / (output - 1) if output > 1 else 0.0
        rec.ttft.append(ttft)
        rec.tpot.append(tpot)
        rec.max_gap.append(max_gap)
        rec.latency.append(last_t - arrival)
        rec.output_tokens += output
        rec.prompt_tokens += prompt
        if self.use_p99:
            ok = slow <= p99_slow_allowed(output - 1)
        else:
            ok = (max_gap if self.use_max_gap else tpot) <= rec.itl_s
        if ttft <= rec.ttft_s and ok:
            rec.attained += 1

    def rejected(self, ci: int) -> None:
        self.classes[ci].rejected += 1

    def decided(self, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1


@dataclass
class RunResult:
    """The summary of one run (``to_dict`` is the JSON output)."""

    label: str
    rate: float
    requests: int
    duration_s: float
    gpus: int
    cost_per_hour: float
    attainment: float
    per_class: list[dict[str, Any]]
    gap_ms: dict[str, float]
    preemptions: int
    decisions: dict[str, int]
    peak_kv_share: float
    events: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    mean_in_system: float
    mean_latency_s: float

    @property
    def cost_per_million_tokens(self) -> float:
        """Fleet dollars per million tokens (prompt + output) at the served rate."""
        tokens_per_hour = (self.output_tokens + self.prompt_tokens) / self.duration_s * 3600
        return self.cost_per_hour / tokens_per_hour * 1e6 if tokens_per_hour else math.inf

    @property
    def cost_per_million_output_tokens(self) -> float:
        per_hour = self.output_tokens / self.duration_s * 3600
        return self.cost_per_hour / per_hour * 1e6 if per_hour else math.inf

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["cost_per_million_tokens"] = self.cost_per_million_tokens
        out["cost_per_million_output_tokens"] = self.cost_per_million_output_tokens
        return out


def summarize_class(rec: ClassRecord) -> dict[str, Any]:
    ttft = sorted(rec.ttft)
    tpot = sorted(rec.tpot)
    gap = sorted(rec.max_gap)
    n = rec.count
    return {
        "class": rec.name,
        "requests": n,
        "rejected": rec.rejected,
        "attainment": rec.attained / n if n else math.nan,
        "slo_ttft_ms": rec.ttft_s * 1e3,
        "slo_itl_ms": rec.itl_s * 1e3,
        "ttft_ms": {f"p{q}": percentile(ttft, q) * 1e3 for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": percentile(tpot, q) * 1e3 for q in (50, 90, 99)},
        "max_gap_ms": {f"p{q}": percentile(gap, q) * 1e3 for q in (50, 90, 99)},
    }
