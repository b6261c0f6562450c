"""The proxy's first-token-from-prefill flow: which requests take it, how P's token and D's
continuation become one answer, and what happens when the first token is the last.

``StubVllm`` is a stub engine: a tiny aiohttp app answering in vLLM's OpenAI format (P: one
non-streamed token; D: the continuation, from the second token, when asked for the first-token
flow; otherwise a colocated answer). It exists only to unit-test the proxy's logic; real vLLM
servers are behind tests/integration/test_proxy_splitserve.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from splitserve.proxy import stitch
from splitserve.proxy.config import build_config
from splitserve.proxy.server import ProxyServer

TEXT = ["A", "B", "C", "D", "E"]


class StubVllm:
    """``p_finish``: P's finish reason for its one token; ``p_text``: its text; ``d_hangs``: D
    never answers (a real D waits for the KV of a request whose first token ended it)."""

    def __init__(
        self,
        p_finish: str = "length",
        d_hangs: bool = False,
        p_text: str = "A",
        p_hangs: bool = False,
        d_drops: bool = False,
    ) -> None:
        self.p_finish = p_finish
        self.p_text = p_text
        self.d_hangs = d_hangs
        self.p_hangs = p_hangs  # P never answers (its request is cancelled when it ends)
        self.d_drops = d_drops  # D reads the request and drops the connection unanswered
        self.bodies: list[dict[str, Any]] = []
        self.cancelled = 0
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> StubVllm:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("chat/completions")
        params = body.get("kv_transfer_params") or {}
        n = body.get("max_tokens", 5)
        try:
            if params.get("do_remote_decode"):
                if self.p_hangs:
                    await asyncio.sleep(3600)
                return web.json_response(self._whole(chat, [self.p_text], self.p_finish, "p-id"))
            if params.get("first_token_from_prefill"):
                if self.d_drops:
                    assert request.transport is not None
                    request.transport.abort()
                    await asyncio.sleep(3600)
                if self.d_hangs:
                    await asyncio.sleep(3600)
                pieces = TEXT[1:n]
            else:
                pieces = TEXT[:n]
            if not body.get("stream"):
                return web.json_response(self._whole(chat, pieces, "length", "d-id"))
            return await self._stream(request, body, chat, pieces)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    @staticmethod
    def _whole(chat: bool, pieces: list[str], finish: str, rid: str) -> dict[str, Any]:
        text = "".join(pieces)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = {"prompt_tokens": 3, "completion_tokens": len(pieces)}
        usage["total_tokens"] = 3 + len(pieces)
        return {"id": rid, "created": 1, "model": "tiny", "choices": [choice], "usage": usage}

    async def _stream(self, request, body, chat, pieces) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)

        async def send(choice, usage=None):
            event = {"id": "d-id", "created": 2, "model": "tiny", "choices": choice}
            if usage is not None:
                event["usage"] = usage
            await out.write(f"data: {json.dumps(event)}\n\n".encode())

        if chat:
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            key = "delta" if chat else "text"
            value = {"content": piece} if chat else piece
            await send([{"index": 0, key: value, "finish_reason": "length" if last else None}])
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": len(pieces)}
            usage["total_tokens"] = 3 + len(pieces)
            await send([], usage)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


@pytest.fixture
def stub_settings() -> dict[str, Any]:
    return {}


@pytest.fixture
async def stack(stub_settings):
    """(proxy url, P stub, D stub), with ``stub_settings`` for the stubs."""
    p = await StubVllm(
        p_finish=stub_settings.get("p_finish", "length"),
        p_text=stub_settings.get("p_text", "A"),
        p_hangs=stub_settings.get("p_hangs", False),
    ).start()
    d = await StubVllm(
        d_hangs=stub_settings.get("d_hangs", False), d_drops=stub_settings.get("d_drops", False)
    ).start()
    config = build_config(
        {
            "host": "127.0.0.1",
            "port": 0,
            "flow": "concurrent",
            "prefill": [{"url": p.url, "side_channel_port": 7000}],
            "decode": [{"url": d.url}],
            "health": {"interval_s": 0.1, "timeout_s": 10.0},  # no false ejection under load
        }
    )
    assert config.first_token_from_prefill is True, "on by default for the concurrent flow"
    proxy = await ProxyServer(config).start()
    yield proxy.url, p, d
    await proxy.close()
    for stub in (p, d):
        assert stub.server is not None
        await stub.server.close()


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def events(url: str, body: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:]
                out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# -- which requests take the flow ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "eligible"),
    [
        ({}, True),
        (
            {
                "stop": ["x"],
                "top_p": 0.9,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            True,
        ),
        ({"frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": None, "seed": None}, True),
        ({"logprobs": 1}, False),
        ({"logprobs": True, "top_logprobs": 2}, False),
        ({"echo": True}, False),
        ({"seed": 7}, False),
        ({"frequency_penalty": 0.5}, False),
        ({"min_tokens": 3}, False),
        ({"response_format": {"type": "json_object"}}, False),
        ({"tools": []}, False),
        ({"stream_options": "yes"}, False),
    ],
)
def test_first_token_eligible(extra, eligible):
    assert stitch.first_token_eligible({**COMPLETION, **extra}) is eligible


def test_stream_rewriter_one_id_no_second_role_usage_counts_the_first_token():
    head = stitch.PrefillHead.from_prefill_answer(
        StubVllm._whole(True, ["A"], "length", "p-id"), chat=True
    )
    rewriter = stitch.StreamRewriter(head)
    role = {"id": "d", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"id": "d", "choices": [{"index": 0, "delta": {"content": "B"}}]}
    usage = {"id": "d", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    wire = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in (role, token, usage))
    wire += b"data: [DONE]\n\n"
    out = rewriter.feed(wire[:30]) + rewriter.feed(wire[30:]) + rewriter.flush()
    got = [e[6:] for e in out.split(b"\n\n") if e]
    assert got[-1] == b"[DONE]" and len(got) == 3
    first, last = json.loads(got[0]), json.loads(got[1])
    assert first["id"] == "p-id" and first["choices"][0]["delta"] == {"content": "B"}
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}


# How D may write its JSON: as vLLM does (compact), as json.dumps does, spaces on both sides.
_SEPARATORS = {"compact": (",", ":"), "spaced": (", ", ": "), "loose": (" , ", " : ")}


def _sse(event: Any, style: str = "compact") -> bytes:
    text = json.dumps(event, separators=_SEPARATORS[style])
    return b"data: " + text.encode() + b"\n\n"


def _stream_of_d(chat: bool, style: str) -> bytes:
    """D's stream as vLLM writes it (compact JSON) or with spaces, with the awkward events."""
    base = {"id": "d-id", "object": "x", "created": 2, "model": "tiny"}
    key = "delta" if chat else "text"

    def choice(text: str, finish: str | None = None) -> dict[str, Any]:
        value: Any = {"content": text} if chat else text
        return {"index": 0, key: value, "finish_reason": finish}

    events: list[Any] = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        events.append({**base, "choices": [role]})
    events += [
        {**base, "choices": [choice("B")]},
        {**base, "choices": [choice('text with "id":"d-id" and "usage": inside')]},
        {**base, "choices": [choice("é😀\\")]},
        {"object": "x", "choices": [choice("no id")]},  # an event without an id: gets P's
        {**base, "choices": [choice("C", "length")]},
        {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
        {"error": {"message": "broke", "id": "d-id"}},
    ]
    return b"".join(_sse(e, style) for e in events) + b"data: [DONE]\n\n"


class _ParseEveryEvent(stitch.StreamRewriter):
    """The reference: never learns D's id, so every event is decoded and encoded again."""

    @property
    def _d_id(self) -> None:
        return None

    @_d_id.setter
    def _d_id(self, value: object) -> None:
        pass


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("style", sorted(_SEPARATORS))
@pytest.mark.parametrize("cut", [1, 7, 64, 10_000])
def test_stream_rewriter_fast_path_gives_what_parsing_every_event_gives(
    chat, style, cut, monkeypatch
):
    decoded: list[bytes] = []
    loads = stitch.jsonio.loads
    monkeypatch.setattr(stitch.jsonio, "loads", lambda raw: decoded.append(raw) or loads(raw))
    head = stitch.PrefillHead.from_prefill_answer(
        StubVllm._whole(chat, ["A"], "length", "p-id"), chat=chat
    )
    wire = _stream_of_d(chat, style)
    fast, slow = stitch.StreamRewriter(head), _ParseEveryEvent(head)
    got_fast, got_slow = b"", b""
    for i in range(0, len(wire), cut):
        got_fast += fast.feed(wire[i : i + cut])
    got_fast += fast.flush()
    parsed_fast = len(decoded)
    for i in range(0, len(wire), cut):
        got_slow += slow.feed(wire[i : i + cut])
    got_slow += slow.flush()
    parsed_slow = len(decoded) - parsed_fast
    # Compact (as vLLM writes) or with spaces: after the first event parsed (it shows D's id
    # and how D writes it), the token events without usage, role or error skip parsing (3 of
    # them; 4 in chat, where the first event parsed is D's role chunk).
    skipped = 4 if chat else 3
    assert parsed_fast == parsed_slow - skipped

    def parsed(raw: bytes) -> list[Any]:
        return [
            e[6:].decode() if e[6:] == b"[DONE]" else json.loads(e[6:])
            for e in raw.split(b"\n\n")
            if e
        ]

    assert parsed(got_fast) == parsed(got_slow)
    events = parsed(got_fast)
    assert all(e["id"] == "p-id" for e in events if isinstance(e, dict) and "error" not in e)
    assert events[-2]["error"]["id"] == "d-id", "an error event passes unchanged"
    assert events[-3]["usage"]["completion_tokens"] == 5
    text_key = "delta" if chat else "text"
    inner = events[1]["choices"][0][text_key]
    assert (inner["content"] if chat else inner) == 'text with "id":"d-id" and "usage": inside'


@pytest.mark.parametrize("all_in_first_read", [False, True])
def test_stream_rewriter_one_replace_per_read_only_when_every_event_has_the_id(
    all_in_first_read, monkeypatch
):
    """A read whose events all hold D's id (or are [DONE]) is rewritten by one replace; one
    event without the id makes the read go event by event, and that event is parsed."""
    decoded: list[bytes] = []
    loads = stitch.jsonio.loads
    monkeypatch.setattr(stitch.jsonio, "loads", lambda raw: decoded.append(raw) or loads(raw))
    head = stitch.PrefillHead.from_prefill_answer(
        StubVllm._whole(False, ["A"], "length", "p-id"), chat=False
    )

    def token(text: str, rid: str | None = "d-id") -> bytes:
        event: dict[str, Any] = {"choices": [{"index": 0, "text": text}]}
        if rid is not None:
            event = {"id": rid, **event}
        return _sse(event)

    first = token("B")
    same = token("C") + token("D") + b"data: [DONE]\n\n"
    expected = same.replace(b'"id":"d-id"', b'"id":"p-id"')
    rewriter = stitch.StreamRewriter(head)
    if all_in_first_read:
        out = rewriter.feed(first + same)
        assert out == first.replace(b'"id":"d-id"', b'"id":"p-id"') + expected
    else:
        rewriter.feed(first)
        assert rewriter.feed(same) == expected
    assert len(decoded) == 1, "only the event that showed D's id was parsed"
    mixed = token("E") + token("F", rid=None) + token("G")
    got = [json.loads(e[6:]) for e in rewriter.feed(mixed).split(b"\n\n") if e]
    assert [e["id"] for e in got] == ["p-id"] * 3
    assert [e["choices"][0]["text"] for e in got] == ["E", "F", "G"]
    assert len(decoded) == 2, "the event without D's id was parsed, the others not"


# -- the flow through the proxy -----------------------------------------------------------------


async def test_completion_not_streamed(stack):
    url, p, d = stack
    status, answer = await post(url + "/v1/completions", COMPLETION)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == "ABCD"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert answer["id"] == "p-id" and "kv_transfer_params" not in answer
    (p_body,), (d_body,) = p.bodies, d.bodies
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert d_body["max_tokens"] == 4, "D's engine counts P's token against the limit itself"
    assert d_body["kv_transfer_params"]["first_token_from_prefill"] is True
    assert (
        d_body["kv_transfer_params"]["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
    )


async def test_completion_streamed_with_usage(stack):
    url, _, _ = stack
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    got = await events(url + "/v1/completions", body)
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["A", "B", "C", "D"]
    assert {c["id"] for c in chunks} == {"p-id"}
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


async def test_chat_streamed_and_not(stack):
    url, _, _ = stack
    status, answer = await post(url + "/v1/chat/completions", CHAT)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "ABCD"
    assert answer["usage"]["completion_tokens"] == 4
    got = await events(url + "/v1/chat/completions", {**CHAT, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in got[:-1] if c["choices"]]
    assert [d.get("role") for d in deltas].count("assistant") == 1
    assert "".join(d.get("content") or "" for d in deltas) == "ABCD"


@pytest.mark.parametrize("stub_settings", [{"p_finish": "stop", "d_hangs": True}])
async def test_a_stop_on_the_first_token_ends_the_request_and_cancels_decode(stack):
    url, _, d = stack
    status, answer = await post(url + "/v1/completions", COMPLETION)
    assert status == 200
    assert answer["choices"][0]["text"] == "A" and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 1
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    got = await events(url + "/v1/completions", body)
    assert got[0]["choices"][0] == {
        "index": 0,
        "text": "A",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }
    assert got[1]["usage"]["completion_tokens"] == 1 and got[2] == "[DONE]"
    for _ in range(200):
        if d.cancelled == 2:
            break
        await asyncio.sleep(0.01)
    assert d.cancelled == 2, "D's request is cancelled (a real D aborts and frees)"


async def test_one_token_goes_to_prefill_alone(stack):
    url, p, d = stack
    status, answer = await post(url + "/v1/completions", {**COMPLETION, "max_tokens": 1})
    assert status == 200 and answer["choices"][0]["text"] == "A"
    (p_body,) = p.bodies
    assert "kv_transfer_params" not in p_body and d.bodies == []


async def test_ineligible_request_takes_the_plain_concurrent_flow(stack):
    url, _, d = stack
    status, answer = await post(url + "/v1/completions", {**COMPLETION, "logprobs": 1})
    assert status == 200 and answer["choices"][0]["text"] == "ABCD"
    assert "first_token_from_prefill" not in d.bodies[0]["kv_transfer_params"]


@pytest.mark.parametrize(
    ("stop", "first_text", "spans"),
    [
        (None, "ab", False),
        ("bc", "ab", True),  # "b" ends the first token, "c" may follow from D
        (["zz", "b\n\n"], "ab", True),
        (["\n\n"], "a\n", True),
        (["ab"], "ab", False),  # within the first token: P stops on it itself
        (["xa"], "ab", False),
        (["abc"], "b", False),  # would start before the first token: in the prompt
        ([""], "ab", False),
        ("b" * 10_000, "a" * 50 + "b", True),
    ],
)
def test_stop_may_span_seam(stop, first_text, spans):
    assert stitch.stop_may_span_seam({"stop": stop}, first_text) is spans


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_that_may_span_the_seam_takes_the_plain_flow(stack, stream):
    """P's token "A" may begin the stop string "AB": D's request with P's token is cancelled
    and the request served in the plain concurrent flow (the stub D does not stop on strings:
    its plain answer comes back whole)."""
    url, p, d = stack
    body = {**COMPLETION, "stop": ["AB"], "stream": stream}
    if stream:
        got = await events(url + "/v1/completions", body)
        text = "".join(e["choices"][0]["text"] for e in got if isinstance(e, dict) and e["choices"])
    else:
        status, answer = await post(url + "/v1/completions", body)
        assert status == 200, answer
        text = answer["choices"][0]["text"]
    assert text == "ABCD"
    first, plain = d.bodies
    assert first["kv_transfer_params"]["first_token_from_prefill"] is True
    assert "first_token_from_prefill" not in plain["kv_transfer_params"]
    assert plain["kv_transfer_params"]["transfer_id"] != first["kv_transfer_params"]["transfer_id"]
    assert len(p.bodies) == 2
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        metrics = await r.text()
    assert 'splitserve_proxy_first_token_fallbacks_total{reason="stop_string_at_seam"} 1.0' in (
        metrics
    )


@pytest.mark.parametrize("stub_settings", [{"p_text": ""}])
async def test_a_first_token_without_text_takes_the_plain_flow(stack):
    """P's token rendered no text (the first bytes of a split character): D's detokenizer would
    not see them, so the request goes the plain way."""
    url, _, d = stack
    status, answer = await post(url + "/v1/completions", COMPLETION)
    assert status == 200 and answer["choices"][0]["text"] == "ABCD"
    first, plain = d.bodies
    assert first["kv_transfer_params"]["first_token_from_prefill"] is True
    assert "first_token_from_prefill" not in plain["kv_transfer_params"]
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        metrics = await r.text()
    assert 'fallbacks_total{reason="empty_first_token_text"} 1.0' in metrics


async def test_a_stop_string_that_cannot_span_the_seam_keeps_the_first_token_flow(stack):
    url, p, d = stack
    status, answer = await post(url + "/v1/completions", {**COMPLETION, "stop": ["XA", "BA"]})
    assert status == 200 and answer["choices"][0]["text"] == "ABCD"
    (only,) = d.bodies
    assert only["kv_transfer_params"]["first_token_from_prefill"] is True


@pytest.mark.parametrize("stub_settings", [{"p_hangs": True, "d_drops": True}])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_that_drops_the_request_ends_the_wait_for_prefill(stack, stream):
    """D's request is written before P's and read by no task: D dropping it while P computes
    must still end the wait at once (P would never answer here), with an error, and close P's
    request (P aborts it)."""
    url, p, d = stack
    body = {**COMPLETION, "stream": stream}
    status, answer = await asyncio.wait_for(post(url + "/v1/completions", body), 30)
    assert status == 502, answer
    assert "decode" in answer["error"]["message"]
    (d_body,) = d.bodies
    assert d_body["kv_transfer_params"]["first_token_from_prefill"] is True
    for _ in range(300):  # P's request is closed by the proxy: bounded wait for its handler
        if p.cancelled:
            break
        await asyncio.sleep(0.05)
    assert p.cancelled == 1
