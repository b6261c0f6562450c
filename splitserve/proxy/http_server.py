"""The proxy's HTTP/1.1 server: client connections on asyncio protocols, parsed by httptools.

Runs in the proxy process, on its event loop; ``server.py`` gives it the routes. Why not
aiohttp's server: measured with ``benchmarks/proxy_overhead.py``'s stubs, a proxy with no
features spends 66 us per request on aiohttp's server and our upstream client, 42 us on this
server and the same client (uvicorn with a bare ASGI app: 59 to 63), about a third of the
proxy's whole CPU per request (docs/benchmarks.md, "A protocol-level server"). Parsing is
httptools' (llhttp, the C parser behind Node.js and uvicorn), as in ``upstream.py``; this module
only frames answers, keeps connections and runs one handler per request.

Scope: what an OpenAI-compatible endpoint needs. HTTP/1.1 and 1.0; request bodies with
``Content-Length`` or chunked, read whole before the handler runs; keep-alive and pipelining
(answers in request order); ``Expect: 100-continue``; ``HEAD`` for every ``GET`` route; answers
with ``Content-Length`` (``Response``) or streamed (``StreamResponse``: chunked, close-delimited
for HTTP/1.0). No TLS, upgrades or trailers: a request asking to upgrade is served as plain
HTTP/1.1 and its connection closed after it.

Invariants:
- At most one handler runs per connection; pipelined requests wait, their bytes still parsed,
  and reading pauses while more than ``_MAX_PIPELINED`` wait.
- A client that goes away cancels its handler (as aiohttp's ``handler_cancellation``), so the
  handler's upstream requests close and the engines abort them.
- Every answer the server makes itself (bad HTTP, too large, unknown route or method, a handler
  that crashed) is built by the caller's ``error_response``, so it has the caller's body shape.
- Bounded: header bytes (``max_header_bytes``), body bytes (``max_body_bytes``), and time: a
  connection idle, or sending one request, for longer than ``keepalive_timeout_s`` is closed.
- A stream write waits while the connection's send buffer is above its high-water mark (a slow
  client gets backpressure, not the proxy's memory); a write to a client that went away raises
  ``ConnectionResetError``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus

import httptools

logger = logging.getLogger(__name__)

_MAX_PIPELINED = 8  # parsed requests waiting on one connection before reading pauses
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Request:
    """One client request, body included (the server reads it whole before the handler)."""

    __slots__ = ("method", "path", "query", "version", "body", "keep_alive", "_headers", "_conn")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        version: str,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        conn: _Connection | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.body = body
        self.keep_alive = keep_alive
        self._headers = headers  # lower-case names; repeated headers joined with ", "
        self._conn = conn  # where to write a streamed answer

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        value = self._headers.get(name.lower().encode("latin-1"))
        return None if value is None else value.decode("latin-1")


class Response:
    """A whole answer, sent with ``Content-Length`` in one write."""

    __slots__ = ("status", "body", "headers")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = {"Content-Type": content_type, **(headers or {})}


# The headers of every Server-Sent-Events answer the proxy streams.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class StreamResponse:
    """An answer written as it is produced: ``prepare`` sends the head, ``write`` a piece of
    the body, ``write_eof`` the end. Chunked for HTTP/1.1 clients, close-delimited for 1.0."""

    __slots__ = ("status", "headers", "_conn", "_chunked", "_done")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self._conn: _Connection | None = None
        self._chunked = True
        self._done = False

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: Request) -> None:
        conn = request._conn
        if conn is None or conn.closing:
            raise ConnectionResetError("the client went away")
        self._conn = conn
        self._chunked = request.version != "1.0"
        if not self._chunked or conn.server.closing:
            conn.keep_alive = False  # 1.0: the end of the body is the end of the connection
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        conn.write(_head(self.status, self.headers, conn.keep_alive, conn.version, framing))
        await conn.drain()

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None:
            raise RuntimeError("write before prepare")
        if conn.closing:
            raise ConnectionResetError("the client went away")
        if not data:
            return  # an empty chunk would end a chunked body
        conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        conn = self._conn
        if conn is None or self._done:
            return
        self._done = True
        if self._chunked and not conn.closing:
            conn.write(b"0\r\n\r\n")
        await conn.drain()


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
ErrorResponse = Callable[[int, str], Response]


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


_STATUS_LINES = {s.value: b"HTTP/1.1 %d %b\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_date_second = 0
_date_header = b""


def _date() -> bytes:
    """The ``Date`` header line, formatted once a second."""
    global _date_second, _date_header
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_header = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_header


def _head(
    status: int, headers: dict[str, str], keep_alive: bool, version: str, extra: bytes = b""
) -> bytes:
    line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d %b\r\n" % (status, _reason(status))
    parts = [line, _date(), extra]
    for name, value in headers.items():
        parts.append(f"{name}: {value}\r\n".encode("latin-1"))
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    elif version == "1.0":
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


class _Refused(Exception):
    """The request cannot be served; answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers in order, writes answers."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closing = False  # the connection is gone or going: write nothing more
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.keep_alive = True  # of the request being answered
        self.version = "1.1"
        self.task: asyncio.Task[None] | None = None  # the handler of the request being answered
        self.queue: collections.deque[Request] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._upgraded = False
        # The request being parsed.
        self._in_head = False
        self._head_bytes = 0
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._continue = False  # it asked for ``100 Continue``

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self._arm_timer()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        was_in_head = self._in_head
        try:
            self.parser.feed_data(data)
            if was_in_head and self._in_head:  # a head still incomplete after this read
                self._head_bytes += len(data)
                if self._head_bytes > self.server.max_header_bytes:
                    raise _Refused(431, "request headers too large")
        except _Refused as e:
            self._refuse(e.status, e.message)
        except httptools.HttpParserUpgrade:
            # Served as plain HTTP (an upgrade we do not speak), then the connection closes:
            # what follows on it is another protocol.
            self._upgraded = True
            self.transport.pause_reading()  # type: ignore[union-attr]
            if not self.queue and self.task is None:
                self._close()
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _Refused):  # raised by one of our callbacks
                self._refuse(e.__context__.status, e.__context__.message)
            else:
                self._refuse(400, f"invalid HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        self._cancel_timer()
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: its handler (and upstream requests) end
        self._wake_drain()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_bytes = 0
        self._continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        old = self._headers.get(name)
        self._headers[name] = value if old is None else old + b", " + value
        if name == b"expect" and value.lower() == b"100-continue":
            self._continue = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        length = self._headers.get(b"content-length")
        limit = self.server.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise _Refused(
                413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes"
            )
        if self._continue and self.task is None and not self.queue:
            self.write(_CONTINUE)
            self._continue = False

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body_bytes:
            limit = self.server.max_body_bytes
            raise _Refused(413, f"request body exceeds the limit of {limit} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        url = self._url
        path, _, query = url.partition(b"?")
        if not path.startswith(b"/"):  # absolute form: http://host/path
            try:
                parsed = httptools.parse_url(url)
                path, query = parsed.path or b"/", parsed.query or b""
            except httptools.HttpParserInvalidURLError:
                raise _Refused(400, "invalid request target") from None
        version = parser.get_http_version()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            parser.get_method().decode("ascii", "replace"),
            path.decode("latin-1"),
            query.decode("latin-1"),
            version,
            self._headers,
            body,
            parser.should_keep_alive() and not parser.should_upgrade(),
            self,
        )
        self._body = []
        self.queue.append(request)
        if len(self.queue) > _MAX_PIPELINED and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        if self.task is None:
            self._next()

    # ------------------------------------------------------------------ requests and answers

    def _next(self) -> None:
        """Start the handler of the next waiting request, or wait for one."""
        self._cancel_timer()
        if not self.queue:
            if self._upgraded or self.server.closing:
                self._close()
            else:
                self._arm_timer()
            return
        request = self.queue.popleft()
        if self._reading_paused and len(self.queue) <= _MAX_PIPELINED // 2:
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        self.keep_alive = request.keep_alive and not self.server.closing
        self.version = request.version
        self.task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        server = self.server
        try:
            try:
                response = await server.dispatch(request)
            except asyncio.CancelledError:
                return  # the client went away, or the server is shutting down
            except Exception:
                logger.exception("bug while serving %s %s", request.method, request.path)
                response = server.error_response(500, "internal server error")
            if isinstance(response, StreamResponse):
                if not response.prepared:
                    raise RuntimeError("a handler returned a StreamResponse it never prepared")
                await response.write_eof()
            elif not self.closing:
                self.keep_alive = self.keep_alive and not server.closing
                body = b"" if request.method == "HEAD" else response.body
                length = b"Content-Length: %d\r\n" % len(response.body)
                status, headers = response.status, response.headers
                self.write(_head(status, headers, self.keep_alive, self.version, length) + body)
        except (ConnectionError, asyncio.CancelledError):
            return
        except Exception:
            logger.exception("bug while answering %s %s", request.method, request.path)
            self._abort()
            return
        finally:
            self.task = None
        if self.closing:
            return
        if not self.keep_alive:
            self._close()
            return
        if self._continue and not self.queue:  # the next request waited for our answer
            self.write(_CONTINUE)
            self._continue = False
        self._next()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be parsed or served, then close."""
        if self.task is None and not self.closing:
            response = self.server.error_response(status, message)
            length = b"Content-Length: %d\r\n" % len(response.body)
            self.write(_head(status, response.headers, False, "1.1", length) + response.body)
            self._close()
        else:  # an answer is being written: nothing can go between it and its end
            self._abort()

    # ------------------------------------------------------------------ plumbing

    def write(self, data: bytes) -> None:
        if not self.closing:
            self.transport.write(data)  # type: ignore[union-attr]

    async def drain(self) -> None:
        if self.closing:
            raise ConnectionResetError("the client went away")
        if not self.write_paused:
            return
        waiter = self._drain_waiter = self.loop.create_future()
        await waiter
        if self.closing:
            raise ConnectionResetError("the client went away")

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm_timer(self) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(self.server.keepalive_timeout_s, self._timed_out)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.task is None:
            self._close()

    def _close(self) -> None:
        if not self.closing:
            self.closing = True
            self.transport.close()  # type: ignore[union-attr]

    def _abort(self) -> None:
        self.closing = True
        self.transport.abort()  # type: ignore[union-attr]

    def close_if_idle(self) -> None:
        if self.task is None:
            self._close()


class HTTPServer:
    """Routes requests to handlers on every connection it accepts.

    ``routes`` maps ``(method, path)`` to a handler; an unknown path answers 404, a known path
    with another method 405; ``HEAD`` runs the ``GET`` handler and sends no body.
    """

    def __init__(
        self,
        routes: dict[tuple[str, str], Handler],
        error_response: ErrorResponse,
        *,
        max_body_bytes: int,
        max_header_bytes: int = 64 * 1024,
        keepalive_timeout_s: float = 75.0,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        self.routes = dict(routes)
        self._methods: dict[str, list[str]] = {}
        for method, path in self.routes:
            self._methods.setdefault(path, []).append(method)
        self.error_response = error_response
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.keepalive_timeout_s = keepalive_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.connections: set[_Connection] = set()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start
        self._server: asyncio.AbstractServer | None = None

    async def dispatch(self, request: Request) -> Response | StreamResponse:
        handler = self.routes.get((request.method, request.path))
        if handler is None and request.method == "HEAD":
            handler = self.routes.get(("GET", request.path))
        if handler is not None:
            return await handler(request)
        allowed = self._methods.get(request.path)
        if allowed is None:
            return self.error_response(404, f"no route {request.path}")
        response = self.error_response(
            405, f"method {request.method} not allowed on {request.path}"
        )
        response.headers["Allow"] = ", ".join(sorted(allowed))
        return response

    async def start(
        self, host: str, port: int, *, backlog: int = 1024, reuse_port: bool = False
    ) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            backlog=backlog,
            reuse_port=reuse_port or None,
        )
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, let answers under way finish (``shutdown_timeout_s``), close all."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.shutdown_timeout_s)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            with contextlib.suppress(Exception):
                conn._abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
