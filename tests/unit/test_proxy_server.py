"""The proxy's own logic (pairing, relay, retries, timeouts, cancellation, error mapping) against
fake engine servers on loopback.

``FakeEngine`` is a fake: a tiny aiohttp app that records what it receives and misbehaves on
demand. It exists only to unit-test the proxy's logic fast; the real engines are exercised in
tests/integration/test_proxy_vllm.py.
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

from splitserve.proxy.config import build_config
from splitserve.proxy.server import ProxyServer


class FakeEngine:
    """A fake OpenAI engine server. ``mode``: ok | error500 | error400 | hang | die_midstream |
    stall_midstream | refuse_prefill_params (answers without kv_transfer_params)."""

    def __init__(self, name: str, mode: str = "ok", tokens: int = 5, delay: float = 0.0) -> None:
        self.name = name
        self.mode = mode
        self.tokens = tokens
        self.delay = delay
        self.healthy = True
        self.health_hangs = False
        self.bodies: list[dict[str, Any]] = []
        self.cancelled = 0
        self.finished = 0
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_hangs:
            await asyncio.sleep(3600)
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owner": self.name}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.finished += 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "error500":
            return web.json_response(
                {"error": {"message": f"{self.name} broke", "type": "x", "code": 500}}, status=500
            )
        if self.mode == "error400":
            return web.json_response(
                {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}},
                status=400,
            )
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") or (
            "bootstrap_room" in body and self.name.startswith("p")
        ):
            answer: dict[str, Any] = {"id": "p", "choices": [{"text": "x", "index": 0}]}
            if self.mode != "refuse_prefill_params":
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "remote_host": "127.0.0.1",
                    "remote_port": 1234,
                    "remote_engine_id": self.name,
                }
            return web.json_response(answer)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "d",
                    "choices": [{"text": " t" * self.tokens, "index": 0}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": self.tokens},
                    "served_by": self.name,
                }
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(self.tokens):
            chunk = {"choices": [{"text": f" t{i}", "index": 0}], "served_by": self.name}
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if self.mode == "stall_midstream" and i == 1:
                await asyncio.sleep(3600)
            if self.mode == "die_midstream" and i == 1:
                assert request.transport is not None
                request.transport.abort()
                return out
            await asyncio.sleep(0.01)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def start_fake(engine: FakeEngine) -> FakeEngine:
    engine.server = TestServer(engine.app(), host="127.0.0.1")
    await engine.server.start_server()
    return engine


@pytest.fixture
async def fakes() -> AsyncIterator[dict[str, FakeEngine]]:
    engines = {n: await start_fake(FakeEngine(n)) for n in ("p1", "p2", "d1", "d2")}
    yield engines
    for e in engines.values():
        assert e.server is not None
        await e.server.close()


async def start_proxy(settings: dict[str, Any]) -> ProxyServer:
    config = build_config({"host": "127.0.0.1", "port": 0, **settings})
    return await ProxyServer(config).start()


@pytest.fixture
async def proxies() -> AsyncIterator[list[ProxyServer]]:
    started: list[ProxyServer] = []
    yield started
    for p in started:
        await p.close()


def pd(fakes: dict[str, FakeEngine], p: list[str], d: list[str], **kw: Any) -> dict[str, Any]:
    return {
        "prefill": [
            {"url": fakes[n].url, "side_channel_port": 7000 + i, "bootstrap_port": 8990 + i}
            for i, n in enumerate(p)
        ],
        "decode": [{"url": fakes[n].url} for n in d],
        "health": {"interval_s": 0.1, "timeout_s": 10.0},  # no false ejection under load
        **kw,
    }


async def post(url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, **kw) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw


async def stream_events(url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:]
                events.append(data.decode() if data == b"[DONE]" else json.loads(data))
        return r.status, events


COMPLETION = {"model": "tiny", "prompt": "hello world", "max_tokens": 5, "temperature": 0}


async def test_sequential_flow_nonstreaming(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 200, answer
    assert answer["served_by"] == "d1"
    (p_body,) = fakes["p1"].bodies
    (d_body,) = fakes["d1"].bodies
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert len(p_body["kv_transfer_params"]["transfer_id"]) == 32
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "p1", "P's params go to D"
    assert d_body["max_tokens"] == 5


async def test_sequential_flow_streaming_relays_every_chunk(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    status, events = await stream_events(proxy.url + "/v1/completions", body)
    assert status == 200
    assert [e["choices"][0]["text"] for e in events[:-1]] == [f" t{i}" for i in range(5)]
    assert events[-1] == "[DONE]"
    assert fakes["d1"].bodies[0]["stream_options"] == {"include_usage": True}
    assert "stream_options" not in fakes["p1"].bodies[0]
    metrics = proxy.state.metrics.render().decode()
    assert 'splitserve_proxy_requests_total{route="completions",status="200"} 1.0' in metrics
    assert "splitserve_proxy_ttft_seconds_count" in metrics


async def test_concurrent_flow_sends_transfer_id_to_both(fakes, proxies) -> None:
    proxy = await start_proxy(
        pd(fakes, ["p1"], ["d1"], flow="concurrent", first_token_from_prefill=False)
    )
    proxies.append(proxy)
    status, answer = await post(
        proxy.url + "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200, answer
    p_params = fakes["p1"].bodies[0]["kv_transfer_params"]
    d_params = fakes["d1"].bodies[0]["kv_transfer_params"]
    assert p_params["transfer_id"] == d_params["transfer_id"]
    assert d_params == {
        "do_remote_prefill": True,
        "transfer_id": p_params["transfer_id"],
        "remote_host": "127.0.0.1",
        "remote_port": 7000,
    }


async def test_concurrent_flow_lets_a_late_prefill_answer_arrive(fakes, proxies) -> None:
    fakes["p1"].delay = 0.3  # D's answer comes first; P's must not be cancelled (no abort)
    proxy = await start_proxy(
        pd(fakes, ["p1"], ["d1"], flow="concurrent", first_token_from_prefill=False)
    )
    proxies.append(proxy)
    status, _ = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 200
    assert fakes["p1"].finished == 1 and fakes["p1"].cancelled == 0


async def test_sglang_flow_against_fake_standin_checks_bootstrap_fields(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], engine="sglang"))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 200, answer
    (pb,) = fakes["p1"].bodies
    (db,) = fakes["d1"].bodies
    for b in (pb, db):
        assert b["bootstrap_host"] == "127.0.0.1" and b["bootstrap_port"] == 8990
    assert pb["bootstrap_room"] == db["bootstrap_room"]
    assert answer["served_by"] == "d1"


async def test_prefill_5xx_retries_on_other_pair_with_new_transfer_id(fakes, proxies) -> None:
    fakes["p1"].mode = "error500"
    fakes["d1"].delay = 0.5  # a real D waits for P's KV; P's failure arrives first
    proxy = await start_proxy(
        pd(fakes, ["p1", "p2"], ["d1"], flow="concurrent", routing={"prefill": "round_robin"})
    )
    proxies.append(proxy)
    for _ in range(2):  # whichever P round-robin picks first, both requests succeed
        status, answer = await post(proxy.url + "/v1/completions", {**COMPLETION, "stream": False})
        assert status == 200, answer
    tids = [b["kv_transfer_params"]["transfer_id"] for b in fakes["d1"].bodies]
    assert len(set(tids)) == len(tids), "each attempt has its own transfer id"
    assert len(fakes["p1"].bodies) >= 1 and len(fakes["p2"].bodies) == 2
    metrics = proxy.state.metrics.render().decode()
    assert 'splitserve_proxy_retries_total{reason="prefill_upstream_status"}' in metrics


@pytest.mark.parametrize(
    "flow",
    [
        {"flow": "concurrent", "first_token_from_prefill": False},
        {"flow": "concurrent"},  # the first token from P (the default there)
        {"engine": "sglang"},
    ],
)
async def test_prefill_failing_while_decode_waits_aborts_decode_and_retries(
    fakes, proxies, flow: dict[str, Any]
) -> None:
    fakes["p1"].mode = "error500"
    fakes["d1"].delay = 5.0  # D waits for KV that never comes: P's failure must end that wait
    fakes["d2"].delay = 0.2
    settings = pd(fakes, ["p1", "p2"], ["d1", "d2"], routing={"prefill": "round_robin"}, **flow)
    settings["routing"]["decode"] = "round_robin"
    proxy = await start_proxy(settings)
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 200, answer
    assert answer["served_by"] == "d2", "waited for D (it would answer) instead of P's failure"
    await wait_for(lambda: fakes["d1"].cancelled == 1)  # D's request was closed: it aborts
    assert len(fakes["p1"].bodies) == 1 and len(fakes["p2"].bodies) == 1


async def test_first_token_flow_decode_connect_refused_retries_on_another_pair(
    fakes, proxies
) -> None:
    fakes["p1"].delay = 0.5  # P still prefilling when D's connect fails: noticed at once
    settings = pd(fakes, ["p1"], ["d1", "d2"], flow="concurrent", health={"interval_s": 60})
    settings["routing"] = {"decode": "round_robin"}
    proxy = await start_proxy(settings)
    proxies.append(proxy)
    assert fakes["d1"].server is not None
    await fakes["d1"].server.close()  # d1 goes away after the proxy started
    loop = asyncio.get_running_loop()
    for _ in range(2):  # whichever D round-robin picks first, both requests succeed
        t0 = loop.time()
        status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
        assert status == 200, answer
        assert answer["served_by"] == "d2"
        assert answer["choices"][0]["text"].startswith("x"), "P's token first"
    assert not proxy.state.decode.backends[0].healthy
    assert loop.time() - t0 < 2.0
    metrics = proxy.state.metrics.render().decode()
    assert 'splitserve_proxy_retries_total{reason="decode_connect"} 1.0' in metrics
    await wait_for(lambda: fakes["p1"].finished == len(fakes["p1"].bodies))


async def test_first_token_flow_prefill_timeout_is_504_and_cancels_both(fakes, proxies) -> None:
    fakes["p1"].mode = "hang"
    fakes["d1"].mode = "hang"
    settings = pd(fakes, ["p1"], ["d1"], flow="concurrent", timeouts={"first_byte_s": 0.3})
    proxy = await start_proxy({**settings, "retries": {"max_attempts": 1}})
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 504
    assert answer["error"]["type"] == "timeout"
    assert "prefill answer" in answer["error"]["message"]
    await wait_for(lambda: fakes["p1"].cancelled == 1 and fakes["d1"].cancelled == 1)
    backends = proxy.state.prefill.backends + proxy.state.decode.backends
    await wait_for(lambda: all(b.outstanding == 0 for b in backends))


async def test_first_token_flow_decode_first_byte_timeout_after_the_token_is_an_sse_error(
    fakes, proxies
) -> None:
    fakes["d1"].mode = "hang"
    settings = pd(fakes, ["p1"], ["d1"], flow="concurrent", timeouts={"first_byte_s": 0.3})
    proxy = await start_proxy(settings)
    proxies.append(proxy)
    status, events = await stream_events(
        proxy.url + "/v1/completions", {**COMPLETION, "stream": True}
    )
    assert status == 200
    assert events[0]["choices"][0]["text"] == "x", "P's token went out first"
    assert events[-1]["error"]["type"] == "timeout" and "[DONE]" not in events
    await wait_for(lambda: fakes["d1"].cancelled == 1)
    metrics = proxy.state.metrics.render().decode()
    assert 'splitserve_proxy_errors_total{kind="midstream_timeout"} 1.0' in metrics
    assert fakes["p1"].cancelled == 0, "P answered: nothing of P's was cut"


async def test_all_prefill_fail_gives_502_with_upstream_body(fakes, proxies) -> None:
    fakes["p1"].mode = "error500"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 500
    assert answer["error"]["message"] == "p1 broke"
    assert fakes["d1"].bodies == [], "D never sees a request whose prefill failed"


async def test_upstream_4xx_is_relayed_not_retried(fakes, proxies) -> None:
    fakes["p1"].mode = "error400"
    proxy = await start_proxy(pd(fakes, ["p1", "p2"], ["d1"]))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 400
    assert answer["error"]["message"] == "prompt too long"
    assert fakes["p2"].bodies == []


async def test_prefill_without_kv_params_is_a_clear_502(fakes, proxies) -> None:
    fakes["p1"].mode = "refuse_prefill_params"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 502
    assert "kv_transfer_params" in answer["error"]["message"]


async def test_prefill_timeout_is_504_and_cancels_upstream(fakes, proxies) -> None:
    fakes["p1"].mode = "hang"
    proxy = await start_proxy(
        pd(fakes, ["p1"], ["d1"], timeouts={"first_byte_s": 0.3}, retries={"max_attempts": 1})
    )
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 504
    assert answer["error"]["type"] == "timeout"
    await wait_for(lambda: fakes["p1"].cancelled == 1)


async def test_decode_dies_midstream_ends_stream_with_error_event(fakes, proxies) -> None:
    fakes["d1"].mode = "die_midstream"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1", "d2"], routing={"decode": "round_robin"}))
    proxies.append(proxy)
    url = proxy.url + "/v1/completions"
    status, events = await stream_events(url, {**COMPLETION, "stream": True})
    assert status == 200
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert "error" in events[-1] and "[DONE]" not in events
    assert fakes["d2"].bodies == [], "after the first byte there is never a retry"
    metrics = proxy.state.metrics.render().decode()
    assert 'splitserve_proxy_errors_total{kind="midstream_upstream"} 1.0' in metrics


async def test_stalled_stream_hits_idle_timeout(fakes, proxies) -> None:
    fakes["d1"].mode = "stall_midstream"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], timeouts={"stream_idle_s": 0.3}))
    proxies.append(proxy)
    status, events = await stream_events(
        proxy.url + "/v1/completions", {**COMPLETION, "stream": True}
    )
    assert status == 200
    assert [e["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    assert events[-1]["error"]["type"] == "timeout"
    await wait_for(lambda: fakes["d1"].cancelled == 1)


async def test_total_timeout_ends_a_stream_that_keeps_flowing(fakes, proxies) -> None:
    # D never stalls long enough for the idle timeout; the request's total bound still holds.
    fakes["d1"].tokens = 400  # 10 ms apart: about 4 s
    timeouts = {"total_s": 0.8, "first_byte_s": 0.5, "stream_idle_s": 0.5}
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], timeouts=timeouts))
    proxies.append(proxy)
    status, events = await stream_events(
        proxy.url + "/v1/completions", {**COMPLETION, "stream": True}
    )
    assert status == 200
    assert 1 < len(events) < 400
    assert events[-1]["error"]["type"] == "timeout"
    await wait_for(lambda: fakes["d1"].cancelled == 1)


async def test_slow_decode_first_byte_timeout_is_504(fakes, proxies) -> None:
    fakes["d1"].mode = "hang"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], timeouts={"first_byte_s": 0.3}))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 504 and "first byte" in answer["error"]["message"]
    await wait_for(lambda: fakes["d1"].cancelled == 1)


async def test_client_disconnect_cancels_both_upstreams(fakes, proxies) -> None:
    fakes["p1"].mode = "hang"  # concurrent flow: P is still prefilling when the client leaves
    fakes["d1"].mode = "hang"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], flow="concurrent"))
    proxies.append(proxy)
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(
            s.post(proxy.url + "/v1/completions", json={**COMPLETION, "stream": True})
        )
        await wait_for(lambda: fakes["p1"].bodies and fakes["d1"].bodies)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: fakes["p1"].cancelled == 1 and fakes["d1"].cancelled == 1)
    await wait_for(
        lambda: all(
            b.outstanding == 0 for b in proxy.state.prefill.backends + proxy.state.decode.backends
        )
    )


async def test_client_disconnect_during_sequential_prefill_cancels_it(fakes, proxies) -> None:
    fakes["p1"].mode = "hang"
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(proxy.url + "/v1/completions", json=COMPLETION))
        await wait_for(lambda: fakes["p1"].bodies)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: fakes["p1"].cancelled == 1)
    assert fakes["d1"].bodies == []
    await wait_for(lambda: 'status="499"' in proxy.state.metrics.render().decode())


async def test_client_disconnect_midstream_cancels_decode(fakes, proxies) -> None:
    fakes["d1"].tokens = 1000
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    async with aiohttp.ClientSession() as s:
        r = await s.post(proxy.url + "/v1/completions", json={**COMPLETION, "stream": True})
        await r.content.readline()
        r.close()
    await wait_for(lambda: fakes["d1"].cancelled == 1)


async def test_connect_refused_ejects_and_retries(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1", "p2"], ["d1"], health={"interval_s": 60}))
    proxies.append(proxy)
    assert fakes["p1"].server is not None
    await fakes["p1"].server.close()  # p1 goes away after the proxy started
    for _ in range(3):
        status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
        assert status == 200, answer
    p1 = proxy.state.prefill.backends[0]
    assert not p1.healthy
    assert len(fakes["p2"].bodies) == 3


async def test_server_down_at_start_is_ejected_and_readmitted(fakes, proxies) -> None:
    fakes["d2"].healthy = False
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1", "d2"]))
    proxies.append(proxy)
    d2 = proxy.state.decode.backends[1]
    assert not d2.healthy
    for _ in range(4):
        status, _ = await post(proxy.url + "/v1/completions", COMPLETION)
        assert status == 200
    assert fakes["d2"].bodies == []
    fakes["d2"].healthy = True
    await wait_for(lambda: d2.healthy)
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = await r.text()
    assert "splitserve_proxy_ejections_total" in text


async def test_a_hanging_health_check_does_not_delay_another_servers_ejection(
    fakes, proxies
) -> None:
    proxy = await start_proxy(
        pd(fakes, ["p1"], ["d1", "d2"], health={"interval_s": 0.1, "timeout_s": 60.0})
    )
    proxies.append(proxy)
    d1, d2 = proxy.state.decode.backends
    fakes["d1"].health_hangs = True  # d1's next check runs until its 60 s timeout
    fakes["d2"].healthy = False
    await wait_for(lambda: not d2.healthy, timeout=30.0)  # one round at a time: >= 120 s
    assert d1.healthy
    fakes["d2"].healthy = True
    await wait_for(lambda: d2.healthy, timeout=30.0)


async def test_ready_and_health(fakes, proxies) -> None:
    fakes["p1"].healthy = False
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/health") as r:
            assert r.status == 200
        async with s.get(proxy.url + "/ready") as r:
            assert r.status == 503
            assert (await r.json())["prefill"]["healthy"] == 0
        status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
        assert status == 503 and "no healthy prefill server" in answer["error"]["message"]
        fakes["p1"].healthy = True
        await wait_for(lambda: proxy.state.prefill.backends[0].healthy)
        async with s.get(proxy.url + "/ready") as r:
            assert r.status == 200
        async with s.get(proxy.url + "/v1/models") as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["owner"] == "d1"


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "empty"),
        (json.dumps({"model": "tiny"}).encode(), "'prompt'"),
        (json.dumps({"prompt": ["a", "b"]}).encode(), "batched"),
        (json.dumps({"prompt": "a", "n": 2}).encode(), "'n'"),
        (json.dumps({"prompt": "a", "stream": "yes"}).encode(), "'stream'"),
        (json.dumps({"prompt": "a", "max_tokens": 0}).encode(), "max_tokens"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),  # was a 500 (RecursionError)
        (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
        (b'{"prompt": "a", "temperature": NaN}', "NaN is not a JSON value"),
    ],
)
async def test_bad_input_is_400_with_message(fakes, proxies, raw: bytes, fragment: str) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            proxy.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        assert r.status == 400
        answer = await r.json()
    assert fragment in answer["error"]["message"]
    assert fakes["p1"].bodies == []


async def test_chat_requires_messages(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    status, answer = await post(
        proxy.url + "/v1/chat/completions", {"model": "tiny", "messages": []}
    )
    assert status == 400 and "messages" in answer["error"]["message"]


async def test_oversized_body_is_413(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], max_body_bytes=2048))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", {"prompt": "x" * 5000})
    assert status == 413
    assert "limit of 2048 bytes" in answer["error"]["message"]


async def test_api_key(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], api_key="s3cret"))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/completions", COMPLETION)
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    status, _ = await post(
        proxy.url + "/v1/completions", COMPLETION, headers={"Authorization": "Bearer wrong"}
    )
    assert status == 401
    status, _ = await post(
        proxy.url + "/v1/completions", COMPLETION, headers={"Authorization": "Bearer s3cret"}
    )
    assert status == 200
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as r:
        assert r.status == 200


async def test_api_key_guards_ready_and_metrics_not_health(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], api_key="s3cret"))
    proxies.append(proxy)
    good = {"Authorization": "Bearer s3cret"}
    async with aiohttp.ClientSession() as s:
        for path in ("/ready", "/metrics", "/v1/models"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with s.get(proxy.url + path, headers=headers) as r:
                    assert r.status == 401, path
                    raw = await r.read()
                    assert json.loads(raw)["error"]["type"] == "authentication_error"
                    assert fakes["p1"].url.encode() not in raw  # nothing about the servers
        async with s.get(proxy.url + "/ready", headers=good) as r:
            assert r.status == 200 and (await r.json())["prefill"]["servers"][0]["url"]
        async with s.get(proxy.url + "/metrics", headers=good) as r:
            assert r.status == 200 and b"splitserve_proxy_" in await r.read()
        async with s.get(proxy.url + "/health") as r:  # open for probes, and says nothing
            assert r.status == 200
            raw = await r.read()
            assert json.loads(raw) == {"status": "ok"}
            assert b"127.0.0.1" not in raw


async def test_ready_and_metrics_are_open_without_a_key(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    async with aiohttp.ClientSession() as s:
        for path in ("/ready", "/metrics", "/health"):
            async with s.get(proxy.url + path) as r:
                assert r.status == 200, path


async def test_max_in_flight_answers_503_with_retry_after(fakes, proxies) -> None:
    fakes["d1"].delay = 1.0  # holds the first request while the second arrives
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], max_in_flight=1))
    proxies.append(proxy)
    first = asyncio.ensure_future(post(proxy.url + "/v1/completions", COMPLETION))
    await wait_for(lambda: proxy.state.in_flight == 1)
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/v1/completions", json=COMPLETION) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            error = (await r.json())["error"]
            assert error["type"] == "service_unavailable" and "limit of 1" in error["message"]
        async with s.get(proxy.url + "/health") as r:  # probes are not counted against it
            assert r.status == 200
        async with s.get(proxy.url + "/metrics") as r:
            text = (await r.read()).decode()
    assert 'splitserve_proxy_edge_rejections_total{reason="max_in_flight"} 1.0' in text
    status, _ = await first
    assert status == 200
    assert proxy.state.in_flight == 0
    status, _ = await post(proxy.url + "/v1/completions", COMPLETION)  # room again
    assert status == 200


async def test_a_slow_client_is_cut_off_and_counted(fakes, proxies) -> None:
    proxy = await start_proxy(
        pd(fakes, ["p1"], ["d1"], client_timeouts={"header_s": 0.5, "body_s": 0.5})
    )
    proxies.append(proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
    answer = await asyncio.wait_for(reader.read(), 10.0)  # the answer, then the close
    assert answer.startswith(b"HTTP/1.1 408 ")
    writer.close()
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = (await r.read()).decode()
    assert 'splitserve_proxy_edge_rejections_total{reason="body_timeout"} 1.0' in text
    assert fakes["p1"].bodies == []


async def test_unknown_route_is_json_404(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"]))
    proxies.append(proxy)
    status, answer = await post(proxy.url + "/v1/embeddings", {"input": "x"})
    assert status in (404, 405)
    assert "error" in answer


async def test_several_workers_share_the_port_and_aggregate_metrics(fakes) -> None:
    import sys

    import psutil

    from splitserve.netutil import free_port

    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "proxy", "--workers", "2", "--port", str(port)]
    argv += ["--prefill", fakes["p1"].url, "--decode", fakes["d1"].url]
    proc = await asyncio.create_subprocess_exec(*argv)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:

            async def up() -> bool:
                try:
                    async with s.get(url + "/ready") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            # Two interpreters start here; on a loaded 2-core machine that has taken most of a
            # minute, so the bound is generous (it only matters when something is wrong).
            end = asyncio.get_running_loop().time() + 150
            while not await up():
                assert proc.returncode is None, "proxy exited"
                assert asyncio.get_running_loop().time() < end, "proxy workers not up"
                await asyncio.sleep(0.2)
            workers = psutil.Process(proc.pid).children()
            assert len([w for w in workers if "spawn" in " ".join(w.cmdline())]) == 2
            for _ in range(10):
                # A new session each time: new connections, spread over the workers.
                async with (
                    aiohttp.ClientSession() as fresh,
                    fresh.post(url + "/v1/completions", json=COMPLETION) as r,
                ):
                    assert r.status == 200
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        line = [x for x in text.splitlines() if x.startswith("splitserve_proxy_requests_total{")]
        assert line and float(line[0].rsplit(" ", 1)[1]) == 10.0, line
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 90)
    assert psutil.pid_exists(proc.pid) is False or psutil.Process(proc.pid).status() == "zombie"


async def wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Bounded wait on a condition (no timing luck: polls until true or fails)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_max_connections_turns_away_with_503(fakes, proxies) -> None:
    proxy = await start_proxy(pd(fakes, ["p1"], ["d1"], max_connections=1))
    proxies.append(proxy)
    held_reader, held_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    await wait_for(lambda: len(proxy.http.connections) == 1)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10.0)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
    assert json.loads(body)["error"]["type"] == "service_unavailable"
    writer.close()
    held_writer.close()
    await wait_for(lambda: not proxy.http.connections)
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = (await r.read()).decode()
    assert 'splitserve_proxy_edge_rejections_total{reason="max_connections"} 1.0' in text
