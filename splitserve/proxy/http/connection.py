"""One keep-alive connection from the proxy to an engine, and the pool of idle ones per origin.

Runs in the proxy process, on its event loop. The wire side of the upstream client
(``client.py``): ``UpstreamConnection`` is the asyncio protocol that parses the answer to the
request in flight (httptools: llhttp, the C parser behind Node.js and uvicorn) into its
``UpstreamResponse`` (``response.py``); ``ConnectionPool`` keeps the idle connections to one
origin, checks one before it is reused and makes new ones. Split from ``client.py`` so that the
rules for when a connection may carry another request sit in one module.

Invariants:
- A connection serves one request at a time. It goes back to its pool only after its response
  was read to the end and both sides allow keep-alive (``UpstreamResponse.release``); any other
  ending (an error, a cancelled caller, ``close()``) aborts it, so the server sees the request
  end (vLLM then aborts the request and frees its KV).
- A pooled connection is checked before it is taken (closed by the server, reset, unsolicited
  bytes, or idle longer than ``_MAX_IDLE_S``: closed, and the next one or a new connection is
  used), so nothing is written on a connection the server is closing.
- Reads from a connection pause while more than ``_HIGH_WATER`` bytes wait for a slow caller.
- Errors are ``UpstreamConnectError`` (could not connect; ``timed_out`` says whether the
  connect timed out) and ``UpstreamDisconnected`` (the connection broke or the answer was not
  HTTP), both ``ConnectionError``.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from urllib.parse import urlsplit

import httptools

from splitserve.proxy.http.response import UpstreamResponse

_HIGH_WATER = 256 * 1024  # buffered body bytes above which reading pauses
# A pooled connection idle longer than this is closed rather than reused: below the engines'
# own keep-alive limit (uvicorn's default, vLLM's and SGLang's server: 5 s), so the proxy does not
# write a request on a connection the server is closing at that moment.
_MAX_IDLE_S = 4.0
# Header names (lower case) that frame an answer's body; without either it ends at the close.
_FRAMING = frozenset((b"content-length", b"transfer-encoding"))


class UpstreamConnectError(ConnectionError):
    """No connection to the server: refused, unreachable, or the connect timed out."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class UpstreamDisconnected(ConnectionError):
    """The connection broke before the answer was complete, or the answer was not HTTP. The
    request had been written (the server may have read it); ``answered``: some byte of the
    answer had arrived."""

    def __init__(self, message: str, answered: bool = True) -> None:
        super().__init__(message)
        self.answered = answered


# What a quiet, open idle connection never shows: bytes or an end of stream to read (POLLIN),
# the peer's half-close (POLLRDHUP, Linux), an error or a hang-up (always reported).
_UNFIT = select.POLLIN | select.POLLPRI | getattr(select, "POLLRDHUP", 0)


