"""The answer to one upstream request as the proxy reads it, and the deadlines of its waits.

Runs in the proxy process, on its event loop. ``UpstreamResponse`` is what the upstream client
(``client.py``) hands its caller: status and headers first, then body bytes as they arrive,
buffered until read. Its connection (``connection.UpstreamConnection``, seen here only as a
``Carrier``) feeds it; the caller reads it and then releases or closes it, which gives the
connection back to its pool or closes it. ``DeadlineSweeper`` keeps the deadlines of one
client's waiting responses. Split from ``client.py`` so that what a caller holds and how its
waits end sit apart from the wire.

Invariants:
- A wait for more of the answer raises ``TimeoutError`` when the response's ``until`` (a loop
  time the caller sets, and may move, before each read) passes while waiting, within
  ``_SWEEP_S`` (50 ms) after it: the client's one sweeping timer keeps every waiting response's
  deadline, with no timer, timeout context or cancellation per read.
- Once the answer failed (its connection broke, the answer was not HTTP, or ``interrupt``),
  every wait raises that error; ``on_fail`` is told once, as it fails.
- ``release`` and ``close`` act once; only a complete, keep-alive answer gives its connection
  back for reuse.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, Protocol

# How often the waits' deadlines are checked (``DeadlineSweeper``): how late a timeout may end a
# wait.
_SWEEP_S = 0.05


class Carrier(Protocol):
    """The connection an answer arrives on, as the answer uses it
    (``connection.UpstreamConnection``)."""

    lost: bool
    response: UpstreamResponse | None
    pool: Any  # its ``ConnectionPool``: ``pool.put(conn)`` keeps the connection for reuse

    def resume(self) -> None: ...

    def abort(self) -> None: ...


class UpstreamResponse:
    """The answer to one request: status and headers first, then the body as it comes.

    ``until``: loop time after which a wait for more of the answer raises ``TimeoutError``
    (None: no bound); the caller moves it between reads (e.g. a stream's idle timeout)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        until: float | None = None,
        sweeper: DeadlineSweeper | None = None,
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
        self.conn: Carrier | None = None  # set by the connection as it writes the request
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
        if self.paused and self.conn is not None:
            self.paused = False
            self.conn.resume()
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        if self.complete and self._error is None:  # all in (the usual case): no wait
            chunks = self._chunks
            data = b"".join(chunks) if len(chunks) != 1 else chunks[0]
            chunks.clear()
            self.buffered = 0
            if self.paused and self.conn is not None:
                self.paused = False
                self.conn.resume()
            return data
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
            self.fail(error)

    def release(self) -> None:
        """Done with the answer: the connection goes back to its pool when the answer was read
        to the end and both sides keep it alive, else it is closed."""
        if self._done:
            return
        self._done = True
        conn, self.conn = self.conn, None
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
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.response = None
            conn.abort()

    # called by the connection
    def feed(self, data: bytes) -> None:
        """Body bytes arrived."""
        self._chunks.append(data)
        self.buffered += len(data)
        w = self._waiter  # ``wake``, inline: a streamed answer comes in many pieces
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, error: Exception) -> None:
        """The answer failed: every wait raises ``error`` from now on."""
        self._error = error
        self.wake()
        if self.on_fail is not None:
            self.on_fail()

    def wake(self) -> None:
        """Something a wait looks at changed (the head, bytes, the end, an error)."""
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


class DeadlineSweeper:
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
