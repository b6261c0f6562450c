"""Dynamic pools: servers found by DNS (a headless Service's records) or listed in a pool file
read again on SIGHUP, admitted once healthy and drained when they leave.

Runs in the proxy process, on its event loop, beside the health checker; ``ProxyState`` starts
it when the settings have a ``discovery`` section. Every source (the settings' own URLs, a DNS
name per pool, the pool file) says which servers a pool should have; ``Membership`` makes the
pools so:

- a server that appears is *pending*: health-checked every ``health.interval_s`` and put into
  its pool (``Pool.set_backends``) after its first passing check;
- a server that disappears *drains*: it leaves its pool at once (no new request picks it), the
  requests it serves run to their end, and it is dropped when none is left, or after
  ``drain_timeout_s`` (default ``timeouts.total_s``, the longest any request may take); one that
  comes back while draining is serving again at once;
- a resolution that fails (timeout, SERVFAIL, no server answering) changes nothing; a name that
  does not exist or has no records is a pool with none (as Envoy's strict DNS clusters);
- a pool file that cannot be read or is invalid changes nothing (the proxy keeps serving, and
  says why); at start-up it stops the proxy.

Each change is a log line and counts in ``splitserve_proxy_pool_changes_total{pool,change}``;
``splitserve_proxy_pool_servers{pool,state}`` shows pending / serving / draining servers and
``splitserve_proxy_discovery_errors_total{source}`` failed resolutions and reloads.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.proxy.config import (
    ConfigError,
    DecodeEndpoint,
    PrefillEndpoint,
    ProxyConfig,
    describe_validation_error,
)
from splitserve.proxy.discovery_config import (
    DiscoverySettings,
    DnsPool,
    check_endpoints,
    parse_nameserver,
)
from splitserve.proxy.routing import PENDING, Backend, Pool

if TYPE_CHECKING:
    from splitserve.proxy.health import HealthChecker, HealthTracker
    from splitserve.proxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
_ENDPOINT = {"prefill": PrefillEndpoint, "decode": DecodeEndpoint}


# ---------------------------------------------------------------------- pool file


class PoolFile(BaseModel):
    """The content of ``discovery.pool_file``: the same entries as the settings' lists."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: list[PrefillEndpoint] = Field(default_factory=list)
    decode: list[DecodeEndpoint] = Field(default_factory=list)


def read_pool_file(path: str | Path, engine: str, flow: str) -> PoolFile:
    """Read and validate a pool file; ``ConfigError`` names the file and the bad entry."""
    p = Path(path).expanduser()
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"pool_file: cannot read {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"pool_file: {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"pool_file: {p}: expected 'prefill' and 'decode' lists")
    try:
        pools = PoolFile.model_validate(data)
        check_endpoints(engine, flow, pools.prefill)
    except ValidationError as e:
        raise ConfigError(f"pool_file: {p}: {describe_validation_error(e)}") from None
    except ValueError as e:
        raise ConfigError(f"pool_file: {p}: {e}") from None
    return pools


# ---------------------------------------------------------------------- DNS


class ResolveError(RuntimeError):
    """A resolution that says nothing about the name (timeout, SERVFAIL, no server answered)."""


class Resolver(Protocol):
    async def resolve(self, pool: DnsPool) -> list[tuple[str, int]]:
        """(host, port) of every server of ``pool``'s name; ``[]`` when the name has none;
        ``ResolveError`` when the answer is unknown."""
        ...


class DnsResolver:
    """Resolution through dnspython's asyncio resolver: the system's DNS servers (and search
    domains, so a Service's short name works in its namespace), or ``nameservers``."""

    def __init__(self, settings: DiscoverySettings) -> None:
        import dns.asyncresolver
        import dns.nameserver

        self.timeout = settings.timeout_s
        if settings.nameservers:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [
                dns.nameserver.Do53Nameserver(*parse_nameserver(a)) for a in settings.nameservers
            ]
        else:
            self._resolver = dns.asyncresolver.Resolver()
        self._resolver.cache = None  # every resolution asks: ttl_s is the caching

    async def _addresses(self, name: str) -> list[str]:
        out: list[str] = []
        for rdtype in ("A", "AAAA"):
            out += [r.address for r in await self._query(name, rdtype)]
        return out

    async def _query(self, name: str, rdtype: str) -> list[Any]:
        import dns.exception
        import dns.resolver

        try:
            answer = await self._resolver.resolve(
                name, rdtype, lifetime=self.timeout, search=True, raise_on_no_answer=False
            )
        except dns.resolver.NXDOMAIN:
            return []
        except dns.exception.DNSException as e:
            raise ResolveError(f"{name} {rdtype}: {type(e).__name__}: {e}") from None
        return list(answer.rrset or [])

    async def resolve(self, pool: DnsPool) -> list[tuple[str, int]]:
        if pool.record == "A":
            assert pool.port is not None
            return [(a, pool.port) for a in await self._addresses(pool.name)]
        servers = []
        for srv in await self._query(pool.name, "SRV"):
            target = srv.target.to_text()
            servers += [(a, int(srv.port)) for a in await self._addresses(target)]
        return servers


