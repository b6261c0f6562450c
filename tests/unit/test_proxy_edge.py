"""The proxy's client edge (``splitserve.proxy.http.edge`` applied by ``http/server.py``) over real
sockets on loopback: per-phase client timeouts, header bytes of pipelined requests, the
connection cap, and request-smuggling framings.

Clients write raw bytes, so each test controls exactly what the server sees. Timing checks are
only "cut off within a bound", with bounds far above the configured timeouts (the machine is
shared and loaded). The proxy-level limits (``max_in_flight``, keys on ``/ready`` and
``/metrics``) are in test_proxy_server.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httptools
import pytest
from test_proxy_http_server import Answer, closed_by_server, connect, error_response, wait_for

from splitserve.proxy.http.edge import EdgeLimits, framing_problem
from splitserve.proxy.http.messages import Request, Response
from splitserve.proxy.http.server import HTTPServer

BOUND_S = 10.0  # a cut-off must happen within this (the timeouts below are a fraction of it)


class Edge:
    """A test server, the reasons it refused clients for, and a handler that can be held."""

    def __init__(self, limits: EdgeLimits) -> None:
        self.rejected: list[str] = []
        self.release = asyncio.Event()
        self.server = HTTPServer(
            {
                ("GET", "/echo"): self.echo,
                ("POST", "/echo"): self.echo,
                ("GET", "/hold"): self.hold,
            },
            error_response,
            max_body_bytes=limits.max_body_bytes,
            limits=limits,
            on_reject=self.rejected.append,
        )
        self.port = 0

    async def echo(self, request: Request) -> Response:
        data = {"path": request.path, "body": request.body.decode(), "x": request.header("x")}
        return Response(json.dumps(data).encode())

    async def hold(self, request: Request) -> Response:
        await self.release.wait()
        return Response(b'{"held": true}')


def limits(**kw: float) -> EdgeLimits:
    base = {
        "max_body_bytes": 4096,
        "max_header_bytes": 8192,
        "header_timeout_s": 0.6,
        "body_timeout_s": 0.6,
        "idle_timeout_s": 0.6,
        "max_connections": 100,
    }
    return EdgeLimits(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture
async def edge(request: pytest.FixtureRequest) -> AsyncIterator[Edge]:
    e = Edge(getattr(request, "param", None) or limits())
    e.port = await e.server.start("127.0.0.1", 0)
    yield e
    e.release.set()
    await e.server.close()


def get(path: str = "/echo", extra: bytes = b"") -> bytes:
    return b"GET %b HTTP/1.1\r\nHost: x\r\n%b\r\n" % (path.encode(), extra)


def post(body: bytes, extra: bytes = b"") -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b\r\n%b" % (
        len(body),
        extra,
        body,
    )


async def read_answers(
    reader: asyncio.StreamReader, count: int, timeout: float = 10.0
) -> list[Answer]:
    """``count`` answers from one connection, each with its own status (pipelined answers may
    arrive in one read); fewer if the server closes first."""
    answers: list[Answer] = []
    parser: httptools.HttpResponseParser

    class Sink:
        def on_message_begin(self) -> None:
            answers.append(Answer())

        def on_header(self, name: bytes, value: bytes) -> None:
            answers[-1].on_header(name, value)

        def on_headers_complete(self) -> None:
            answers[-1].status = parser.get_status_code()

        def on_body(self, body: bytes) -> None:
            answers[-1].on_body(body)

        def on_message_complete(self) -> None:
            answers[-1].on_message_complete()

    parser = httptools.HttpResponseParser(Sink())

    async def run() -> None:
        while not (len(answers) >= count and answers[count - 1].complete):
            try:
                data = await reader.read(65536)
            except ConnectionError:
                return
            if not data:
                return
            parser.feed_data(data)

    await asyncio.wait_for(run(), timeout)
    return answers


async def elapsed(coro) -> float:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await coro
    return loop.time() - t0


# ---------------------------------------------------------------------- timeouts, per phase


async def test_a_slow_head_is_cut_off_with_408(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    (answer,) = await read_answers(reader, 1, timeout=BOUND_S)
    assert answer.status == 408 and "headers" in answer.json()["error"]["message"]
    assert await closed_by_server(reader, timeout=BOUND_S)
    assert edge.rejected == ["header_timeout"]


async def test_a_head_dripping_bytes_is_cut_off_all_the_same(edge: Edge) -> None:
    """Each byte arriving in time is not enough: the deadline is for the whole head."""
    reader, writer = await connect(edge.port)

    async def drip() -> None:
        for byte in b"GET /echo HTTP/1.1\r\nX: " + b"a" * 1000:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)

    dripping = asyncio.ensure_future(drip())
    try:
        (answer,) = await read_answers(reader, 1, timeout=BOUND_S)
    finally:
        dripping.cancel()
    assert answer.status == 408
    assert edge.rejected == ["header_timeout"]


async def test_a_connection_that_sends_nothing_is_closed_unanswered(edge: Edge) -> None:
    """Closed within header_timeout_s, without a 408 that a pooled client could take for the
    answer to a request it sends just then."""
    reader, writer = await connect(edge.port)
    assert await asyncio.wait_for(reader.read(), BOUND_S) == b""
    await wait_for(lambda: not edge.server.connections)


async def test_a_slow_body_is_cut_off_with_408(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    (answer,) = await read_answers(reader, 1, timeout=BOUND_S)
    assert answer.status == 408 and "body" in answer.json()["error"]["message"]
    assert await closed_by_server(reader, timeout=BOUND_S)
    assert edge.rejected == ["body_timeout"]


async def test_an_idle_keep_alive_connection_is_closed_without_an_answer(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(get())
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 200
    took = await elapsed(closed_by_server(reader, timeout=BOUND_S))
    assert took < BOUND_S
    assert edge.rejected == []  # an idle client is not a slow one


async def test_timers_restart_with_every_request(edge: Edge) -> None:
    """Many requests on one connection, spread over several times every timeout: a timer per
    connection would cut it off; per-phase deadlines never do."""
    reader, writer = await connect(edge.port)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    served = 0
    while loop.time() - t0 < 2.0:  # more than three times each 0.6 s timeout
        writer.write(b"GET /echo HTTP/1.1\r\n")
        await asyncio.sleep(0.1)
        writer.write(b"Host: x\r\n\r\n")
        (answer,) = await read_answers(reader, 1)
        assert answer.status == 200
        served += 1
        await asyncio.sleep(0.2)
    assert served >= 3 and edge.rejected == []


async def test_a_long_handler_is_not_the_clients_fault(edge: Edge) -> None:
    """No client deadline runs while its request is being answered."""
    reader, writer = await connect(edge.port)
    writer.write(get("/hold"))
    await asyncio.sleep(1.5)  # longer than every client timeout
    edge.release.set()
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 200 and answer.json() == {"held": True}


async def test_a_slow_client_delays_nobody_else(edge: Edge) -> None:
    slow_reader, slow_writer = await connect(edge.port)
    slow_writer.write(b"GET /echo HTTP/1.1\r\n")  # and nothing more
    reader, writer = await connect(edge.port)
    for _ in range(5):
        writer.write(get())
        (answer,) = await asyncio.wait_for(read_answers(reader, 1), 2.0)
        assert answer.status == 200
    (cut,) = await read_answers(slow_reader, 1, timeout=BOUND_S)
    assert cut.status == 408


async def test_a_slow_pipelined_head_is_refused_after_the_answers_before_it(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(get("/hold") + b"GET /echo HTTP/1.1\r\nHost: x\r\n")  # the second never ends
    await asyncio.sleep(1.2)  # past the second head's deadline, the first still being answered
    edge.release.set()
    first, second = await read_answers(reader, 2, timeout=BOUND_S)
    assert first.status == 200 and first.json() == {"held": True}
    assert second.status == 408
    assert await closed_by_server(reader, timeout=BOUND_S)


# ---------------------------------------------------------------------- header bytes


async def test_header_limit_counts_a_pipelined_head_from_its_first_byte(edge: Edge) -> None:
    """The second request's head begins in the read that ends the first request and never
    completes: every byte of it counts, from the first."""
    reader, writer = await connect(edge.port)
    writer.write(get() + b"GET /echo HTTP/1.1\r\nX: " + b"a" * 9000)  # one write, > 8192
    first, second = await read_answers(reader, 2, timeout=BOUND_S)
    assert first.status == 200
    assert second.status == 431
    assert await closed_by_server(reader, timeout=BOUND_S)
    assert edge.rejected == ["header_too_large"]


async def test_header_limit_over_a_pipelined_head_in_pieces(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(post(b"x" * 1000) + b"GET /echo HTTP/1.1\r\nX: " + b"a" * 6000)
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(b"a" * 3000)  # 9000+ bytes of the second head in all
    first, second = await read_answers(reader, 2, timeout=BOUND_S)
    assert first.status == 200 and second.status == 431


async def test_heads_under_the_limit_pipelined_in_one_read_are_served(edge: Edge) -> None:
    """The bytes of earlier requests in the same read are not charged to the next head."""
    reader, writer = await connect(edge.port)
    head = get(extra=b"X: " + b"a" * 7000 + b"\r\n")  # each under 8192, together far over
    writer.write(head * 5)
    answers = await read_answers(reader, 5, timeout=BOUND_S)
    assert [a.status for a in answers] == [200] * 5
    assert edge.rejected == []


async def test_a_complete_head_over_the_limit_is_431(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(get() + get(extra=b"X: " + b"a" * 9000 + b"\r\n"))
    first, second = await read_answers(reader, 2, timeout=BOUND_S)
    assert first.status == 200 and second.status == 431


# ---------------------------------------------------------------------- connections


@pytest.mark.parametrize("edge", [limits(max_connections=2, idle_timeout_s=30)], indirect=True)
async def test_connections_past_the_cap_get_503_with_retry_after(edge: Edge) -> None:
    kept = [await connect(edge.port) for _ in range(2)]
    for r, w in kept:  # both are being served
        w.write(get())
        (a,) = await read_answers(r, 1)
        assert a.status == 200
    reader, writer = await connect(edge.port)
    writer.write(get())
    (answer,) = await read_answers(reader, 1, timeout=BOUND_S)
    assert answer.status == 503 and answer.headers["retry-after"] == "1"
    assert answer.headers["connection"] == "close"
    assert await closed_by_server(reader, timeout=BOUND_S)
    assert edge.rejected == ["max_connections"]
    kept[0][1].close()  # a place frees up
    await wait_for(lambda: len(edge.server.connections) < 2)
    reader, writer = await connect(edge.port)
    writer.write(get())
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 200


# ---------------------------------------------------------------------- request smuggling


SMUGGLING = {
    "content-length and transfer-encoding": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding and content-length": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 5\r\n\r\n0\r\n\r\n"
    ),
    "two equal content-lengths": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc"
    ),
    "two different content-lengths": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabcde"
    ),
    "a content-length list": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n\r\nabc",
    "transfer-encoding gzip, chunked": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding chunked twice": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "transfer-encoding identity": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n"
    ),
    "transfer-encoding xchunked": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n"
    ),
    "negative content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "signed content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc",
    "hex content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0x3\r\n\r\nabc",
    "empty content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: \r\n\r\n",
    "huge content-length": (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n"
    ),
}


@pytest.mark.parametrize("raw", list(SMUGGLING.values()), ids=list(SMUGGLING))
async def test_ambiguous_framing_is_400_and_closes(edge: Edge, raw: bytes) -> None:
    reader, writer = await connect(edge.port)
    # A smuggled second request behind it must never be served.
    writer.write(raw + get("/echo", b"X: smuggled\r\n"))
    answers = await read_answers(reader, 1, timeout=BOUND_S)
    assert answers[0].status == 400, answers[0].body
    assert await closed_by_server(reader, timeout=BOUND_S)
    assert len(answers) == 1 or all(b"smuggled" not in a.body for a in answers)


async def test_ambiguous_framing_after_a_good_request_answers_that_one_first(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(post(b"ok") + SMUGGLING["two equal content-lengths"])
    first, second = await read_answers(reader, 2, timeout=BOUND_S)
    assert first.status == 200 and first.json()["body"] == "ok"
    assert second.status == 400
    assert await closed_by_server(reader, timeout=BOUND_S)


@pytest.mark.parametrize(
    "headers, repeats, version, problem",
    [
        ({b"content-length": b"3"}, 1, "1.1", None),
        ({b"transfer-encoding": b"chunked"}, 0, "1.1", None),
        ({b"transfer-encoding": b"Chunked"}, 0, "1.1", None),  # tokens are case-insensitive
        ({b"transfer-encoding": b"chunked"}, 0, "1.0", "HTTP/1.0"),
        ({b"content-length": b"3, 3"}, 2, "1.1", "more than one"),
        ({b"content-length": b"3", b"transfer-encoding": b"chunked"}, 1, "1.1", "both"),
        ({b"transfer-encoding": b"chunked, chunked"}, 0, "1.1", "other than chunked"),
        ({b"content-length": b"1e3"}, 1, "1.1", "invalid Content-Length"),
    ],
)
def test_framing_problem(headers, repeats, version, problem) -> None:  # type: ignore[no-untyped-def]
    found = framing_problem(headers, repeats, version)
    assert found is None if problem is None else problem in (found or "")


async def test_a_sound_chunked_request_is_still_served(edge: Edge) -> None:
    reader, writer = await connect(edge.port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    (answer,) = await read_answers(reader, 1)
    assert answer.status == 200 and answer.json()["body"] == "abcde"
