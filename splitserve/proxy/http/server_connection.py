"""The server's end of one client connection: parses its requests, runs their handlers in
order, writes their answers, and keeps its deadlines.

Runs in the proxy process, on its event loop; ``HTTPServer`` (``server.py``) makes one
``ServerConnection`` per accepted connection and hands it its routes, limits and error answers.
Split from ``server.py`` so that the per-connection state machine (httptools' callbacks, the
pipeline, the phases and their one timer) sits apart from listening, routing and shutdown. The
invariants it keeps are the server's (``server.py``): one handler at a time, answers in request
order, a client that goes away cancels its handler, every limit of ``edge.EdgeLimits`` applied
per request, and backpressure on streamed writes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import httptools

from splitserve.proxy.http.edge import Refused, check_framing
from splitserve.proxy.http.messages import Request, StreamResponse, encode_head

if TYPE_CHECKING:
    from splitserve.proxy.http.server import HTTPServer

logger = logging.getLogger(__name__)

_MAX_PIPELINED = 8  # parsed requests waiting on one connection before reading pauses
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A connection's phase, which decides its deadline: waiting for the next request (idle), reading
# a head, reading a body, or neither (a handler runs or requests wait: no client deadline).
_IDLE, _HEAD, _BODY, _BUSY = range(4)
_LINGER_S = 2.0  # a refused client's bytes are read and dropped this long before the close
_REQUEST_LINE = 15  # bytes of "GET  HTTP/1.1\r\n" around the URL: the fewest a request line has


class ServerConnection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers in order, writes answers."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.limits = server.limits
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
        self._reading_paused = False
        self._upgraded = False
        self._cut_off: Refused | None = None  # answered once the answers under way are sent
        # Time: the phase, its deadline, the one timer handle (see ``server.py``'s invariants).
        self._phase = _IDLE  # a fresh connection: its first byte is due within header_timeout_s
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # Bytes of the current read the parser consumed before the request being parsed began
        # (its known bodies and heads: never more than the truth, so a head is never undercounted).
        self._fed = 0
        self._began_at = -1  # where in the current read that request began (-1: an earlier read)
        # The request being parsed.
        self._head_bytes = 0  # raw bytes of its head in reads that ended inside the head
        self._head_parsed = 0  # bytes of its request line and headers, as parsed
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._lengths = 0  # Content-Length headers seen
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._continue = False  # it asked for ``100 Continue``

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        self._set_deadline(_IDLE, self.limits.header_timeout_s)  # closed unanswered if silent

    def data_received(self, data: bytes) -> None:
        if self.closing or self._cut_off is not None:
            return
        self._fed = 0
        self._began_at = -1
        try:
            self.parser.feed_data(data)
            if self._phase == _HEAD:  # a head still incomplete after this read: count its bytes
                if self._began_at < 0:
                    self._head_bytes += len(data)
                else:
                    self._head_bytes = len(data) - self._began_at
                if self._head_bytes > self.limits.max_header_bytes:
                    raise Refused(431, "request headers too large", "header_too_large")
        except Refused as e:
            self._refuse(e)
        except httptools.HttpParserUpgrade:
            # Served as plain HTTP (an upgrade we do not speak), then the connection closes:
            # what follows on it is another protocol.
            self._upgraded = True
            self.transport.pause_reading()  # type: ignore[union-attr]
            if not self.queue and self.task is None:
                self._close()
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, Refused):  # raised by one of our callbacks
                self._refuse(e.__context__)
            else:
                self._refuse(Refused(400, f"invalid HTTP request: {e}", "invalid_http"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
        self._set_deadline(_HEAD, self.limits.header_timeout_s)
        self._began_at = self._fed
        self._head_bytes = 0
        self._head_parsed = _REQUEST_LINE
        self._url = b""
        self._headers = {}
        self._lengths = 0
        self._body = []
        self._body_bytes = 0
        self._continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_parsed += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_parsed += len(name) + len(value) + 3  # "name:value\r\n" at the least
        if self._head_parsed > self.limits.max_header_bytes:
            raise Refused(431, "request headers too large", "header_too_large")
        name = name.lower()
        old = self._headers.get(name)
        self._headers[name] = value if old is None else old + b", " + value
        if name == b"content-length":
            self._lengths += 1
        elif name == b"expect" and value.lower() == b"100-continue":
            self._continue = True

    def on_headers_complete(self) -> None:
        if self._began_at >= 0:  # the whole head came in this read
            self._fed = self._began_at + self._head_parsed + 2
        else:  # its end did: what was not counted in the reads before
            self._fed = max(0, self._head_parsed + 2 - self._head_bytes)
        self._set_deadline(_BODY, self.limits.body_timeout_s)
        headers = self._headers
        if b"content-length" in headers or b"transfer-encoding" in headers:
            check_framing(headers, self._lengths, self.parser.get_http_version(), self.limits)
        if self._continue and self.task is None and not self.queue:
            self.write(_CONTINUE)
            self._continue = False

    def on_body(self, body: bytes) -> None:
        self._fed += len(body)
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes:
            limit = self.limits.max_body_bytes
            raise Refused(413, f"request body exceeds the limit of {limit} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._phase = _BUSY  # no client deadline until this request is answered
        parser = self.parser
        url = self._url
        path, _, query = url.partition(b"?")
        if not path.startswith(b"/"):  # absolute form: http://host/path
            try:
                parsed = httptools.parse_url(url)
                path, query = parsed.path or b"/", parsed.query or b""
            except httptools.HttpParserInvalidURLError:
                raise Refused(400, "invalid request target") from None
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
        if not self.queue:
            if self._cut_off is not None:
                self._refuse(self._cut_off)
            elif self._upgraded or self.server.closing:
                self._close()
            elif self._phase == _BUSY:  # between requests: the idle wait starts
                self._set_deadline(_IDLE, self.limits.idle_timeout_s)
            return
        request = self.queue.popleft()
        if (
            self._reading_paused
            and self._cut_off is None
            and len(self.queue) <= _MAX_PIPELINED // 2
        ):
            self._reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        self.keep_alive = request.keep_alive and not self.server.closing
        self.version = request.version
        self.task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        server = self.server
        try:
            try:
                # A route's handler is awaited here directly (one coroutine less a request);
                # anything else (HEAD, 404, 405) through ``dispatch``.
                handler = server.routes.get((request.method, request.path))
                if handler is not None:
                    response = await handler(request)
                else:
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
        if self._continue and not self.queue and self._cut_off is None:  # it waited for us
            self.write(_CONTINUE)
            self._continue = False
        self._next()

    def _refuse(self, refusal: Refused) -> None:
        """Answer a request that cannot be parsed or served, then close; when answers are under
        way, after them (reading stops at once: nothing more of this client is parsed)."""
        if self.closing or self._cut_off not in (None, refusal):
            return  # gone, or already refusing
        if refusal is not self._cut_off and refusal.reason and self.server.on_reject:
            self.server.on_reject(refusal.reason)
        if self.task is not None or self.queue:
            self._cut_off, self._phase = refusal, _BUSY
            if not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            return
        response = self.server.error_response(refusal.status, refusal.message)
        length = b"Content-Length: %d\r\n" % len(response.body)
        head = encode_head(refusal.status, response.headers, False, "1.1", length)
        self.write(head + response.body)
        self._linger()

    def _linger(self) -> None:
        """Close after a refusal the client may still be sending into: end our side (FIN),
        drop what arrives for ``_LINGER_S``, then close, so the client reads the answer
        instead of a reset."""
        self.closing = True
        transport = self.transport
        assert transport is not None
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self._reading_paused:
            transport.resume_reading()
        self.loop.call_later(_LINGER_S, transport.close)

    # ------------------------------------------------------------------ time

    def _set_deadline(self, phase: int, timeout: float) -> None:
        """Enter ``phase``, due ``timeout`` from now: a float stored, a timer handle only when
        none is pending before the new deadline."""
        self._phase = phase
        deadline = self._deadline = self.loop.time() + timeout
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        phase = self._phase
        if self.closing or phase == _BUSY:
            return  # no client deadline now; the next phase arms a timer
        now = self.loop.time()
        if self._reading_paused:  # the client waits on us, not we on it: its clock restarts
            timeout = self.limits.header_timeout_s if phase == _HEAD else self.limits.body_timeout_s
            self._deadline = now + timeout
        if now < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._on_timer)
        elif phase == _IDLE:
            self._close()
        elif phase == _HEAD:
            self._refuse(Refused(408, "request headers not received in time", "header_timeout"))
        else:
            self._refuse(Refused(408, "request body not received in time", "body_timeout"))

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
