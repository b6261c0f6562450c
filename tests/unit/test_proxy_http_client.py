"""The proxy's HTTP/1.1 client (``splitserve.proxy.http.client``) against real sockets on loopback.

The servers here are scripted asyncio servers that write raw HTTP bytes, so each test controls
exactly what the client sees (keep-alive, chunking, a close mid-body, a stale idle connection,
garbage); they are stand-ins for the engines' HTTP servers, used only to unit-test the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trustme

from splitserve.proxy.http import connection as upstream_connection
from splitserve.proxy.http.client import UpstreamClient, UpstreamConnectError, UpstreamDisconnected

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (Content-Length framed, as the client sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


class Scripted:
    """A loopback server running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(r, w)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            w.close()

    @property
    def origin(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def scripted(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[Scripted]:
    s = Scripted(handler)
    s.server = await asyncio.start_server(s._serve, "127.0.0.1", 0, ssl=tls)
    try:
        yield s
    finally:
        s.server.close()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout_s=2.0, headers={"Authorization": "Bearer k"})
    yield c
    c.close()


async def keep_alive_echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        head, body = await read_request(r)
        w.write(ok(head + body))
        await w.drain()


async def test_keep_alive_reuses_one_connection_and_sends_the_request(client) -> None:
    async with scripted(keep_alive_echo) as s:
        for i in range(3):
            resp = await client.post(s.origin, "/v1/completions", b'{"i": %d}' % i)
            assert resp.status == 200
            echoed = await resp.read()
            resp.release()
            assert echoed.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"\r\nContent-Type: application/json\r\n" in echoed
            assert b"\r\nAuthorization: Bearer k\r\n" in echoed
            assert b"\r\nHost: 127.0.0.1:" in echoed
            assert echoed.endswith(b'{"i": %d}' % i)
        assert s.connections == 1


async def test_one_connection_carries_answers_of_either_framing_in_turn(client) -> None:
    """The connection's parser goes on from answer to answer: chunked, then Content-Length,
    then chunked again, each read whole on the same connection."""

    async def alternate(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n = 0
        while True:
            await read_request(r)
            n += 1
            if n % 2:
                w.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-N: %d\r\n\r\n"
                    b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n" % n
                )
            else:
                w.write(ok(b"fixed %d" % n, b"X-N: %d\r\n" % n))
            await w.drain()

    async with scripted(alternate) as s:
        for i in range(1, 5):
            resp = await client.post(s.origin, "/v1/completions", b"{}")
            assert resp.status == 200 and resp.header("x-n") == str(i)
            assert not resp.close_delimited
            assert await resp.read() == (b"abcde" if i % 2 else b"fixed %d" % i)
            resp.release()
        assert s.connections == 1


async def test_chunked_stream_arrives_piece_by_piece(client) -> None:
    go = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await go.wait()
        w.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await w.drain()
        await r.read()  # keep the connection open

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.readany() == b"first"  # before the server sent the rest
        go.set()
        assert await resp.read() == b"second"
        assert await resp.readany() == b""
        resp.release()
        assert len(client._pools[s.origin].idle) == 1  # complete and keep-alive: pooled


class ThreadedServer:
    """A stand-in engine server on its own thread (blocking sockets), so that it can close a
    connection while the test's event loop is blocked and has not seen the close yet. Answers
    each request of a connection with ``ok(b"a")`` and closes the connection after
    ``per_connection`` answers; counts connections and requests read whole."""

    def __init__(self, per_connection: int) -> None:
        self.per_connection = per_connection
        self.connections = 0
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn, conn.makefile("rb") as f:
                for _ in range(self.per_connection):
                    length = 0
                    while (line := f.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":", 1)[1])
                    f.read(length)
                    self.requests += 1
                    conn.sendall(ok(b"a"))

    def close(self) -> None:
        self.sock.close()


