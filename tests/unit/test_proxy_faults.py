"""Faults the proxy must survive (docs/proxy.md, "Faults"): outlier ejection from real request
outcomes with half-open probes, the panic threshold, health-check timeouts weighed below real
requests, and the retry rule (a request an engine may have read is never sent twice).

The engines here are stubs: ``StubEngine`` (a tiny aiohttp app that misbehaves on demand) and
``DropAfterBody`` (a raw asyncio server that reads a whole request and drops the connection).
They stand in for vLLM only to test the proxy, which is the real one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from splitserve.proxy.config import HealthSettings, OutlierSettings, build_config
from splitserve.proxy.errors import NoHealthyServer
from splitserve.proxy.health import HealthChecker, HealthTracker
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, Pool
from splitserve.proxy.server import ProxyServer

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}


class StubEngine:
    """A stub vLLM server. ``mode``: ok | error500 | hang. ``health_delay``: seconds /health
    takes. Counts the generation requests it received (``requests``)."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name = name
        self.mode = mode
        self.health_delay = 0.0
        self.slow_health_checks = 0  # /health requests answered late (health_delay)
        self.requests = 0
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> StubEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/health", self._health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_delay:
            self.slow_health_checks += 1
            await asyncio.sleep(self.health_delay)
        return web.Response(status=200)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "error500":
            return web.json_response({"error": {"message": "broken", "code": 500}}, status=500)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return web.json_response(
                {
                    "choices": [{"text": "x", "index": 0}],
                    "kv_transfer_params": {"remote_engine_id": self.name, "remote_port": 1},
                }
            )
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": " t t", "index": 0}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": " t", "index": 0}]}\n\n')
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


class DropAfterBody:
    """A stub server that answers ``/health``, answers its first ``answer_first`` POSTs with a
    keep-alive 200 (so the proxy pools the connection), and then, for every later POST, reads the
    whole request and drops the connection without a byte of answer. ``posts``: POSTs read."""

    def __init__(self, answer_first: int, answer: dict[str, Any]) -> None:
        self.answer_first = answer_first
        self.answer = json.dumps(answer).encode()
        self.posts = 0
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> DropAfterBody:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await r.readexactly(length)
                if head.startswith(b"POST"):
                    self.posts += 1
                    if self.posts > self.answer_first:
                        w.transport.abort()  # read it all, answer nothing
                        return
                    body = self.answer
                else:
                    body = b"{}"
                w.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    """Things to close at the end of a test (stubs and proxies)."""
    items: list[Any] = []
    yield items
    for item in reversed(items):
        if isinstance(item, StubEngine):
            assert item.server is not None
            await item.server.close()
        else:
            await item.close()


async def stubs(closing: list[Any], *modes: str) -> list[StubEngine]:
    engines = [await StubEngine(f"s{i}", m).start() for i, m in enumerate(modes)]
    closing.extend(engines)
    return engines


async def proxy_for(
    closing: list[Any], prefill: list[Any], decode: list[Any], **settings: Any
) -> ProxyServer:
    config = build_config(
        {
            "host": "127.0.0.1",
            "port": 0,
            "prefill": [{"url": p.url} for p in prefill],
            "decode": [{"url": d.url} for d in decode],
            "routing": {"prefill": "round_robin", "decode": "round_robin"},
            **settings,
        }
    )
    proxy = await ProxyServer(config).start()
    closing.append(proxy)
    return proxy


async def post(proxy: ProxyServer, body: dict[str, Any] = COMPLETION) -> int:
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def metrics_text(proxy: ProxyServer) -> str:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        return await r.text()