# ---------------------------------------------------------------------- membership


class _Metrics:
    def __init__(self, metrics: ProxyMetrics) -> None:
        r = metrics.registry
        self.changes = Counter(
            "splitserve_proxy_pool_changes",
            "Servers admitted, draining, back, or removed, by pool (dynamic pools)",
            ["pool", "change"], registry=r,
        )  # fmt: skip
        self.servers = Gauge(
            "splitserve_proxy_pool_servers", "Servers of each pool by state (pending, serving, "
            "draining)", ["pool", "state"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.errors = Counter(
            "splitserve_proxy_discovery_errors",
            "Failed DNS resolutions and pool file reloads, by source",
            ["source"], registry=r,
        )  # fmt: skip


class Membership:
    """The servers each pool should have, by source, and the moves that make it so."""

    def __init__(
        self,
        pools: dict[str, Pool],
        tracker: HealthTracker,
        metrics: ProxyMetrics,
        drain_timeout_s: float,
        check: Callable[[Backend], Awaitable[None]],
        watch: Callable[[Backend], None],
        unwatch: Callable[[Backend], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``check(b)`` runs one health check (its result lands in ``tracker``); ``watch`` /
        ``unwatch`` start and stop a server's periodic checks."""
        self.pools = pools
        self.tracker = tracker
        self.metrics = _Metrics(metrics)
        self.drain_timeout_s = drain_timeout_s
        self.check, self.watch, self.unwatch = check, watch, unwatch
        self.clock = clock
        self.wanted: dict[tuple[str, str], dict[str, Any]] = {}  # (source, pool) -> url -> settings
        self.pending: dict[str, Backend] = {}  # (pool, url) key as "pool url"
        self.draining: dict[Backend, float] = {}  # -> when it is dropped whatever remains
        for name, pool in pools.items():
            self.wanted[("config", name)] = {b.url: b.settings for b in pool.backends}
            self._gauges(name)

    # ------------------------------------------------------------------ sources

    def update(self, source: str, pool: str, endpoints: Sequence[Any]) -> None:
        """``source`` says ``pool`` should have ``endpoints`` (endpoint settings objects)."""
        self.wanted[(source, pool)] = {e.url: e for e in endpoints}
        self._reconcile(pool)

    def _desired(self, pool: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for (_, name), urls in self.wanted.items():
            if name == pool:
                for url, settings in urls.items():
                    out.setdefault(url, settings)
        return out

    def _reconcile(self, name: str) -> None:
        pool = self.pools[name]
        desired = self._desired(name)
        serving = {b.url: b for b in pool.backends}
        members = list(pool.backends)
        for url, b in serving.items():
            if url not in desired:
                members.remove(b)
                self.draining[b] = self.clock() + self.drain_timeout_s
                self.unwatch(b)
                self._change(b, "draining", f"{b.outstanding} request(s) in flight")
        for url, settings in desired.items():
            if url in serving:
                continue
            back = next((b for b in self.draining if b.pool == name and b.url == url), None)
            if back is not None:
                del self.draining[back]
                members.append(back)
                self.watch(back)
                self._change(back, "back", "listed again while draining")
            elif f"{name} {url}" not in self.pending:
                b = Backend(name, url, settings, healthy=False, ejected_by=PENDING)
                self.pending[f"{name} {url}"] = b
                logger.warning("%s server %s found; admitted after a passing check", name, url)
        for key, b in list(self.pending.items()):
            if b.pool == name and b.url not in desired:
                del self.pending[key]
                logger.warning("%s server %s gone before it was admitted", name, b.url)
        if members != pool.backends:
            pool.set_backends(members)
        self._gauges(name)

    # ------------------------------------------------------------------ admission and drain

    async def admit_pending(self) -> None:
        """One health check of every pending server; those that pass join their pool."""
        pending = list(self.pending.items())
        await asyncio.gather(*(self.check(b) for _, b in pending))
        for key, b in pending:
            if self.pending.get(key) is not b or b.consecutive_successes == 0:
                continue  # gone meanwhile, or not healthy yet
            del self.pending[key]
            pool = self.pools[b.pool]
            self.tracker.add(b, "first health check passed")
            pool.set_backends([*pool.backends, b])
            self.watch(b)
            self.metrics.changes.labels(b.pool, "admitted").inc()
            self._gauges(b.pool)

    def drop_drained(self) -> None:
        """Drop draining servers with no request left (or past their drain deadline)."""
        now = self.clock()
        for b, deadline in list(self.draining.items()):
            if b.outstanding > 0 and now < deadline:
                continue
            del self.draining[b]
            self.tracker.remove(b)
            why = "drained" if b.outstanding == 0 else f"drain timed out, {b.outstanding} left"
            self._change(b, "removed", why)

    def _change(self, b: Backend, change: str, why: str) -> None:
        self.metrics.changes.labels(b.pool, change).inc()
        self._gauges(b.pool)
        logger.warning("%s server %s %s: %s", b.pool, b.url, change, why)

    def _gauges(self, name: str) -> None:
        g = self.metrics.servers
        g.labels(name, "serving").set(len(self.pools[name].backends))
        g.labels(name, PENDING).set(sum(1 for b in self.pending.values() if b.pool == name))
        g.labels(name, "draining").set(sum(1 for b in self.draining if b.pool == name))


# ---------------------------------------------------------------------- the running sources


class Discovery:
    """The sources of one proxy's dynamic pools and the tasks that poll them."""

    def __init__(
        self,
        config: ProxyConfig,
        pools: dict[str, Pool],
        tracker: HealthTracker,
        metrics: ProxyMetrics,
        resolver: Resolver | None = None,
    ) -> None:
        assert config.discovery is not None
        self.config = config
        self.settings = config.discovery
        self.pools = pools
        self.tracker = tracker
        self.metrics = metrics
        self.resolver = resolver
        self.membership: Membership | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._dns_failing: dict[str, bool] = {}
        self._sighup = False

    async def start(self, checker: HealthChecker) -> None:
        """Read the pool file (an error stops start-up), resolve the names once, admit the
        servers that pass a check, then keep watching."""
        self.membership = Membership(
            self.pools,
            self.tracker,
            self.metrics,
            self.settings.drain_timeout_s or self.config.timeouts.total_s,
            lambda b: checker.check(b, decisive=True),
            checker.watch,
            checker.unwatch,
        )
        if self.settings.pool_file is not None:
            self._apply_file(self._read_file())
        if self.settings.prefill or self.settings.decode:
            if self.resolver is None:
                self.resolver = DnsResolver(self.settings)
            await self.resolve_once()
        await self.membership.admit_pending()
        loop = asyncio.get_running_loop()
        if self.settings.prefill or self.settings.decode:
            self._tasks.append(loop.create_task(self._poll_dns(), name="discovery dns"))
        self._tasks.append(loop.create_task(self._admit_and_drop(), name="discovery admit"))
        if self.settings.pool_file is not None:
            try:
                loop.add_signal_handler(signal.SIGHUP, self.reload_pool_file)
                self._sighup = True
            except (RuntimeError, ValueError):  # not the main thread (tests, benchmarks)
                logger.info("pool file: no SIGHUP handler off the main thread")

    async def stop(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # ------------------------------------------------------------------ DNS

    async def resolve_once(self) -> None:
        assert self.membership is not None and self.resolver is not None
        for name in POOLS:
            dns_pool: DnsPool | None = getattr(self.settings, name)
            if dns_pool is None:
                continue
            try:
                found = await self.resolver.resolve(dns_pool)
            except ResolveError as e:
                self.membership.metrics.errors.labels("dns").inc()
                if not self._dns_failing.get(name):
                    logger.warning("%s pool: cannot resolve %s (pool unchanged): %s",
                                   name, dns_pool.name, e)  # fmt: skip
                self._dns_failing[name] = True
                continue
            if self._dns_failing.pop(name, False):
                logger.warning("%s pool: %s resolves again", name, dns_pool.name)
            endpoints = [_ENDPOINT[name](**dns_pool.endpoint(h, p)) for h, p in sorted(set(found))]
            self.membership.update("dns", name, endpoints)

    async def _poll_dns(self) -> None:
        while True:
            await asyncio.sleep(self.settings.ttl_s)
            await self.resolve_once()

    async def _admit_and_drop(self) -> None:
        assert self.membership is not None
        interval = min(self.config.health.interval_s, 1.0)
        while True:
            await asyncio.sleep(interval)
            await self.membership.admit_pending()
            self.membership.drop_drained()

    # ------------------------------------------------------------------ pool file

    def _read_file(self) -> PoolFile:
        assert self.settings.pool_file is not None
        return read_pool_file(self.settings.pool_file, self.config.engine, self.config.flow)

    def _apply_file(self, pools: PoolFile) -> None:
        assert self.membership is not None
        self.membership.update("file", "prefill", pools.prefill)
        self.membership.update("file", "decode", pools.decode)

    def reload_pool_file(self) -> bool:
        """Read the pool file again (SIGHUP); on an error keep the pools as they are."""
        try:
            pools = self._read_file()
        except ConfigError as e:
            assert self.membership is not None
            self.membership.metrics.errors.labels("pool_file").inc()
            logger.error("pool file not reloaded (pools unchanged): %s", e)
            return False
        logger.warning(
            "pool file reloaded: %d prefill, %d decode server(s)",
            len(pools.prefill),
            len(pools.decode),
        )
        self._apply_file(pools)
        return True
