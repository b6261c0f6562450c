"""Dynamic pools (splitserve/proxy/discovery.py): admission after a passing check, drain of a
server that leaves (no new pick, in-flight requests finish, then dropped), failed resolutions and
bad pool files that change nothing, and the settings' rules.

Our own logic only: the health checks are a stub (``StubChecks``: a test says which servers
pass) and DNS a stub resolver (``StubResolver``); real engines behind a real DNS server are in
tests/integration/test_discovery.py.
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve.proxy.config import ConfigError, DecodeEndpoint, HealthSettings, build_config
from splitserve.proxy.discovery import (
    Discovery,
    Membership,
    ResolveError,
    read_pool_file,
)
from splitserve.proxy.discovery_config import DnsPool, parse_nameserver
from splitserve.proxy.errors import NoHealthyServer
from splitserve.proxy.health import HealthTracker
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, Pool


class StubChecks:
    """Stands in for the health checker: ``passing`` URLs pass, others fail."""

    def __init__(self, tracker: HealthTracker) -> None:
        self.tracker = tracker
        self.passing: set[str] = set()
        self.watched: set[str] = set()

    async def check(self, b: Backend) -> None:
        self.tracker.observe(b, b.url in self.passing, "stub check", decisive=True)

    def watch(self, b: Backend) -> None:
        self.watched.add(b.url)

    def unwatch(self, b: Backend) -> None:
        self.watched.discard(b.url)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(static: list[str] = (), prefix_affinity: bool = False):
    metrics = ProxyMetrics()
    backends = [Backend("decode", u, DecodeEndpoint(url=u)) for u in static]
    pool = Pool("decode", backends, "round_robin", prefix_affinity)
    tracker = HealthTracker(backends, HealthSettings(), metrics)
    checks = StubChecks(tracker)
    clock = Clock()
    m = Membership(
        {"decode": pool}, tracker, metrics, 30.0, checks.check, checks.watch, checks.unwatch,
        clock=clock,
    )  # fmt: skip
    return m, pool, tracker, checks, clock, metrics


def _d(*urls: str) -> list[DecodeEndpoint]:
    return [DecodeEndpoint(url=u) for u in urls]


def _metric(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_new_server_joins_after_its_first_passing_check() -> None:
    m, pool, tracker, checks, _, metrics = _setup()
    m.update("dns", "decode", _d("http://d1:1"))
    assert pool.backends == [], "pending: not picked before a check passed"
    with pytest.raises(NoHealthyServer):
        pool.pick()
    asyncio.run(m.admit_pending())  # the check fails: still pending
    assert pool.backends == [] and len(m.pending) == 1
    checks.passing.add("http://d1:1")
    asyncio.run(m.admit_pending())
    assert [b.url for b in pool.backends] == ["http://d1:1"]
    assert pool.pick().url == "http://d1:1"
    assert checks.watched == {"http://d1:1"} and pool.backends[0] in tracker.backends
    assert (
        _metric(metrics, "splitserve_proxy_pool_changes_total", pool="decode", change="admitted")
        == 1
    )
    assert _metric(metrics, "splitserve_proxy_pool_servers", pool="decode", state="serving") == 1


def test_a_server_gone_before_admission_is_forgotten() -> None:
    m, pool, _, checks, _, _ = _setup()
    m.update("dns", "decode", _d("http://d1:1"))
    m.update("dns", "decode", [])
    checks.passing.add("http://d1:1")
    asyncio.run(m.admit_pending())
    assert pool.backends == [] and not m.pending


def test_a_removed_server_drains_then_leaves() -> None:
    m, pool, tracker, checks, _, metrics = _setup(["http://static:1"])
    checks.passing |= {"http://d1:1", "http://d2:1"}
    m.update("dns", "decode", _d("http://d1:1", "http://d2:1"))
    asyncio.run(m.admit_pending())
    d1 = next(b for b in pool.backends if b.url == "http://d1:1")
    d1.outstanding = 1  # a stream in flight through it
    m.update("dns", "decode", _d("http://d2:1"))
    assert d1 not in pool.backends and d1 in m.draining
    assert all(pool.pick() is not d1 for _ in range(20)), "no new request goes to it"
    assert "http://d1:1" not in checks.watched
    m.drop_drained()
    assert d1 in m.draining and d1 in tracker.backends, "kept while its request runs"
    d1.outstanding = 0  # the stream ended
    m.drop_drained()
    assert not m.draining and d1 not in tracker.backends
    assert [b.url for b in pool.backends] == ["http://static:1", "http://d2:1"]
    assert (
        _metric(metrics, "splitserve_proxy_pool_changes_total", pool="decode", change="removed")
        == 1
    )
    assert (
        metrics.registry.get_sample_value(
            "splitserve_proxy_server_healthy", {"pool": "decode", "server": "http://d1:1"}
        )
        is None
    ), "a removed server is no longer exported"


def test_the_settings_servers_never_drain() -> None:
    m, pool, *_ = _setup(["http://static:1"])
    m.update("dns", "decode", [])
    assert [b.url for b in pool.backends] == ["http://static:1"] and not m.draining


def test_drain_deadline_drops_a_server_whatever_remains() -> None:
    m, pool, _, checks, clock, _ = _setup()
    checks.passing.add("http://d1:1")
    m.update("file", "decode", _d("http://d1:1"))
    asyncio.run(m.admit_pending())
    d1 = pool.backends[0]
    d1.outstanding = 2
    m.update("file", "decode", [])
    clock.now = 29.0
    m.drop_drained()
    assert d1 in m.draining
    clock.now = 30.0
    m.drop_drained()
    assert not m.draining


def test_a_server_listed_again_while_draining_serves_at_once() -> None:
    m, pool, _, checks, _, _ = _setup()
    checks.passing.add("http://d1:1")
    m.update("dns", "decode", _d("http://d1:1"))
    asyncio.run(m.admit_pending())
    d1 = pool.backends[0]
    d1.outstanding = 1
    m.update("dns", "decode", [])
    m.update("dns", "decode", _d("http://d1:1"))
    assert pool.backends == [d1] and not m.draining and "http://d1:1" in checks.watched


def test_sources_add_up() -> None:
    """A server listed by DNS and by the pool file stays while either lists it."""
    m, pool, _, checks, _, _ = _setup()
    checks.passing.add("http://d1:1")
    m.update("dns", "decode", _d("http://d1:1"))
    m.update("file", "decode", _d("http://d1:1"))
    asyncio.run(m.admit_pending())
    m.update("dns", "decode", [])
    assert [b.url for b in pool.backends] == ["http://d1:1"]
    m.update("file", "decode", [])
    assert pool.backends == []


def test_prefix_affinity_ring_follows_the_pool() -> None:
    m, pool, _, checks, _, _ = _setup(prefix_affinity=True)
    urls = [f"http://d{i}:1" for i in range(4)]
    checks.passing |= set(urls)
    m.update("dns", "decode", _d(*urls))
    asyncio.run(m.admit_pending())
    owners = {k: pool.pick(f"prompt {k}").url for k in range(200)}
    m.update("dns", "decode", _d(*urls[:3]))
    after = {k: pool.pick(f"prompt {k}").url for k in range(200)}
    moved = [k for k in owners if owners[k] != after[k]]
    assert moved and all(owners[k] == urls[3] for k in moved), "only the gone server's keys move"


# ---------------------------------------------------------------------- Discovery


class StubResolver:
    """Answers from ``records`` (name -> [(host, port)]); ``fail`` raises ``ResolveError``."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int]]] = {}
        self.fail = False

    async def resolve(self, pool: DnsPool) -> list[tuple[str, int]]:
        if self.fail:
            raise ResolveError("stub: SERVFAIL")
        return [(h, p or pool.port) for h, p in self.records.get(pool.name, [])]