async def wait_for(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Bounded wait on a condition (polls; no timing luck)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------- outlier detection


async def test_a_decode_answering_500_is_ejected_then_probed_back_in(closing) -> None:
    p, d_bad, d_ok = await stubs(closing, "ok", "error500", "ok")
    proxy = await proxy_for(
        closing,
        [p],
        [d_bad, d_ok],
        outlier={"consecutive_failures": 3, "base_ejection_s": 1.0, "max_ejection_s": 10},
        health={"interval_s": 600},  # only requests decide here
    )
    bad = proxy.state.decode.backends[0]
    statuses = []
    while d_bad.requests < 3:
        statuses.append(await post(proxy))
    assert statuses.count(500) == 3  # D's 5xx reaches the client (not retried)
    assert not bad.healthy and bad.ejected_by == "outlier"
    for _ in range(4):  # while ejected (1 s), d_ok serves everything
        assert await post(proxy) == 200
    assert d_bad.requests == 3

    # Half-open after 1 s: one request probes it; it fails, so it is out again, for 2 s.
    await wait_for(lambda: bad.half_open(proxy.state.decode.clock()))
    results = [await post(proxy) for _ in range(2)]
    assert d_bad.requests == 4 and sorted(results) == [200, 500]
    assert not bad.healthy and bad.ejections == 2 and bad.outlier_streak == 2

    # It recovers; the next probe readmits it.
    d_bad.mode = "ok"
    await wait_for(lambda: bad.half_open(proxy.state.decode.clock()))
    assert all([await post(proxy) == 200 for _ in range(2)])
    assert bad.healthy and not bad.probation and bad.outlier_streak == 0
    assert d_bad.requests == 5
    text = await metrics_text(proxy)
    assert (
        f'splitserve_proxy_ejections_total{{pool="decode",reason="outlier",'
        f'server="{d_bad.url}"}} 2.0' in text
    )


async def test_a_stalling_decode_is_ejected_by_timeouts(closing) -> None:
    p, d_hang, d_ok = await stubs(closing, "ok", "hang", "ok")
    proxy = await proxy_for(
        closing,
        [p],
        [d_hang, d_ok],
        outlier={"consecutive_failures": 2, "base_ejection_s": 60},
        timeouts={"first_byte_s": 0.5},
        health={"interval_s": 600},
    )
    stream = {**COMPLETION, "stream": True}
    statuses = []
    while d_hang.requests < 2:
        statuses.append(await post(proxy, stream))
    assert statuses.count(504) == 2
    hang = proxy.state.decode.backends[0]
    assert not hang.healthy and hang.ejected_by == "outlier"
    for _ in range(3):
        assert await post(proxy, stream) == 200
    assert d_hang.requests == 2


# ---------------------------------------------------------------------- panic, slow health


async def test_a_pool_whose_every_server_is_ejected_is_still_served(closing) -> None:
    (p,) = await stubs(closing, "ok")
    (d,) = await stubs(closing, "ok")
    proxy = await proxy_for(
        closing, [p], [d], health={"interval_s": 0.05, "timeout_s": 0.2, "timeouts_to_eject": 1}
    )
    p_backend = proxy.state.prefill.backends[0]
    p.health_delay = 1.0  # every check times out: P is ejected, though it serves
    await wait_for(lambda: not p_backend.healthy)
    assert p_backend.ejected_by == "health_timeout"
    assert await post(proxy) == 200  # panic: the pool's servers are tried anyway
    text = await metrics_text(proxy)
    assert 'splitserve_proxy_panic_routes_total{pool="prefill"}' in text
    assert 'reason="health_timeout"' in text


async def ready(proxy: ProxyServer) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/ready") as r:
        return r.status, await r.json()


async def test_ready_answers_503_while_a_pool_is_in_panic(closing) -> None:
    """Panic keeps requests flowing, but readiness tells the truth: a pool below the panic
    threshold (here 1 of 2 prefill servers with threshold 0.75) answers 503 with ``panic``,
    though requests still succeed; once the server is back, 200."""
    p_ok, p_slow = await stubs(closing, "ok", "ok")
    (d,) = await stubs(closing, "ok")
    proxy = await proxy_for(
        closing,
        [p_ok, p_slow],
        [d],
        routing={"panic_threshold": 0.75},
        health={"interval_s": 0.05, "timeout_s": 0.2, "timeouts_to_eject": 1},
    )
    assert (await ready(proxy))[0] == 200
    p_slow.health_delay = 1.0
    slow = proxy.state.prefill.backends[1]
    await wait_for(lambda: not slow.healthy)
    status, data = await ready(proxy)
    assert status == 503 and data["prefill"]["panic"] and not data["decode"]["panic"]
    assert data["prefill"]["healthy"] == 1
    assert await post(proxy) == 200  # still served
    p_slow.health_delay = 0.0
    await wait_for(lambda: slow.healthy)
    status, data = await ready(proxy)
    assert status == 200 and not data["prefill"]["panic"]


async def test_without_panic_an_empty_pool_answers_503(closing) -> None:
    (p,) = await stubs(closing, "ok")
    (d,) = await stubs(closing, "ok")
    proxy = await proxy_for(
        closing,
        [p],
        [d],
        routing={"panic_threshold": 0},
        health={"interval_s": 0.05, "timeout_s": 0.2, "timeouts_to_eject": 1},
    )
    p.health_delay = 1.0
    await wait_for(lambda: not proxy.state.prefill.backends[0].healthy)
    assert await post(proxy) == 503


async def test_a_prefill_with_a_slow_health_check_never_causes_a_503(closing) -> None:
    """P computes (its /health answers late) while its requests succeed: real outcomes weigh
    more than health-check timeouts, so P stays in rotation, even with panic off."""
    (p,) = await stubs(closing, "ok")
    (d,) = await stubs(closing, "ok")
    proxy = await proxy_for(
        closing,
        [p],
        [d],
        routing={"panic_threshold": 0},
        health={"interval_s": 0.05, "timeout_s": 0.2},  # timeouts_to_eject: default 3
    )
    p.health_delay = 1.0
    p_backend = proxy.state.prefill.backends[0]
    loop = asyncio.get_running_loop()
    end = loop.time() + 2.0  # about 8 health checks time out meanwhile
    n = 0
    while loop.time() < end:
        assert await post(proxy) == 200
        n += 1
        await asyncio.sleep(0.05)
    assert n > 5
    assert p.slow_health_checks >= 3, "too few slow health checks: the test proved nothing"
    assert p_backend.ejections == 0


# ---------------------------------------------------------------------- retry safety


async def test_a_decode_that_drops_a_request_it_read_gets_it_once(closing) -> None:
    (p,) = await stubs(closing, "ok")
    d = await DropAfterBody(answer_first=1, answer={"choices": [{"text": "a"}]}).start()
    closing.append(d)
    proxy = await proxy_for(closing, [p], [d], health={"interval_s": 600})
    assert await post(proxy) == 200  # the connection to D is now pooled
    assert await post(proxy) == 502  # D read it and dropped the connection
    await asyncio.sleep(0.1)
    assert d.posts == 2, "the second request was sent exactly once"


async def test_a_dropped_decode_request_is_not_sent_to_another_decode(closing) -> None:
    (p,) = await stubs(closing, "ok")
    (d_ok,) = await stubs(closing, "ok")
    d_drop = await DropAfterBody(answer_first=0, answer={}).start()
    closing.append(d_drop)
    proxy = await proxy_for(closing, [p], [d_drop, d_ok], health={"interval_s": 600})
    statuses = [await post(proxy) for _ in range(4)]  # round robin: d_drop, d_ok, ...
    assert d_drop.posts == statuses.count(502) == 2
    assert d_ok.requests == statuses.count(200) == 2


async def test_a_dropped_prefill_request_is_retried_on_another_pair(closing) -> None:
    """P's one-token prefill is idempotent by construction (docs/proxy.md, "Faults"): after a
    P that read it and dropped the connection, another P gets it; the dropping P only once."""
    p_drop = await DropAfterBody(answer_first=0, answer={}).start()
    closing.append(p_drop)
    p_ok, d = await stubs(closing, "ok", "ok")
    proxy = await proxy_for(closing, [p_drop, p_ok], [d], health={"interval_s": 600})
    assert await post(proxy) == 200
    assert p_drop.posts == 1 and p_ok.requests == 1 and d.requests == 1


# ---------------------------------------------------------------------- the rules, pure


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_outlier_ejection_grows_and_half_open_admits_one_probe() -> None:
    clock = Clock()
    bs = [Backend("decode", "http://d0:1"), Backend("decode", "http://d1:1")]
    tracker = HealthTracker(
        bs,
        HealthSettings(),
        ProxyMetrics(),
        OutlierSettings(consecutive_failures=2, base_ejection_s=10, max_ejection_s=25),
        clock=clock,
    )
    pool = Pool("decode", bs, "round_robin", clock=clock)
    b = bs[0]
    tracker.request_failed(b, "500")
    tracker.request_succeeded(b)  # the streak restarts
    tracker.request_failed(b, "500")
    assert b.healthy
    tracker.request_failed(b, "500")
    assert not b.healthy and b.ejected_until == clock.now + 10
    tracker.observe(b, True)  # a passing health check does not end it early
    assert not b.healthy
    assert {pool.pick().url for _ in range(4)} == {bs[1].url}
    clock.now += 10
    assert pool.pick(exclude=[bs[1]]) is b  # the half-open probe
    with pytest.raises(NoHealthyServer):
        pool.pick(exclude=[bs[1]])  # one probe per half-open period
    tracker.request_failed(b, "500")  # the probe failed: out again, twice as long
    assert not b.healthy and b.ejected_until == clock.now + 20
    clock.now += 20
    tracker.observe(b, True)  # a health check can probe it back in too: on probation
    assert b.healthy and b.probation
    tracker.request_failed(b, "500")  # one failure on probation: out, for at most 25 s
    assert not b.healthy and b.ejected_until == clock.now + 25
    clock.now += 25
    assert pool.pick(exclude=[bs[1]]) is b
    tracker.request_succeeded(b)
    assert b.healthy and not b.probation and b.outlier_streak == 0 and b.ejections == 3


class ConnectTimesOut:
    """A session whose every request times out while connecting, as aiohttp reports any
    timeout that fires then (the request's own total included)."""

    def __init__(self, connect_s: float | None) -> None:
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)

    def get(self, url: str, **kwargs: Any) -> ConnectTimesOut:
        return self

    async def __aenter__(self) -> None:
        raise aiohttp.ConnectionTimeoutError(f"Connection timeout to host {self}")

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(
    ("timeout_s", "connect_s", "reason"),
    [(0.001, 5.0, "health_timeout"), (1.0, None, "health_timeout"), (5.0, 5.0, "health_check")],
)
async def test_a_check_that_spends_its_own_budget_connecting_is_late_not_down(
    timeout_s: float, connect_s: float | None, reason: str
) -> None:
    """A check whose ``timeout_s`` is shorter than the connect bound and runs out while
    connecting is a timeout (soft: panic still routes to the server), as a busy server's; only
    the connect bound itself (``timeouts.connect_s``, the one requests have) proves it down.
    Before, such a check read as "cannot connect" (``health_check``: known down), so a short
    budget (the 1 ms of test_fault_matrix.py's panic test) firing during the connect took a
    live P out of the panic and its pool answered 503."""
    b = Backend("prefill", "http://p0:1")
    tracker = HealthTracker([b], HealthSettings(timeout_s=timeout_s), ProxyMetrics())
    checker = HealthChecker(tracker, ConnectTimesOut(connect_s))  # type: ignore[arg-type]
    await checker.check(b, decisive=True)
    assert b.ejected_by == reason
    pool = Pool("prefill", [b], "round_robin", panic_threshold=0.5)
    if reason == "health_timeout":
        assert pool.pick() is b and b.degraded
    else:
        with pytest.raises(NoHealthyServer):
            pool.pick()


