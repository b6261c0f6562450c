"""Server pools and the policies that pick one server of a pool per request.

Runs in the proxy process, on its event loop (no locks: every change happens on that loop).
Policies: round-robin, least-outstanding, power-of-two-choices, and, for the prefill pool,
prefix affinity (a consistent hash of the prompt's head, so requests sharing a head reach the
same P and hit its prefix cache; when that P is out, the ring's next server takes over and only
its share of keys moves).

Which servers a pick may return (the health tracker, ``health.py``, decides every ejection; this
module only reads its state):
- servers in rotation (``healthy``);
- a server whose outlier ejection has run out (half-open): one request probes it (the pick marks
  it, ``probe_at``), and the tracker readmits or re-ejects it on that request's outcome;
- panic (Envoy's panic threshold): while fewer than ``panic_threshold`` of the pool's servers are
  in rotation, also every server ejected for a soft reason (``SOFT_EJECTIONS``: slow health
  checks, request failures), since a busy server is not a dead one; never a server that refused
  a connection or answered its health check with an error.

Invariants: a pick only ever returns a server of the configured pool that the caller did not
exclude; no candidate raises ``NoHealthyServer`` at once.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from splitserve.proxy.errors import NoHealthyServer

logger = logging.getLogger(__name__)

# Ejection reasons (``Backend.ejected_by``, the ``reason`` label of the ejection metric).
HEALTH_CHECK = "health_check"  # the check failed: refused, broken, or an error status
HEALTH_TIMEOUT = "health_timeout"  # the check timed out ``timeouts_to_eject`` times in a row
CONNECT_ERROR = "connect_error"  # a request could not connect
OUTLIER = "outlier"  # requests failed in a row (5xx, timeouts, broken connections)
PENDING = "pending"  # found by discovery, not admitted yet (discovery.py admits it)
# Ejected for a reason a busy server also shows: still routed to in a panic.
SOFT_EJECTIONS = frozenset({HEALTH_TIMEOUT, OUTLIER})


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
    ejected_by: str | None = None  # why it is out of rotation (None while in rotation)
    degraded: bool = False  # its last health check timed out (shown in /ready)
    health_timeouts: int = 0  # health checks in a row that timed out
    request_failures: int = 0  # real requests in a row that failed
    outlier_streak: int = 0  # outlier ejections in a row (the n-th lasts n * base)
    ejected_until: float = 0.0  # monotonic time an outlier ejection ends (then: half-open)
    probation: bool = False  # readmitted after an outlier ejection: one failure re-ejects
    probe_at: float = 0.0  # monotonic time the last half-open probe was sent
    labels: tuple[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.labels = (self.pool, self.url)

    def half_open(self, now: float) -> bool:
        """Outlier-ejected, its ejection over, and no probe sent since: one request may try it."""
        return (
            self.ejected_by == OUTLIER
            and now >= self.ejected_until
            and self.probe_at < self.ejected_until
        )


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
        self,
        name: str,
        backends: Sequence[Backend],
        policy: str,
        prefix_affinity: bool = False,
        panic_threshold: float = 0.0,
        on_panic: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``panic_threshold``: below this fraction of servers in rotation, soft-ejected servers
        are candidates too (0: never); ``on_panic(pool)`` is called for each such pick. A pool
        may start empty when discovery fills it (``set_backends``)."""
        self.name = name
        self.backends = list(backends)
        self.policy: Policy = POLICIES[policy]()
        self.ring = HashRing(self.backends) if prefix_affinity else None
        self.panic_threshold = panic_threshold
        self.on_panic = on_panic
        self.clock = clock
        self.in_panic = False

    def set_backends(self, backends: Sequence[Backend]) -> None:
        """Change the pool's servers (discovery: ``splitserve.proxy.discovery``); a pick after
        this call sees only these. The hash ring is rebuilt, so only a changed server's share
        of prefix keys moves."""
        self.backends = list(backends)
        if self.ring is not None:
            self.ring = HashRing(self.backends)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def below_panic_threshold(self) -> bool:
        """Fewer than ``panic_threshold`` of the servers are in rotation (or none is): picks
        may go to soft-ejected servers, so the pool serves but is not healthy (``/ready``)."""
        n_healthy = sum(1 for b in self.backends if b.healthy)
        return n_healthy == 0 or n_healthy < self.panic_threshold * len(self.backends)

    def pick(self, affinity_key: str | None = None, exclude: Iterable[Backend] = ()) -> Backend:
        excluded = set(exclude)
        backends = self.backends
        n_healthy = sum(1 for b in backends if b.healthy)
        if n_healthy == len(backends):  # the usual case: every server in rotation
            usable: Callable[[Backend], bool] = _in_rotation
            panic, now = False, 0.0
            if self.in_panic:
                self._note_panic(False, n_healthy)
        else:
            now = self.clock()
            panic = n_healthy < self.panic_threshold * len(backends)
            self._note_panic(panic, n_healthy)

            def usable(b: Backend) -> bool:
                return b.healthy or b.half_open(now) or (panic and b.ejected_by in SOFT_EJECTIONS)

        chosen = None
        if self.ring is not None and affinity_key is not None:
            for b in self.ring.walk(affinity_key):
                if b not in excluded and usable(b):
                    chosen = b
                    break
        else:
            candidates = [b for b in backends if b not in excluded and usable(b)]
            if candidates:
                chosen = self.policy.choose(candidates)
        if chosen is not None:
            if not chosen.healthy:
                if chosen.half_open(now):
                    chosen.probe_at = now  # the one probe of this half-open period
                elif panic and self.on_panic is not None:
                    self.on_panic(self.name)
            return chosen
        n_failed = sum(1 for b in backends if b in excluded)
        tried = f" ({n_failed} already failed for this request)" if n_failed else ""
        raise NoHealthyServer(f"no healthy {self.name} server available{tried}")

    def _note_panic(self, panic: bool, n_healthy: int) -> None:
        """Log when the pool enters or leaves panic (not on every pick)."""
        if panic == self.in_panic:
            return
        self.in_panic = panic
        if panic:
            logger.warning(
                "%s pool in panic: %d of %d servers in rotation (threshold %g); routing to "
                "soft-ejected servers too",
                self.name,
                n_healthy,
                len(self.backends),
                self.panic_threshold,
            )
        else:
            logger.warning("%s pool out of panic", self.name)


def _in_rotation(b: Backend) -> bool:
    return b.healthy


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
