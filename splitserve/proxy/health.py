"""Health of the upstream servers: periodic active checks, passive ejection on connect errors,
and re-admission.

Runs in the proxy process, as one task on its event loop. Every change of a server's ``healthy``
flag happens in ``HealthTracker.observe`` / ``eject``, which also log it and update the metrics,
so an ejection or re-admission is never silent. A server is ejected after
``failures_to_eject`` failed checks in a row (or at once when a request cannot connect to it)
and re-admitted after ``successes_to_readmit`` good checks in a row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from splitserve.proxy.config import HealthSettings
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend

logger = logging.getLogger(__name__)


class HealthTracker:
    """The one place where servers enter and leave rotation."""

    def __init__(
        self, backends: Sequence[Backend], settings: HealthSettings, metrics: ProxyMetrics
    ) -> None:
        self.backends = list(backends)
        self.settings = settings
        self.metrics = metrics
        for b in self.backends:
            metrics.healthy.labels(*b.labels).set(1 if b.healthy else 0)

    def observe(self, backend: Backend, ok: bool, detail: str = "", decisive: bool = False) -> None:
        """Record one check result and apply the ejection / re-admission thresholds.

        ``decisive``: the first check at start-up, where one failure is enough to eject (a
        server that is down when the proxy starts is never offered to a request).
        """
        if ok:
            backend.consecutive_failures = 0
            backend.consecutive_successes += 1
            if (
                not backend.healthy
                and backend.consecutive_successes >= self.settings.successes_to_readmit
            ):
                backend.healthy = True
                backend.last_error = None
                self.metrics.healthy.labels(*backend.labels).set(1)
                logger.warning("%s server %s re-admitted", backend.pool, backend.url)
        else:
            backend.consecutive_successes = 0
            backend.consecutive_failures += 1
            backend.last_error = detail
            threshold = 1 if decisive else self.settings.failures_to_eject
            if backend.healthy and backend.consecutive_failures >= threshold:
                self.eject(backend, detail)

    def eject(self, backend: Backend, reason: str) -> None:
        """Take a server out of rotation now (a check failed, or a request could not connect)."""
        backend.consecutive_successes = 0
        backend.last_error = reason
        if not backend.healthy:
            return
        backend.healthy = False
        backend.ejections += 1
        self.metrics.healthy.labels(*backend.labels).set(0)
        self.metrics.ejections.labels(*backend.labels).inc()
        logger.warning("%s server %s ejected: %s", backend.pool, backend.url, reason)

    def connect_failed(self, backend: Backend, reason: str) -> None:
        """A request could not connect: eject at once when so configured."""
        if self.settings.eject_on_connect_error:
            self.eject(backend, reason)
        else:
            self.observe(backend, False, reason)


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
        self._task: asyncio.Task[None] | None = None

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
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, detail = False, f"health check failed: {type(e).__name__}: {e}"
        self.tracker.observe(backend, ok, detail, decisive)

    async def check_all(self, decisive: bool = False) -> None:
        await asyncio.gather(*(self.check(b, decisive) for b in self.tracker.backends))

    async def _watch(self, backend: Backend) -> None:
        """One server's checks, on their own clock: a slow server (a check running up to
        ``timeout_s``) never holds back the checks, and so the ejection, of another."""
        while True:
            await asyncio.sleep(self.tracker.settings.interval_s)
            await self.check(backend)

    async def _run(self) -> None:
        await asyncio.gather(*(self._watch(b) for b in self.tracker.backends))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