def _discovery(tmp_path, **discovery):
    config = build_config(
        {"prefill": [{"url": "http://p:1"}], "discovery": {"decode": {"name": "dec", "port": 9},
                                                          **discovery}}
    )  # fmt: skip
    metrics = ProxyMetrics()
    pools = {
        "prefill": Pool("prefill", [], "round_robin"),
        "decode": Pool("decode", [], "round_robin"),
    }
    tracker = HealthTracker([], config.health, metrics)
    resolver = StubResolver()
    return Discovery(config, pools, tracker, metrics, resolver), pools, resolver, tracker


class _Checker:
    def __init__(self, tracker: HealthTracker, passing: set[str]) -> None:
        self.tracker, self.passing = tracker, passing

    async def check(self, b: Backend, decisive: bool = False) -> None:
        self.tracker.observe(b, b.url in self.passing, "stub", decisive)

    def watch(self, b: Backend) -> None: ...

    def unwatch(self, b: Backend) -> None: ...


def test_dns_failures_keep_the_pool_and_an_empty_answer_empties_it(tmp_path) -> None:
    async def run() -> None:
        d, pools, resolver, tracker = _discovery(tmp_path)
        resolver.records["dec"] = [("10.0.0.1", None), ("10.0.0.2", None)]
        await d.start(_Checker(tracker, {"http://10.0.0.1:9", "http://10.0.0.2:9"}))
        try:
            assert sorted(b.url for b in pools["decode"].backends) == [
                "http://10.0.0.1:9", "http://10.0.0.2:9",
            ]  # fmt: skip
            resolver.fail = True
            await d.resolve_once()
            assert len(pools["decode"].backends) == 2, "a failed resolution changes nothing"
            assert d.membership.metrics.errors.labels("dns")._value.get() == 1
            resolver.fail = False
            resolver.records["dec"] = []
            await d.resolve_once()
            assert pools["decode"].backends == [], "no records: nothing to route to"
        finally:
            await d.stop()

    asyncio.run(run())


