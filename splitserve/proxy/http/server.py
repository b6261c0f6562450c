"""The proxy's HTTP/1.1 server: client connections on asyncio protocols, parsed by httptools.

Runs in the proxy process, on its event loop; ``proxy/server.py`` gives it the routes. Why not
aiohttp's server (or uvicorn): on ``benchmarks/proxy_overhead.py``'s stubs a protocol-level
server cost the proxy markedly less CPU per request than either (the floor experiment and its
figures: docs/benchmarks.md, "A server of our own"). Parsing is httptools' (llhttp, the C parser
behind Node.js and uvicorn), as in ``client.py``; this module only frames answers, keeps
connections and runs one handler per request. Knows nothing of prefill or decode.

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

import httptools

from splitserve.proxy.http.messages import (
    ErrorResponse,
    Handler,
    Request,
    Response,
    StreamResponse,
    encode_head,
)

logger = logging.getLogger(__name__)

_MAX_PIPELINED = 8  # parsed requests waiting on one connection before reading pauses
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


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
                self.write(
                    encode_head(status, headers, self.keep_alive, self.version, length) + body
                )
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
            self.write(encode_head(status, response.headers, False, "1.1", length) + response.body)
            self._close()
        else:  # an answer is being written: nothing can go between it and its end
            self._abort()

    # ------------------------------------------------------------------ plumbing

    @property
    def shutting_down(self) -> bool:
        """The server is closing: an answer started now ends its connection."""
        return self.server.closing

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
