"""benchmarks/goodput.py's contenders (issue #18: (a) to (e)) and their rotated order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contender:
    name: str
    group: str  # contenders of one group share servers
    label: str


CONTENDERS = [
    Contender("colocated", "colocated", "(a) 2 colocated, least loaded, default budget"),
    Contender("colocated-lpt", "colocated-lpt", "(b) 2 colocated, budget 4096, lpt 256"),
    Contender("colocated-adaptive", "colocated-adaptive", "(c) 2 colocated, adaptive budget"),
    Contender("pd", "pd", "(d) 1 P + 1 D, every request disaggregated"),
    Contender("pd-decide", "pd", "(e) 1 P + 1 D, per-request decision, adaptive budget on D"),
]


def order_for(round_index: int, contenders: list[Contender] = CONTENDERS) -> list[Contender]:
    """Contenders rotated by the round (rate) index, keeping a group's members together (they
    share servers): group order rotates, members keep their order."""
    groups: list[list[Contender]] = []
    for c in contenders:
        if groups and groups[-1][0].group == c.group:
            groups[-1].append(c)
        else:
            groups.append([c])
    k = round_index % len(groups)
    return [c for g in groups[k:] + groups[:k] for c in g]
