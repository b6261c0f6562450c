"""The proxy's HTTP/1.1 server (``splitserve.proxy.http.server``) over real sockets on loopback.

Clients here write raw HTTP bytes (asyncio streams), so each test controls exactly what the
server sees: pipelining, HTTP/1.0, ``Expect: 100-continue``, chunked bodies, oversized heads and
bodies, garbage, a client that leaves mid-answer, a slow reader. The handlers are small
functions of this file; the proxy's own routes are tested in test_proxy_server.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httptools
import pytest

from splitserve.proxy.http.edge import EdgeLimits
from splitserve.proxy.http.messages import Request, Response, StreamResponse
from splitserve.proxy.http.server import HTTPServer


class Recorder:
    """Handlers of the test server, with what they saw."""

    def __init__(self) -> None:
        self.seen: list[Request] = []
        self.cancelled = 0
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def echo(self, request: Request) -> Response:
        self.seen.append(request)
        data = {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "body": request.body.decode(),
            "auth": request.header("authorization"),
            "multi": request.header("X-Multi"),
        }
        return Response(json.dumps(data).encode())

    async def slow(self, request: Request) -> Response:
        self.seen.append(request)
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Response(b'{"slow": true}')

    async def stream(self, request: Request) -> StreamResponse:
        n = int(request.query.partition("=")[2] or 3)
        out = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for i in range(n):
                await out.write(b"data: %d\n\n" % i)
                await out.write(b"")  # nothing: must not end the chunked body
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await out.write_eof()
        return out

    async def big(self, request: Request) -> StreamResponse:
        """Writes 64 MiB in 1 MiB pieces; counts how far it got."""
        out = StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await out.prepare(request)
        self.started.set()
        piece = b"x" * (1 << 20)
        try:
            for _ in range(64):
                await out.write(piece)
                self.seen.append(request)
        except (asyncio.CancelledError, ConnectionError):
            self.cancelled += 1
            raise
        await out.write_eof()
        return out

    async def crash(self, request: Request) -> Response:
        raise RuntimeError("handler bug")


def error_response(status: int, message: str) -> Response:
    return Response(json.dumps({"error": {"message": message, "code": status}}).encode(), status)


@pytest.fixture
async def served() -> AsyncIterator[tuple[HTTPServer, Recorder, int]]:
    rec = Recorder()
    server = HTTPServer(
        {
            ("POST", "/echo"): rec.echo,
            ("GET", "/echo"): rec.echo,
            ("GET", "/slow"): rec.slow,
            ("GET", "/stream"): rec.stream,
            ("GET", "/big"): rec.big,
            ("GET", "/crash"): rec.crash,
        },
        error_response,
        max_body_bytes=4096,
        limits=EdgeLimits(
            max_body_bytes=4096,
            max_header_bytes=8192,
            header_timeout_s=0.5,
            body_timeout_s=0.5,
            idle_timeout_s=0.5,
        ),
        shutdown_timeout_s=2.0,
    )
    port = await server.start("127.0.0.1", 0)
    yield server, rec, port
    await server.close()


class Answer:
    """One parsed HTTP answer."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()  # appended in place: bytes += would copy the whole body each time
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answers(
    reader: asyncio.StreamReader, count: int, timeout: float = 10.0
) -> list[Answer]:
    """``count`` answers from one connection, in order (the connection may stay open)."""
    answers: list[Answer] = []

    class Sink:
        def on_message_begin(self) -> None:
            answers.append(Answer())

        def on_header(self, name: bytes, value: bytes) -> None:
            answers[-1].on_header(name, value)

        def on_body(self, body: bytes) -> None:
            answers[-1].on_body(body)

        def on_message_complete(self) -> None:
            answers[-1].on_message_complete()

    parser = httptools.HttpResponseParser(Sink())

    async def run() -> None:
        while not (len(answers) >= count and answers[count - 1].complete):
            data = await reader.read(65536)
            if not data:
                parser.feed_data(b"")  # close-delimited bodies end here
                return
            parser.feed_data(data)
            if answers:
                answers[-1].status = parser.get_status_code()

    await asyncio.wait_for(run(), timeout)
    return answers


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), timeout) == b""
    except ConnectionError:
        return True


async def wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b\r\n%b" % (
        path.encode(),
        len(body),
        extra,
        body,
    )


async def test_keep_alive_serves_many_requests_on_one_connection(served) -> None:
    _, rec, port = served
    reader, writer = await connect(port)
    for i in range(3):
        writer.write(post(f"/echo?n={i}", f"hello {i}".encode()))
        (answer,) = await read_answers(reader, 1)
        assert answer.status == 200
        assert answer.json()["body"] == f"hello {i}"
        assert answer.json()["query"] == f"n={i}"
        assert "date" in answer.headers and answer.headers["content-type"] == "application/json"
    assert len(rec.seen) == 3
    writer.close()


async def test_pipelined_requests_are_answered_in_order(served) -> None:
    _, rec, port = served
    reader, writer = await connect(port)
    writer.write(b"".join(post("/echo", b"body-%d" % i) for i in range(20)))
    answers = await read_answers(reader, 20)
    assert [a.json()["body"] for a in answers] == [f"body-{i}" for i in range(20)]
    writer.close()


