"""The proxy's HTTP/1.1 client to the engines: keep-alive connections on asyncio protocols.

Runs in the proxy process, on its event loop; every prefill and decode request goes through one
``UpstreamClient`` (``proxy/calls.py``). Why not aiohttp's client: its request machinery was
most of the proxy's CPU per request (measured with ``benchmarks/proxy_overhead.py``; figures in
docs/benchmarks.md, "Our own upstream client"). Parsing is httptools' (llhttp, the C parser
behind Node.js and uvicorn); this module only frames requests, pools connections and hands body
bytes to the caller as they arrive. Knows nothing of prefill or decode.

Scope: what the proxy needs and nothing more. ``POST`` with a complete body (the proxy has parsed
it), responses with ``Content-Length``, chunked or close-delimited bodies, ``http`` and
``https``. No redirects, cookies, compression or proxies: the proxy talks only to the configured
servers and relays bodies as they come.

Invariants:
- A connection serves one request at a time. It goes back to its pool only after its response
  was read to the end and both sides allow keep-alive; any other ending (an error, a cancelled
  caller, ``close()``) aborts it, so the server sees the request end (vLLM then aborts the
  request and frees its KV).
- A request is written at most once: a pooled connection is checked before writing (closed by
  the server, reset, unsolicited bytes, or idle longer than ``_MAX_IDLE_S``: dropped, and the
  next one or a new connection is used). Once written, a failure is the caller's error
  (``UpstreamDisconnected``), never a silent second send: the server may have read
  the request and started a generation (the proxy's retry rule: docs/proxy.md, "Faults").
- Reads from a connection pause while more than ``_HIGH_WATER`` bytes wait for a slow caller.
- Errors are ``UpstreamConnectError`` (could not connect; ``timed_out`` says whether the
  connect timed out) and ``UpstreamDisconnected`` (the connection broke or the answer was not
  HTTP), both ``ConnectionError``; ``TimeoutError`` when the response's ``until`` (a loop time
  the caller sets, and may move, before each read) passes while waiting, within ``_SWEEP_S``
  (50 ms) after it. The client's one sweeping timer keeps every waiting response's deadline:
  no timer, timeout context or cancellation per read.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import select
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

logger = logging.getLogger(__name__)

_HIGH_WATER = 256 * 1024  # buffered body bytes above which reading pauses
_LOW_WATER = 64 * 1024
# A pooled connection idle longer than this is closed rather than reused: below the engines'
# own keep-alive limit (uvicorn's default, vLLM's and SGLang's server: 5 s), so the proxy does not
# write a request on a connection the server is closing at that moment.
_MAX_IDLE_S = 4.0
# How often the waits' deadlines are checked (``_Sweeper``): how late a timeout may end a wait.
_SWEEP_S = 0.05


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


class _Connection(asyncio.Protocol):
    """One keep-alive connection: parses the answer to the request in flight."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.lost = False
        self.got_bytes = False
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

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        r.status = self.parser.get_status_code()
        r.headers_done = True
        names = {n.lower() for n, _ in r.raw_headers}
        r.close_delimited = b"content-length" not in names and b"transfer-encoding" not in names
        r._wake()

    def on_body(self, body: bytes) -> None:
        r = self.response
        assert r is not None
        r._feed(body)
        if r.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            r.paused = True

    def on_message_complete(self) -> None:
        r = self.response
        assert r is not None
        r.keep_alive = self.parser.should_keep_alive() and not r.close_delimited
        r.complete = True
        r._wake()

    # ours
    def send(self, request: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self.response = response
        self.got_bytes = False
        self.parser = httptools.HttpResponseParser(self)
        response._conn = self
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
            r._fail(error)


class UpstreamResponse:
    """The answer to one request: status and headers first, then the body as it comes.

    ``until``: loop time after which a wait for more of the answer raises ``TimeoutError``
    (None: no bound); the caller moves it between reads (e.g. a stream's idle timeout)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        until: float | None = None,
        sweeper: _Sweeper | None = None,
    ) -> None:
        """``sweeper``: the client's (``UpstreamClient.response``) keeps ``until``; without
        one, each wait arms a timer of its own."""
        self._loop = loop
        self.until = until
        self._sweeper = sweeper
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.close_delimited = False
        self.keep_alive = False
        self.paused = False
        self.buffered = 0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._conn: _Connection | None = None
        self._done = False  # released or closed
        # Told when the answer fails (a broken connection, an interrupt): lets another request
        # of the same client request stop waiting at once, without a task watching this one.
        self.on_fail: Callable[[], None] | None = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        key = name.lower().encode()
        for n, v in self.raw_headers:
            if n.lower() == key:
                return v.decode("latin-1")
        return None

    @property
    def ready(self) -> bool:
        """True when ``readany`` answers without waiting (bytes, the end or an error are here):
        a caller can skip arming a timeout for it."""
        return bool(self._chunks) or self.complete or self._error is not None

    @property
    def error(self) -> Exception | None:
        """Why the answer failed, once it did."""
        return self._error

    @property
    def at_end(self) -> bool:
        """True when the whole answer has arrived and been read: nothing more will come."""
        return self.complete and not self._chunks and self._error is None

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last read (waits for some); b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait()
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        self.buffered = 0
        if self.paused and self._conn is not None:
            self.paused = False
            self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while True:
            chunk = await self.readany()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    def interrupt(self, error: Exception) -> None:
        """Fail every wait for this answer from now on with ``error`` (the caller then closes
        it): e.g. the request it belongs to became pointless."""
        if self._error is None:
            self._fail(error)

    def release(self) -> None:
        """Done with the answer: the connection goes back to its pool when the answer was read
        to the end and both sides keep it alive, else it is closed."""
        if self._done:
            return
        self._done = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.response = None
        if self.complete and self.keep_alive and not conn.lost:
            if self.paused:  # the body was complete but not all read: reading must go on
                conn.resume()
            conn.pool.put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Abandon the answer: the connection is closed (the server sees the request end)."""
        if self._done:
            return
        self._done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.response = None
            conn.abort()

    # called by the connection
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self.buffered += len(data)
        self._wake()

    def _fail(self, error: Exception) -> None:
        self._error = error
        self._wake()
        if self.on_fail is not None:
            self.on_fail()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        until, sweeper, timer = self.until, self._sweeper, None
        if until is not None:
            if sweeper is not None:
                sweeper.add(self)
            else:
                timer = loop.call_at(until, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
            elif sweeper is not None:
                sweeper.waits.discard(self)

    async def wait_head(self) -> None:
        """Until the status and headers are in (``TimeoutError`` after ``until``)."""
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Sweeper:
    """The deadlines of one client's waiting responses, kept by one loop timer that checks them
    every ``_SWEEP_S`` while any wait is on, instead of a timer per wait (a libuv timer made and
    cancelled costs ~1.7 us; a request of the proxy waits three or four times). A wait past its
    ``until`` ends within ``_SWEEP_S`` after it, the bound's one cost."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waits: set[UpstreamResponse] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, response: UpstreamResponse) -> None:
        self.waits.add(response)
        if self._timer is None:
            self._timer = self.loop.call_later(_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        self._timer = None
        now = self.loop.time()
        for r in [r for r in self.waits if r.until is not None and r.until <= now]:
            self.waits.discard(r)
            if r._waiter is not None:
                _expire(r._waiter)
        if self.waits:
            self._timer = self.loop.call_later(_SWEEP_S, self._sweep)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Pool:
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
        self.idle: list[_Connection] = []
        self.heads: dict[str, bytes] = {}  # path: the request head but its Content-Length

    def put(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def take(self) -> _Connection | None:
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

    async def connect(self, until: float | None = None) -> _Connection:
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
                    lambda: _Connection(self),
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


class UpstreamClient:
    """Keep-alive HTTP/1.1 requests to a fixed set of origins (the configured servers)."""

    def __init__(self, connect_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        """Made on the loop it will serve (kept: each ``asyncio.get_running_loop()`` is a
        getpid() system call on Python 3.11)."""
        self._loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._extra = extra.encode("latin-1")
        self._pools: dict[str, _Pool] = {}
        self._sweeper = _Sweeper(self._loop)

    def response(self, until: float | None = None) -> UpstreamResponse:
        """A response object for ``send``, its deadline (loop time ``until``) kept by this
        client."""
        return UpstreamResponse(self._loop, until, self._sweeper)

    def _pool(self, origin: str) -> _Pool:
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = _Pool(origin, self.connect_timeout_s)
        return pool

    async def post(
        self,
        origin: str,
        path: str,
        body: bytes,
        until: float | None = None,
        on_response: Callable[[UpstreamResponse], None] | None = None,
    ) -> UpstreamResponse:
        """POST ``body`` (JSON) to ``origin + path``; returns once the status and headers
        arrived, ``TimeoutError`` if that is not before loop time ``until`` (the response keeps
        ``until`` for its reads). ``on_response`` gets the response object as it is made, e.g.
        to ``interrupt`` it. The caller reads the body and then calls ``release()`` (or
        ``close()``). The request is written once: a failure after that is raised
        (``UpstreamDisconnected``), never sent again."""
        conn = await self.connection(origin, until)
        response = self.response(until)
        if on_response is not None:
            on_response(response)
        try:
            self.send(conn, path, body, response)
            await response.wait_head()
        except BaseException:
            response.close()
            raise
        return response

    async def connection(self, origin: str, until: float | None = None) -> _Connection:
        """A connection to ``origin`` to write one request on at once (``send``): an idle one
        fit for reuse (no wait), else a new one (``UpstreamConnectError``; ``TimeoutError`` at
        loop time ``until``)."""
        pool = self._pool(origin)
        conn = pool.take()
        if conn is None:
            conn = await pool.connect(until)
        return conn

    def send(self, conn: _Connection, path: str, body: bytes, response: UpstreamResponse) -> None:
        """Write a POST of ``body`` (JSON) to ``path`` on ``conn`` (from ``connection``, with no
        await between); its answer comes into ``response`` (``wait_head``, then the body). The
        caller releases or closes the response, which gives the connection back or closes it."""
        pool = conn.pool
        head = pool.heads.get(path)
        if head is None:
            head = pool.heads[path] = (
                b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                % (path.encode(), pool.netloc.encode(), self._extra)
            )
        conn.send(b"%bContent-Length: %d\r\n\r\n%b" % (head, len(body), body), response)

    def close(self) -> None:
        """Close every idle connection (responses still held are closed by their holders)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._sweeper.close()
