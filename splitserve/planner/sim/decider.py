"""The per-request disaggregation rule as the simulator calls it: prefill on D, or go through P.

Pure; runs in the simulating process. The proxy's own decider (issue #18,
``splitserve/proxy/decide.py``) did not exist when this was written: the simulator calls any
object that satisfies :class:`Decider`, and :class:`ThresholdDecider` states issue #18's three
rules. When the proxy's decider lands, an adapter that maps :class:`DecisionFacts` onto its
inputs replaces ``ThresholdDecider`` in :func:`make_decider` (one place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

LOCAL = True  # prefill on the chosen D
REMOTE = False  # prefill on P, then hand the KV to D


@dataclass(frozen=True)
class DecisionFacts:
    """What the proxy knows when a request arrives (all estimates, as a proxy has them)."""

    prompt_tokens: int
    d_cached_tokens: int  # prompt head the chosen D already holds (prefix cache)
    p_wait_s: float  # estimated queueing on the chosen P before its prefill starts
    p_prefill_s: float  # estimated prefill time on P (alone)
    d_prefill_s: float  # estimated prefill time of the uncached tokens on D (alone)


class Decider(Protocol):
    def decide(self, facts: DecisionFacts) -> tuple[bool, str]:
        """``(LOCAL or REMOTE, reason)``."""
        ...


class ThresholdDecider:
    """Issue #18's rule: D prefills when the uncached prompt is short, when D holds most of the
    prompt, or when waiting for P would cost more than D's own prefill."""

    def __init__(self, threshold_tokens: int = 512, cached_share: float = 0.5) -> None:
        self.threshold_tokens = threshold_tokens
        self.cached_share = cached_share

    def decide(self, facts: DecisionFacts) -> tuple[bool, str]:
        uncached = facts.prompt_tokens - facts.d_cached_tokens
        if uncached < self.threshold_tokens:
            return LOCAL, "short"
        if facts.d_cached_tokens >= self.cached_share * facts.prompt_tokens:
            return LOCAL, "prefix_on_d"
        if facts.p_wait_s > facts.d_prefill_s:
            return LOCAL, "p_busy"
        return REMOTE, "long"


def make_decider(threshold_tokens: int) -> Decider:
    """The decider the simulator uses (see module docstring)."""
    return ThresholdDecider(threshold_tokens)
