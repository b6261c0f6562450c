"""What a contender is, and the CPU time its processes spend (the least noisy figure)."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass
class Contender:
    name: str
    url: str
    pid: int | None  # whose CPU time is counted (None: direct)


def rotated(contenders: list[Contender], k: int) -> list[Contender]:
    """Round ``k``'s order: the contenders rotated by ``k``, so that a burst of load from
    elsewhere hits all of them alike over the rounds."""
    k %= len(contenders)
    return contenders[k:] + contenders[:k]


def tree_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process and its children (proxy workers, router threads)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total
