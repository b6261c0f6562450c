"""Server pools and the policies that pick one server of a pool per request.

Runs in the proxy process, on its event loop (no locks: every change happens on that loop).
Policies: round-robin, least-outstanding, power-of-two-choices, and, for the prefill pool,
prefix affinity (a consistent hash of the prompt's head, so requests sharing a head reach the
same P and hit its prefix cache; when that P is out, the ring's next server takes over and only
its share of keys moves). Invariants: a pick only ever returns a healthy server of the configured
pool that the caller did not exclude; no healthy candidate raises ``NoHealthyServer`` at once.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from splitserve.proxy.errors import NoHealthyServer


@dataclass(eq=False)
class Backend:
    """One upstream server and its live state."""

    pool: str
    url: str
    settings: Any = None  # the PrefillEndpoint / DecodeEndpoint it came from
    outstanding: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejections: int = 0
    last_error: str | None = None
    labels: tuple[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.labels = (self.pool, self.url)


class Policy(Protocol):
    def choose(self, candidates: Sequence[Backend]) -> Backend: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        return candidates[next(self._counter) % len(candidates)]


class LeastOutstanding:
    """Fewest requests in flight; ties rotate so equal servers share the load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        n = len(candidates)
        start = next(self._counter) % n
        best = candidates[start]
        for i in range(1, n):
            b = candidates[(start + i) % n]
            if b.outstanding < best.outstanding:
                best = b
        return best


class PowerOfTwo:
    """Two random candidates, the one with fewer requests in flight."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Backend]) -> Backend:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        x, y = candidates[a], candidates[b]
        return y if y.outstanding < x.outstanding else x


POLICIES = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
}


def _hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes over a fixed set of backends."""

    def __init__(self, backends: Sequence[Backend], vnodes: int = 100) -> None:
        self._backends = list(backends)
        points = sorted(
            (_hash64(f"{b.url}#{i}"), idx)
            for idx, b in enumerate(self._backends)
            for i in range(vnodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [i for _, i in points]

    def walk(self, key: str) -> Iterable[Backend]:
        """Backends in ring order starting at ``key``'s position, each once."""
        start = bisect.bisect(self._hashes, _hash64(key))
        seen: set[int] = set()
        n = len(self._hashes)
        for k in range(n):
            owner = self._owners[(start + k) % n]
            if owner not in seen:
                seen.add(owner)
                yield self._backends[owner]
                if len(seen) == len(self._backends):
                    return


class Pool:
    """The servers of one role and the policy that picks among the healthy ones."""

    def __init__(
        self, name: str, backends: Sequence[Backend], policy: str, prefix_affinity: bool = False
    ) -> None:
        if not backends:
            raise ValueError(f"pool {name!r} has no servers")
        self.name = name
        self.backends = list(backends)
        self.policy: Policy = POLICIES[policy]()
        self.ring = HashRing(self.backends) if prefix_affinity else None

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, affinity_key: str | None = None, exclude: Iterable[Backend] = ()) -> Backend:
        excluded = set(exclude)
        if self.ring is not None and affinity_key is not None:
            for b in self.ring.walk(affinity_key):
                if b.healthy and b not in excluded:
                    return b
        else:
            candidates = [b for b in self.backends if b.healthy and b not in excluded]
            if candidates:
                return self.policy.choose(candidates)
        n_failed = sum(1 for b in self.backends if b in excluded)
        tried = f" ({n_failed} already failed for this request)" if n_failed else ""
        raise NoHealthyServer(f"no healthy {self.name} server available{tried}")


def prompt_head(body: dict[str, Any], chars: int) -> str | None:
    """The head of the prompt (completions) or of the conversation (chat) as a hash key."""
    prompt = body.get("prompt")
    if prompt is None:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts: list[str] = []
        size = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            parts.append(text)
            size += len(text)
            if size >= chars:
                break
        return "\n".join(parts)[:chars]
    if isinstance(prompt, str):
        return prompt[:chars]
    return json.dumps(prompt)[:chars]