async def test_stale_idle_connection_is_detected_before_writing(client) -> None:
    server = ThreadedServer(per_connection=1)  # answers, then closes the idle connection
    try:
        resp = await client.post(server.origin, "/x", b"{}")
        assert await resp.read() == b"a"
        resp.release()
        assert len(client._pools[server.origin].idle) == 1
        time.sleep(0.3)  # the server closes meanwhile; the loop (blocked) has not seen it
        conn = client._pools[server.origin].idle[0]
        assert not conn.lost, "the loop must not have seen the close yet for this test"
        resp = await client.post(server.origin, "/x", b"{}")
        assert await resp.read() == b"a"
        resp.release()
        assert server.connections == 2
        assert server.requests == 2, "each request written once"
    finally:
        server.close()


async def test_a_connection_idle_too_long_is_not_reused(client, monkeypatch) -> None:
    monkeypatch.setattr(upstream_connection, "_MAX_IDLE_S", 0.0)
    async with scripted(keep_alive_echo) as s:
        for _ in range(2):
            resp = await client.post(s.origin, "/x", b"{}")
            await resp.read()
            resp.release()
            await asyncio.sleep(0.01)
        assert s.connections == 2


async def test_a_request_written_is_never_sent_again(client) -> None:
    """The server reads the whole second request and drops the connection without a byte of
    answer (it may have started the generation): the caller gets the error, the request is not
    sent again on a new connection."""
    requests = 0

    async def answer_then_drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(r)
        requests += 1
        w.write(ok(b"a"))
        await w.drain()
        await read_request(r)  # the whole request, read
        requests += 1
        w.transport.abort()

    async with scripted(answer_then_drop) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.read() == b"a"
        resp.release()
        with pytest.raises(UpstreamDisconnected) as caught:
            await client.post(s.origin, "/x", b'{"prompt": "once"}')
        assert not caught.value.answered
        await asyncio.sleep(0.05)
        assert requests == 2
        assert s.connections == 1, "no second connection: the request was not re-sent"


async def test_connection_refused_is_a_connect_error(client) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(UpstreamConnectError) as e:
            await client.post(f"http://127.0.0.1:{port}", "/x", b"{}")
    assert not e.value.timed_out


async def test_connect_timeout_is_a_timed_out_connect_error() -> None:
    # A listener whose accept queue is full drops further SYNs: the connect hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            f = socket.socket()
            f.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                f.connect(("127.0.0.1", port))
            fillers.append(f)
        await asyncio.sleep(0.2)
        c = UpstreamClient(connect_timeout_s=0.3)
        with pytest.raises(UpstreamConnectError) as e:
            await c.post(f"http://127.0.0.1:{port}", "/x", b"{}")
        assert e.value.timed_out
    finally:
        for f in fillers:
            f.close()
        listener.close()