def _watch_socket(transport: asyncio.BaseTransport) -> select.poll | None:
    """A poll set on the connection's socket, made once per connection, so that checking it
    before a reuse (``_peer_open``) is one ``poll(0)`` system call: no socket object, no
    exception. None when there is no socket to look at (the loop's view then stands)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        watch = select.poll()
        watch.register(sock.fileno(), _UNFIT)
    except (OSError, ValueError):
        return None
    return watch


def _peer_open(watch: select.poll | None) -> bool:
    """True when an idle connection's socket shows nothing: no end of stream, no reset, no
    unsolicited bytes (consuming nothing). The loop may not have run the callbacks of a close
    that already reached the kernel; this sees it before a request is written."""
    if watch is None:
        return True
    try:
        return not watch.poll(0)
    except OSError:
        return False


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection: parses the answer to the request in flight."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.lost = False
        self.got_bytes = False
        self.framed = False  # the answer in flight has a Content-Length or Transfer-Encoding
        self.idle_since = 0.0
        self.watch: select.poll | None = None  # its socket, checked before each reuse

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.watch = _watch_socket(transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.response is None:  # bytes with no request in flight: not a server to keep
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamDisconnected(f"{self.pool.origin}: unexpected protocol upgrade"))
        except httptools.HttpParserError as e:
            self._fail(UpstreamDisconnected(f"{self.pool.origin}: invalid HTTP answer ({e})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        r = self.response
        if r is None:
            return
        if r.headers_done and not r.complete and r.close_delimited:
            self.on_message_complete()  # the end of a body without length or chunking
            return
        reason = f": {exc}" if exc else ""
        what = "connection closed" if self.got_bytes else "connection closed before any answer"
        self._fail(
            UpstreamDisconnected(f"{self.pool.origin}: {what}{reason}", answered=self.got_bytes)
        )

    def pause_writing(self) -> None:  # request bodies are small; the kernel buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name, value))
        if not self.framed and name.lower() in _FRAMING:
            self.framed = True

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        r.status = self.parser.get_status_code()
        r.headers_done = True
        r.close_delimited = not self.framed
        r.wake()

    def on_body(self, body: bytes) -> None:
        r = self.response
        assert r is not None
        r.feed(body)
        if r.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            r.paused = True

    def on_message_complete(self) -> None:
        r = self.response
        assert r is not None
        r.keep_alive = self.parser.should_keep_alive() and not r.close_delimited
        r.complete = True
        r.wake()

    # ours
    def send(self, request: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self.response = response
        self.got_bytes = False
        self.framed = False
        # The parser made with the connection goes on from answer to answer: a connection
        # carries another request only after its answer was complete (``ConnectionPool.put``
        # via ``UpstreamResponse.release``), where llhttp waits for the next message.
        response.conn = self
        self.transport.write(request)

    def resume(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()
        self.lost = True
        self.pool.forget(self)

    def _fail(self, error: Exception) -> None:
        r = self.response
        self.abort()
        if r is not None and not r.complete:
            r.fail(error)


class ConnectionPool:
    """Idle keep-alive connections to one origin (scheme, host, port)."""

    def __init__(self, origin: str, connect_timeout_s: float) -> None:
        parts = urlsplit(origin)
        self.origin = origin
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        self.netloc = parts.netloc
        self.connect_timeout_s = connect_timeout_s
        self.idle: list[UpstreamConnection] = []
        self.heads: dict[str, bytes] = {}  # path: the request head but its Content-Length

    def put(self, conn: UpstreamConnection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def take(self) -> UpstreamConnection | None:
        """An idle connection fit to write a request on, or None. Every one found unfit (the
        loop saw it close, the socket shows a close, a reset or stray bytes, or it idled past
        ``_MAX_IDLE_S``) is closed here, before anything is written on it."""
        if not self.idle:
            return None
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to be stale
            t = conn.transport
            if conn.lost or t is None or t.is_closing():
                continue
            if now - conn.idle_since <= _MAX_IDLE_S and _peer_open(conn.watch):
                return conn
            conn.abort()
        return None

    async def connect(self, until: float | None = None) -> UpstreamConnection:
        """A new connection; ``UpstreamConnectError`` after the connect timeout, but
        ``TimeoutError`` when loop time ``until`` comes first (the caller's deadline, not a
        sign that the server is unreachable)."""
        loop = asyncio.get_running_loop()
        limit = self.connect_timeout_s
        caller_bound = until is not None and until - loop.time() < limit
        if caller_bound:
            limit = max(0.0, until - loop.time())  # type: ignore[operator]
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                ),
                limit,
            )
        except asyncio.TimeoutError:
            if caller_bound:
                raise TimeoutError() from None
            raise UpstreamConnectError(
                f"{self.origin}: connect timed out after {self.connect_timeout_s:g} s",
                timed_out=True,
            ) from None
        except OSError as e:
            raise UpstreamConnectError(f"{self.origin}: {e.strerror or e}") from None
        return conn

    def close(self) -> None:
        for conn in list(self.idle):
            conn.abort()
        self.idle.clear()
