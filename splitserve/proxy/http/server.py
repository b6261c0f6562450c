"""The proxy's HTTP/1.1 server: client connections on asyncio protocols, parsed by httptools.

Runs in the proxy process, on its event loop; ``proxy/server.py`` gives it the routes. Why not
aiohttp's server (or uvicorn): a protocol-level server costs the proxy markedly less CPU per
request (docs/benchmarks.md, "A server of our own"). Parsing is httptools' (llhttp), as in
``client.py``; this module listens, routes and shuts down, and each connection
(``server_connection.py``) parses its requests, runs one handler at a time and frames the
answers. Knows nothing of prefill or decode.

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
- Bounded (``edge.EdgeLimits``; docs/proxy.md, "Edge limits"): head bytes from each request's
  first byte, pipelined ones too (431); body bytes (413); ambiguous framing (400); connections
  (503); time per phase of each request: head, body (408), idle wait (closed). A slow client is
  cut off alone. A phase stores a deadline; a connection's one timer handle re-arms itself when
  it fires early and is replaced only when a deadline moves before it: no timer per request.
- A stream write waits while the connection's send buffer is above its high-water mark (a slow
  client gets backpressure, not the proxy's memory); a write to a client that went away raises
  ``ConnectionResetError``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from splitserve.proxy.http.edge import EdgeLimits, TurnAway
from splitserve.proxy.http.messages import (
    ErrorResponse,
    Handler,
    Request,
    Response,
    StreamResponse,
)
from splitserve.proxy.http.server_connection import ServerConnection


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
        limits: EdgeLimits | None = None,
        shutdown_timeout_s: float = 5.0,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        """``limits``: the edge limits (default ``EdgeLimits(max_body_bytes)``); ``on_reject``
        is told why a client was refused or cut off (``header_timeout``, ``body_timeout``,
        ``header_too_large``, ``bad_framing``, ``invalid_http``, ``max_connections``)."""
        self.routes = dict(routes)
        self._methods: dict[str, list[str]] = {}
        for method, path in self.routes:
            self._methods.setdefault(path, []).append(method)
        self.error_response = error_response
        self.limits = limits if limits is not None else EdgeLimits(max_body_bytes)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_reject = on_reject
        self.connections: set[ServerConnection] = set()
        self._turning_away: set[TurnAway] = set()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start
        self._server: asyncio.AbstractServer | None = None

    def _accept(self) -> asyncio.Protocol:
        """The protocol of a new connection: served, or turned away past ``max_connections``."""
        cap = self.limits.max_connections
        if len(self.connections) < cap:
            return ServerConnection(self)
        if self.on_reject is not None:
            self.on_reject("max_connections")
        # A flood of them is reset at once, without an answer.
        answer = len(self._turning_away) < cap
        return TurnAway(self.error_response, self._turning_away, answer)

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
            self._accept,
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
        for refused in list(self._turning_away):
            refused.abort()
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