def test_panic_routes_to_soft_ejected_servers_only() -> None:
    bs = [Backend("prefill", f"http://p{i}:1") for i in range(3)]
    panics: list[str] = []
    pool = Pool("prefill", bs, "round_robin", panic_threshold=0.5, on_panic=panics.append)
    tracker = HealthTracker(bs, HealthSettings(timeouts_to_eject=1), ProxyMetrics())
    tracker.observe(bs[0], False, "slow", timed_out=True)
    assert not bs[0].healthy and bs[0].ejected_by == "health_timeout"
    assert {pool.pick().url for _ in range(6)} == {bs[1].url, bs[2].url}  # 2 of 3: no panic
    tracker.connect_failed(bs[1], "refused")  # known down
    assert {pool.pick().url for _ in range(6)} == {bs[0].url, bs[2].url}  # 1 of 3: panic
    assert panics and set(panics) == {"prefill"}
    tracker.request_succeeded(bs[0])  # a real success readmits a server ejected as slow
    assert bs[0].healthy
    tracker.connect_failed(bs[0], "refused")
    tracker.connect_failed(bs[2], "refused")
    with pytest.raises(NoHealthyServer):  # every server refuses: nothing to route to
        pool.pick()


def test_a_health_timeout_streak_is_reset_by_a_real_success() -> None:
    b = Backend("prefill", "http://p:1")
    tracker = HealthTracker([b], HealthSettings(timeouts_to_eject=3), ProxyMetrics())
    for _ in range(10):
        tracker.observe(b, False, "slow", timed_out=True)
        tracker.observe(b, False, "slow", timed_out=True)
        assert b.healthy and b.degraded
        tracker.request_succeeded(b)
    tracker.observe(b, False, "slow", timed_out=True)
    tracker.observe(b, False, "slow", timed_out=True)
    tracker.observe(b, False, "slow", timed_out=True)
    assert not b.healthy and b.ejected_by == "health_timeout"
