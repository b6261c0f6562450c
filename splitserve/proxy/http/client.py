"""The proxy's HTTP/1.1 client to the engines: keep-alive connections on asyncio protocols.

Runs in the proxy process, on its event loop; every prefill and decode request goes through one
``UpstreamClient`` (``proxy/calls.py``). Why not aiohttp's client: its request machinery was
most of the proxy's CPU per request (measured with ``benchmarks/proxy_overhead.py``; figures in
docs/benchmarks.md, "Our own upstream client"). Parsing is httptools' (llhttp, the C parser
behind Node.js and uvicorn); the client only frames requests, pools connections and hands body
bytes to the caller as they arrive. Knows nothing of prefill or decode.

Three modules, one job each: this one frames requests and keeps a pool per origin (the API the
proxy calls); ``connection.py`` is the wire (one connection's parser, the pool's reuse checks,
connecting, the errors); ``response.py`` is what the caller holds (``UpstreamResponse``: the
body as it comes, release or close, the deadlines of its waits). ``UpstreamResponse``,
``UpstreamConnectError`` and ``UpstreamDisconnected`` are imported from here by the proxy.

Scope: what the proxy needs and nothing more. ``POST`` with a complete body (the proxy has parsed
it), responses with ``Content-Length``, chunked or close-delimited bodies, ``http`` and
``https``. No redirects, cookies, compression or proxies: the proxy talks only to the configured
servers and relays bodies as they come.

Invariants (each module states its own; the ones a caller relies on):
- A connection serves one request at a time and goes back to its pool only after its response
  was read to the end and both sides allow keep-alive; any other ending aborts it, so the
  server sees the request end (vLLM then aborts the request and frees its KV).
- A request is written at most once: a pooled connection is checked before writing (closed by
  the server, reset, unsolicited bytes, or idle too long: dropped, and the next one or a new
  connection is used). Once written, a failure is the caller's error (``UpstreamDisconnected``),
  never a silent second send: the server may have read the request and started a generation
  (the proxy's retry rule: docs/proxy.md, "Faults").
- Errors are ``UpstreamConnectError`` (could not connect; ``timed_out`` says whether the
  connect timed out) and ``UpstreamDisconnected`` (the connection broke or the answer was not
  HTTP), both ``ConnectionError``; ``TimeoutError`` when the response's ``until`` passes while
  waiting, within 50 ms after it (``response.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitserve.proxy.http.connection import (
    ConnectionPool,
    UpstreamConnectError,
    UpstreamConnection,
    UpstreamDisconnected,
)
from splitserve.proxy.http.response import DeadlineSweeper, UpstreamResponse

__all__ = [
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamConnection",
    "UpstreamDisconnected",
    "UpstreamResponse",
]


class UpstreamClient:
    """Keep-alive HTTP/1.1 requests to a fixed set of origins (the configured servers)."""

    def __init__(self, connect_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        """Made on the loop it will serve (kept: each ``asyncio.get_running_loop()`` is a
        getpid() system call on Python 3.11)."""
        self._loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._extra = extra.encode("latin-1")
        self._pools: dict[str, ConnectionPool] = {}
        self._sweeper = DeadlineSweeper(self._loop)

    def response(self, until: float | None = None) -> UpstreamResponse:
        """A response object for ``send``, its deadline (loop time ``until``) kept by this
        client."""
        return UpstreamResponse(self._loop, until, self._sweeper)

    def _pool(self, origin: str) -> ConnectionPool:
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = ConnectionPool(origin, self.connect_timeout_s)
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
        conn = self.idle(origin) or await self.connection(origin, until)
        response = UpstreamResponse(self._loop, until, self._sweeper)
        if on_response is not None:
            on_response(response)
        try:
            self.send(conn, path, body, response)
            await response.wait_head()
        except BaseException:
            response.close()
            raise
        return response

    def idle(self, origin: str) -> UpstreamConnection | None:
        """An idle connection to ``origin`` fit for reuse, or None: ``connection`` without a
        coroutine for the usual case (each costs a frame and a send on the hot path)."""
        pool = self._pools.get(origin)
        return None if pool is None else pool.take()

    async def connection(self, origin: str, until: float | None = None) -> UpstreamConnection:
        """A connection to ``origin`` to write one request on at once (``send``): an idle one
        fit for reuse (no wait), else a new one (``UpstreamConnectError``; ``TimeoutError`` at
        loop time ``until``)."""
        pool = self._pool(origin)
        conn = pool.take()
        if conn is None:
            conn = await pool.connect(until)
        return conn

    def send(
        self, conn: UpstreamConnection, path: str, body: bytes, response: UpstreamResponse
    ) -> None:
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