async def test_headers_are_case_insensitive_and_repeats_joined(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(post("/echo", b"", b"AUTHORIZATION: Bearer k\r\nx-multi: a\r\nX-Multi: b\r\n"))
    (answer,) = await read_answers(reader, 1)
    assert answer.json()["auth"] == "Bearer k"
    assert answer.json()["multi"] == "a, b"
    writer.close()


async def test_chunked_request_body(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    (answer,) = await read_answers(reader, 1)
    assert answer.json()["body"] == "hello world"
    writer.close()


async def test_http10_closes_after_the_answer_unless_keep_alive(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 200 and answer.headers["connection"] == "close"
    assert await closed_by_server(reader)

    reader, writer = await connect(port)
    writer.write(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 2)
    answers = await read_answers(reader, 2)
    assert [a.headers["connection"] for a in answers] == ["keep-alive", "keep-alive"]
    writer.close()


async def test_http10_stream_is_close_delimited(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /stream?n=2 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)  # until the server closes
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert body == b"data: 0\n\ndata: 1\n\n"


async def test_streamed_answer_is_chunked_and_complete(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /stream?n=4 HTTP/1.1\r\nHost: x\r\n\r\n")
    (answer,) = await read_answers(reader, 1)
    assert answer.headers["transfer-encoding"] == "chunked"
    assert answer.body == b"".join(b"data: %d\n\n" % i for i in range(4))
    writer.write(post("/echo", b"after"))  # the connection is still good
    (answer,) = await read_answers(reader, 1)
    assert answer.json()["body"] == "after"
    writer.close()


async def test_expect_100_continue(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    (answer,) = await read_answers(reader, 1)
    assert answer.json()["body"] == "hello"
    writer.close()


async def test_expect_100_continue_refused_when_too_large(served) -> None:
    _, rec, port = served
    reader, writer = await connect(port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\nExpect: 100-continue\r\n\r\n"
    )
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 413 and "limit of 4096 bytes" in answer.json()["error"]["message"]
    assert await closed_by_server(reader)
    assert rec.seen == []


@pytest.mark.parametrize(
    "raw, status, fragment",
    [
        (post("/echo", b"x" * 5000), 413, "5000 bytes exceeds the limit of 4096 bytes"),
        (
            b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"400\r\n" + b"y" * 1024 + b"\r\n" for _ in range(6)),  # 6 KiB
            413,
            "exceeds the limit of 4096 bytes",
        ),
        (b"GET /echo HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431, "too large"),
        (b"BLAH\x00 / HTTP/1.1\r\n\r\n", 400, "invalid HTTP request"),
        (b"GET /nothing HTTP/1.1\r\n\r\n", 404, "/nothing"),
        (b"DELETE /echo HTTP/1.1\r\n\r\n", 405, "DELETE"),
        (b"GET /crash HTTP/1.1\r\n\r\n", 500, "internal server error"),
    ],
)
async def test_refusals_answer_with_the_error_body(served, raw: bytes, status: int, fragment: str):
    _, rec, port = served
    reader, writer = await connect(port)
    # In pieces: a head or body split over reads must be bounded just the same.
    for i in range(0, len(raw), 3000):
        writer.write(raw[i : i + 3000])
        await writer.drain()
        await asyncio.sleep(0)
    (answer,) = await read_answers(reader, 1)
    assert answer.status == status
    assert fragment in answer.json()["error"]["message"]
    if status == 405:
        assert answer.headers["allow"] == "GET, POST"
    if status in (400, 413, 431):
        assert await closed_by_server(reader)
    writer.close()


async def test_head_runs_the_get_route_without_a_body(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: " in head
    (answer,) = await read_answers(reader, 1)  # the next answer follows with no body between
    assert answer.json()["method"] == "GET"
    writer.close()


async def test_client_leaving_cancels_its_handler(served) -> None:
    server, rec, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(rec.started.wait(), 5)
    writer.close()
    await wait_for(lambda: rec.cancelled == 1)
    await wait_for(lambda: not server.connections)


async def test_slow_reader_gets_backpressure_not_buffering(served) -> None:
    server, rec, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(rec.started.wait(), 5)
    await asyncio.sleep(0.3)  # the client reads nothing meanwhile
    written = len(rec.seen)
    assert written < 32, f"{written} MiB written to a client that read nothing"
    (answer,) = await read_answers(reader, 1, timeout=60)  # now read it all
    assert len(answer.body) == 64 << 20
    writer.close()


async def test_idle_connection_is_closed_after_the_keepalive_timeout(served) -> None:
    server, _, port = served
    reader, writer = await connect(port)
    writer.write(post("/echo", b"x"))
    await read_answers(reader, 1)
    assert await closed_by_server(reader, timeout=5)  # idle_timeout_s=0.5
    reader, writer = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")  # never finished
    (answer,) = await read_answers(reader, 1)  # the body's deadline (body_timeout_s=0.5)
    assert answer.status == 408
    assert await closed_by_server(reader, timeout=5)
    await wait_for(lambda: not server.connections)


async def test_upgrade_request_is_served_then_closed(served) -> None:
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n")
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 200 and answer.headers["connection"] == "close"
    assert await closed_by_server(reader)


async def test_close_lets_answers_under_way_finish(served) -> None:
    server, rec, port = served
    reader, writer = await connect(port)
    idle_reader, _ = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(rec.started.wait(), 5)
    closing = asyncio.ensure_future(server.close())
    assert await closed_by_server(idle_reader)  # idle connections go at once
    rec.release.set()
    (answer,) = await read_answers(reader, 1)
    assert answer.json() == {"slow": True} and answer.headers["connection"] == "close"
    await asyncio.wait_for(closing, 5)
    with pytest.raises(OSError):
        await connect(port)