async def test_close_mid_body_is_disconnected_and_not_pooled(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await w.drain()

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.readany() == b"partial"
        with pytest.raises(UpstreamDisconnected):
            await resp.readany()
        resp.release()
        assert not client._pools[s.origin].idle


async def test_close_delimited_body_reads_to_eof_and_is_not_pooled(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.read() == b"until the end"
        resp.release()
        assert not client._pools[s.origin].idle


async def test_connection_close_header_is_honoured(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(ok(b"x", b"Connection: close\r\n"))
        await w.drain()
        await r.read()

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.read() == b"x"
        assert resp.header("connection") == "close"
        resp.release()
        assert not client._pools[s.origin].idle


async def test_garbage_answer_is_disconnected(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()
        await r.read()

    async with scripted(handler) as s:
        with pytest.raises(UpstreamDisconnected):
            await client.post(s.origin, "/x", b"{}")


async def test_cancelled_reader_closes_the_connection(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await w.drain()
        await r.read()  # returns when the client closes

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.readany() == b"a"
        task = asyncio.ensure_future(resp.readany())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp.close()
        await asyncio.wait_for(s.closed.wait(), 5)  # the server saw the request end


async def test_cancel_while_waiting_for_headers_closes_the_connection(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # never answers; returns when the client closes

    async with scripted(handler) as s:
        task = asyncio.ensure_future(client.post(s.origin, "/x", b"{}"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(s.closed.wait(), 5)
        assert not client._pools[s.origin].idle


async def test_release_before_the_end_closes_instead_of_pooling(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
        await w.drain()
        await r.read()

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert await resp.readany() == b"12345"
        resp.release()
        assert not client._pools[s.origin].idle
        await asyncio.wait_for(s.closed.wait(), 5)


async def test_slow_reader_gets_every_byte_of_a_large_body(client) -> None:
    size = 4 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(ok(payload))
        await w.drain()
        await r.read()

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        got = bytearray()
        while chunk := await resp.readany():
            got += chunk
            await asyncio.sleep(0.001)  # a slow consumer: the connection pauses and resumes
        resp.release()
        assert bytes(got) == payload
        assert len(client._pools[s.origin].idle) == 1


async def test_error_status_and_body_are_returned(client) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            body = b'{"error": "bad"}'
            w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await w.drain()

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        assert resp.status == 400
        assert await resp.read() == b'{"error": "bad"}'
        resp.release()
        assert len(client._pools[s.origin].idle) == 1


async def test_connection_pooled_after_a_big_unread_body_still_reads(client, monkeypatch) -> None:
    # The whole body arrives in one read that also crosses the high-water mark: reading pauses
    # on a complete answer. Released unread, the connection must not go back paused.
    monkeypatch.setattr(upstream_connection, "_HIGH_WATER", 1000)
    big = b"x" * 4000

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(ok(big))
        await w.drain()
        await read_request(r)
        w.write(ok(b"second"))
        await w.drain()
        await r.read()

    async with scripted(handler) as s:
        resp = await client.post(s.origin, "/x", b"{}")
        for _ in range(500):
            if resp.complete:
                break
            await asyncio.sleep(0.01)
        assert resp.complete and resp.paused
        resp.release()  # complete, never read: pooled
        resp = await asyncio.wait_for(client.post(s.origin, "/x", b"{}"), 5)
        assert await asyncio.wait_for(resp.read(), 5) == b"second"
        resp.release()
        assert s.connections == 1


@pytest.fixture
def tls_server_context() -> tuple[trustme.CA, ssl.SSLContext]:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return ca, context


async def test_https_server_with_a_trusted_certificate(tls_server_context, tmp_path, monkeypatch):
    ca, context = tls_server_context
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))  # how a user adds a private CA
    c = UpstreamClient(connect_timeout_s=5.0)
    try:
        async with scripted(keep_alive_echo, tls=context) as s:
            origin = s.origin.replace("http://", "https://")
            for _ in range(2):
                resp = await c.post(origin, "/v1/completions", b"{}")
                assert resp.status == 200
                assert (await resp.read()).startswith(b"POST /v1/completions HTTP/1.1\r\n")
                resp.release()
            assert s.connections == 1
    finally:
        c.close()


async def test_https_server_with_an_untrusted_certificate_is_a_connect_error(
    tls_server_context,
) -> None:
    _, context = tls_server_context
    c = UpstreamClient(connect_timeout_s=5.0)
    try:
        async with scripted(keep_alive_echo, tls=context) as s:
            with pytest.raises(UpstreamConnectError, match="certificate"):
                await c.post(s.origin.replace("http://", "https://"), "/x", b"{}")
    finally:
        c.close()


async def test_a_wait_past_its_deadline_times_out_and_the_connection_is_closed(client) -> None:
    """The client's sweeping timer ends a wait whose ``until`` passed: before the head (post)
    and between body bytes (a deadline moved by the caller, as a stream's idle timeout)."""
    server_done = asyncio.Event()

    async def head_then_stall(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        if s.connections == 2:  # the second request: a head and a first piece, then nothing
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
            await w.drain()
        await server_done.wait()

    async def bounded(aw: Awaitable[object]) -> object:
        task = asyncio.ensure_future(aw)
        done, _ = await asyncio.wait({task}, timeout=30)
        assert done, "the deadline never ended the wait"
        return task.result()

    async with scripted(head_then_stall) as s:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await bounded(client.post(s.origin, "/x", b"{}", loop.time() + 0.2))
        resp = await client.post(s.origin, "/x", b"{}", loop.time() + 30)
        assert await resp.readany() == b"a"
        resp.until = loop.time() + 0.2
        with pytest.raises(TimeoutError):
            await bounded(resp.readany())
        resp.close()
        assert not client._sweeper.waits, "no wait left registered"
        server_done.set()
    assert s.connections == 2, "the timed-out connection was not reused"