def test_pool_file_reload_and_a_bad_file_changes_nothing(tmp_path) -> None:
    f = tmp_path / "pools.yaml"
    f.write_text("decode:\n  - url: http://d1:1\n")

    async def run() -> None:
        d, pools, _, tracker = _discovery(tmp_path, pool_file=str(f))
        await d.start(_Checker(tracker, {"http://d1:1", "http://d2:1"}))
        try:
            assert [b.url for b in pools["decode"].backends] == ["http://d1:1"]
            f.write_text("decode:\n  - url: http://d2:1\n")
            assert d.reload_pool_file()
            await d.membership.admit_pending()
            assert [b.url for b in pools["decode"].backends] == ["http://d2:1"]
            f.write_text("decode:\n  - url: not-a-url\n")
            assert not d.reload_pool_file()
            assert [b.url for b in pools["decode"].backends] == ["http://d2:1"]
        finally:
            await d.stop()

    asyncio.run(run())


def test_a_bad_pool_file_stops_start_up(tmp_path) -> None:
    async def run() -> None:
        d, _, _, tracker = _discovery(tmp_path, pool_file=str(tmp_path / "missing.yaml"))
        with pytest.raises(ConfigError, match="pool_file: cannot read .*missing.yaml"):
            await d.start(_Checker(tracker, set()))

    asyncio.run(run())


def test_pool_file_entries_follow_the_flow(tmp_path) -> None:
    f = tmp_path / "pools.yaml"
    f.write_text("prefill:\n  - url: http://p:1\n")
    with pytest.raises(ConfigError, match=r"prefill.0.side_channel_port"):
        read_pool_file(f, "vllm", "concurrent")
    f.write_text("decode:\n  - url: http://d:1\n    extra: 1\n")
    with pytest.raises(ConfigError, match=r"decode.0.extra"):
        read_pool_file(f, "vllm", "sequential")


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"prefill": [{"url": "http://p:1"}]}, "decode: List should have at least 1 item"),
        ({"prefill": [{"url": "http://p:1"}], "discovery": {"decode": {"name": "d"}}},
         "port: required"),
        ({"prefill": [{"url": "http://p:1"}],
          "discovery": {"decode": {"name": "d", "record": "SRV", "port": 1}}}, "carry the ports"),
        ({"flow": "concurrent", "decode": [{"url": "http://d:1"}],
          "discovery": {"prefill": {"name": "p", "port": 1}}},
         "discovery.prefill.side_channel_port"),
        ({"prefill": [{"url": "http://p:1"}],
          "discovery": {"decode": {"name": "d", "port": 1}, "nameservers": ["h:x"]}},
         "nameservers"),
    ],
)  # fmt: skip
def test_settings_errors(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_config(data)


def test_settings_accept_pools_from_discovery() -> None:
    c = build_config({"discovery": {"prefill": {"name": "p", "port": 1}, "pool_file": "/x.yaml"}})
    assert c.prefill == [] and c.decode == []
    assert parse_nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_nameserver("[::1]:53") == ("::1", 53)
    assert parse_nameserver("10.0.0.10") == ("10.0.0.10", 53)
    assert DnsPool(name="x", port=8, side_channel_port=5).endpoint("fd00::1") == {
        "url": "http://[fd00::1]:8", "side_channel_port": 5,
    }  # fmt: skip
