"""benchmarks/goodput.py's workload, stated before any run: the two request classes (chat and
document prompt and output ranges, ``DOC_SHARE``), the seed, the seeded open-loop Poisson
arrivals at a rate (``workload``; also benchmarks/no_regret.py's mixed workload) and each
contender's salted copy of them (``salted``)."""

from __future__ import annotations

import random

from goodputbench.client import Arrival

CHAT_PROMPT = (32, 512)
CHAT_OUTPUT = (64, 256)
DOC_PROMPT = (1500, 4000)
DOC_OUTPUT = (16, 64)
DOC_SHARE = 0.2
SEED = 18


def workload(rate: float, duration_s: float, seed: int = SEED) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second over ``duration_s``, every draw from ``seed``
    (so every contender gets the same requests at a rate)."""
    rng = random.Random(f"{seed}-{rate}")
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        doc = rng.random() < DOC_SHARE
        lo, hi = DOC_PROMPT if doc else CHAT_PROMPT
        olo, ohi = DOC_OUTPUT if doc else CHAT_OUTPUT
        prompt = tuple(rng.randint(5, 1000) for _ in range(rng.randint(lo, hi)))
        out.append(Arrival(t, "doc" if doc else "chat", prompt, rng.randint(olo, ohi)))


def salted(arrivals: list[Arrival], k: int) -> list[Arrival]:
    """The workload for the ``k``-th contender: the same arrivals, lengths and outputs, with the
    first prompt token shifted by ``k``. Contenders that share servers (``pd`` and
    ``pd-decide``) would otherwise find every prompt of the one before in the prefix cache (block
    hashes chain from the first token, so one changed token leaves nothing to reuse)."""
    out = []
    for a in arrivals:
        first = 5 + (a.prompt[0] - 5 + 199 * k) % 996
        out.append(Arrival(a.at_s, a.kind, (first, *a.prompt[1:]), a.max_tokens))
    return out
