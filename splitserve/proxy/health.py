"""Health of the upstream servers: active checks, ejection on connect errors and on real
request outcomes (outlier detection), half-open probes, and re-admission.

Runs in the proxy process, on its event loop. Every change of a server's ``healthy`` flag happens
in ``HealthTracker`` (``observe``, ``connect_failed``, ``request_failed``,
``request_succeeded``), which also logs it and updates the metrics, so an ejection or
re-admission is never silent. The rules (docs/proxy.md, "Faults"):

- Health checks: ``failures_to_eject`` failed checks in a row (refused, broken, an error status,
  no connection within ``timeouts.connect_s``) eject (``health_check``; one is enough at
  start-up); ``timeouts_to_eject`` checks in a row that time out (``timeout_s``, connecting
  included) eject (``health_timeout``): a busy server answers its checks late, so a timeout alone
  only marks it ``degraded``, and a real request to it that succeeds restarts the count and
  readmits a server ejected that way. ``successes_to_readmit`` good checks in a row readmit.
- A request that cannot connect ejects at once (``connect_error``, when
  ``eject_on_connect_error``).
- Outlier detection: ``outlier.consecutive_failures`` requests in a row that fail (5xx, timeout,
  broken connection; a 4xx is the client's and counts as a success) eject for ``n *
  base_ejection_s`` (the n-th ejection in a row, at most ``max_ejection_s``). When that time is
  over the server is half-open: the next request routed to it (``routing.Pool.pick``), or a
  passing health check, lets it back on probation; a success ends the probation (and the streak
  of ejections), a failure on probation ejects it again at once, for longer.

Routing reads this state and never changes it, bar marking the half-open probe it sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp

from splitserve.proxy.config import HealthSettings, OutlierSettings
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import (
    CONNECT_ERROR,
    HEALTH_CHECK,
    HEALTH_TIMEOUT,
    OUTLIER,
    PENDING,
    Backend,
)

logger = logging.getLogger(__name__)


class HealthTracker:
    """The one place where servers enter and leave rotation."""

    def __init__(
        self,
        backends: Sequence[Backend],
        settings: HealthSettings,
        metrics: ProxyMetrics,
        outlier: OutlierSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backends = list(backends)
        self.settings = settings
        self.outlier = outlier or OutlierSettings()
        self.metrics = metrics
        self.clock = clock
        for b in self.backends:
            metrics.healthy.labels(*b.labels).set(1 if b.healthy else 0)

    # ------------------------------------------------------------------ membership

    def add(self, backend: Backend, why: str) -> None:
        """A server joins (discovery, after its first passing check): tracked and in rotation."""
        if backend not in self.backends:
            self.backends.append(backend)
        backend.healthy = True
        backend.ejected_by = None
        backend.last_error = None
        self.metrics.healthy.labels(*backend.labels).set(1)
        logger.warning("%s server %s admitted: %s", backend.pool, backend.url, why)

    def remove(self, backend: Backend) -> None:
        """A server left its pool (discovery, once drained): no longer tracked or exported."""
        if backend in self.backends:
            self.backends.remove(backend)
        with contextlib.suppress(KeyError):
            self.metrics.healthy.remove(*backend.labels)

    # ------------------------------------------------------------------ health checks

    def observe(
        self,
        backend: Backend,
        ok: bool,
        detail: str = "",
        decisive: bool = False,
        timed_out: bool = False,
    ) -> None:
        """Record one check result and apply the ejection / re-admission thresholds.

        ``decisive``: the first check at start-up, where one failure is enough to eject (a
        server that is down when the proxy starts is never offered to a request).
        ``timed_out``: the check got no answer in time (counted apart: a busy server's sign).
        """
        if ok:
            backend.consecutive_failures = 0
            backend.health_timeouts = 0
            backend.degraded = False
            backend.consecutive_successes += 1
            if (
                not backend.healthy
                and backend.consecutive_successes >= self.settings.successes_to_readmit
                and not self._held(backend)
                and backend.ejected_by != PENDING
            ):
                self._readmit(backend, "health check passed")
            return
        backend.consecutive_successes = 0
        backend.last_error = detail
        if timed_out:
            backend.health_timeouts += 1
            backend.degraded = True
            threshold = 1 if decisive else self.settings.timeouts_to_eject
            if backend.healthy and backend.health_timeouts >= threshold:
                self.eject(backend, HEALTH_TIMEOUT, detail)
            return
        backend.consecutive_failures += 1
        threshold = 1 if decisive else self.settings.failures_to_eject
        if backend.healthy and backend.consecutive_failures >= threshold:
            self.eject(backend, HEALTH_CHECK, detail)
        elif not backend.healthy and backend.ejected_by not in (OUTLIER, PENDING):
            backend.ejected_by = HEALTH_CHECK  # known down now, not just slow: no panic route

    def _held(self, backend: Backend) -> bool:
        """An outlier ejection whose time is not over: no health check ends it early."""
        return backend.ejected_by == OUTLIER and self.clock() < backend.ejected_until

    # ------------------------------------------------------------------ ejection

    def eject(self, backend: Backend, reason: str, detail: str = "") -> None:
        """Take a server out of rotation now; ``reason`` is one of routing's ejection reasons
        (the metric's label), ``detail`` what happened."""
        backend.consecutive_successes = 0
        backend.last_error = detail or reason
        if not backend.healthy:
            return
        backend.healthy = False
        backend.ejected_by = reason
        backend.ejections += 1
        self.metrics.healthy.labels(*backend.labels).set(0)
        self.metrics.ejections.labels(*backend.labels, reason).inc()
        logger.warning("%s server %s ejected (%s): %s", backend.pool, backend.url, reason, detail)

    def _readmit(self, backend: Backend, why: str) -> None:
        backend.healthy = True
        backend.ejected_by = None
        backend.last_error = None
        backend.request_failures = 0
        self.metrics.healthy.labels(*backend.labels).set(1)
        probation = " (on probation)" if backend.probation else ""
        logger.warning("%s server %s re-admitted%s: %s", backend.pool, backend.url, probation, why)

    def connect_failed(self, backend: Backend, reason: str) -> None:
        """A request could not connect: eject at once when so configured."""
        if self.settings.eject_on_connect_error:
            if not backend.healthy and backend.ejected_by != OUTLIER:
                backend.ejected_by = CONNECT_ERROR  # known down: no panic route to it
            self.eject(backend, CONNECT_ERROR, reason)
        else:
            self.observe(backend, False, reason)

    # ------------------------------------------------------------------ request outcomes

    def request_succeeded(self, backend: Backend) -> None:
        """A real request to ``backend`` succeeded (cheap when there is nothing to undo)."""
        if (
            backend.request_failures
            or backend.health_timeouts
            or backend.probation
            or not backend.healthy
        ):
            self._recovered(backend)

    def _recovered(self, backend: Backend) -> None:
        backend.request_failures = 0
        backend.health_timeouts = 0
        backend.degraded = False
        if backend.probation and not self._held(backend):
            backend.probation = False
            backend.outlier_streak = 0
        if not backend.healthy and (
            backend.ejected_by == HEALTH_TIMEOUT
            or (backend.ejected_by == OUTLIER and not self._held(backend))
        ):
            self._readmit(backend, "a request succeeded")

    def request_failed(self, backend: Backend, detail: str) -> None:
        """A real request to ``backend`` failed (5xx, timeout, broken connection)."""
        backend.request_failures += 1
        o = self.outlier
        if not o.enabled:
            return
        if backend.healthy:
            if backend.probation or backend.request_failures >= o.consecutive_failures:
                self._eject_outlier(backend, detail)
        elif backend.ejected_by == OUTLIER and not self._held(backend):
            self._eject_outlier(backend, f"half-open probe failed: {detail}")

    def _eject_outlier(self, backend: Backend, detail: str) -> None:
        o = self.outlier
        backend.outlier_streak += 1
        length = min(o.base_ejection_s * backend.outlier_streak, o.max_ejection_s)
        backend.ejected_until = self.clock() + length
        backend.probation = True
        what = (
            f"{backend.request_failures} failed request(s) in a row, out for {length:g} s; "
            f"last: {detail}"
        )
        backend.request_failures = 0
        if backend.healthy:
            self.eject(backend, OUTLIER, what)
        else:  # re-ejected from half-open: a new ejection, counted as one
            backend.ejected_by = OUTLIER
            backend.ejections += 1
            backend.last_error = what
            self.metrics.ejections.labels(*backend.labels, OUTLIER).inc()
            logger.warning(
                "%s server %s ejected again (outlier): %s", backend.pool, backend.url, what
            )


class HealthChecker:
    """Checks every server ``interval_s`` after its previous check ended (GET ``path``, 200
    within ``timeout_s``)."""

    def __init__(
        self,
        tracker: HealthTracker,
        session: aiohttp.ClientSession,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.tracker = tracker
        self.session = session
        self.headers = headers or {}
        self._watches: dict[Backend, asyncio.Task[None]] = {}
        self._started = False

    async def check(self, backend: Backend, decisive: bool = False) -> None:
        s = self.tracker.settings
        try:
            async with self.session.get(
                backend.url + s.path,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=s.timeout_s),
            ) as resp:
                await resp.read()
                ok = resp.status == 200
                detail = "" if ok else f"health check answered {resp.status}"
        except aiohttp.ConnectionTimeoutError as e:
            if self._budget_ran_out_connecting():  # late, as a busy server is
                detail = f"health check timed out after {s.timeout_s:g} s (connecting)"
                self.tracker.observe(backend, False, detail, decisive, timed_out=True)
                return
            ok, detail = False, f"health check failed: cannot connect: {e}"  # unreachable
        except asyncio.TimeoutError:  # aiohttp's read timeouts are subclasses
            ok, detail = False, f"health check timed out after {s.timeout_s:g} s"
            self.tracker.observe(backend, ok, detail, decisive, timed_out=True)
            return
        except (aiohttp.ClientError, OSError) as e:
            ok, detail = False, f"health check failed: {type(e).__name__}: {e}"
        self.tracker.observe(backend, ok, detail, decisive)

    def _budget_ran_out_connecting(self) -> bool:
        """aiohttp reports any timeout that fires while connecting as a connect timeout, the
        check's own ``timeout_s`` included. Only the session's connect bound (``connect_s``, the
        one requests have) proves a server unreachable; a shorter check budget spent on the
        connect (a full accept queue, a loaded loop) is a late answer like any other."""
        timeout = getattr(self.session, "timeout", None)
        bound = None if timeout is None else (timeout.sock_connect or timeout.connect)
        return bound is None or self.tracker.settings.timeout_s < bound

    async def check_all(self, decisive: bool = False) -> None:
        await asyncio.gather(*(self.check(b, decisive) for b in self.tracker.backends))

    async def _watch(self, backend: Backend) -> None:
        """One server's checks, on their own clock: a slow server (a check running up to
        ``timeout_s``) never holds back the checks, and so the ejection, of another."""
        while True:
            await asyncio.sleep(self.tracker.settings.interval_s)
            await self.check(backend)

    def watch(self, backend: Backend) -> None:
        """Check ``backend`` on its own clock from now on (discovery adds servers here)."""
        if self._started and backend not in self._watches:
            self._watches[backend] = asyncio.get_running_loop().create_task(
                self._watch(backend), name=f"health {backend.url}"
            )

    def unwatch(self, backend: Backend) -> None:
        """Stop checking ``backend`` (a server that left its pool)."""
        task = self._watches.pop(backend, None)
        if task is not None:
            task.cancel()

    def start(self) -> None:
        if not self._started:
            self._started = True
            for b in self.tracker.backends:
                self.watch(b)

    async def stop(self) -> None:
        self._started = False
        tasks = list(self._watches.values())
        self._watches.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
