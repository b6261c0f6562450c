"""What the proxy's HTTP server exchanges with a handler: ``Request`` in; ``Response`` (whole)
or ``StreamResponse`` (written as produced) out; and how an answer's head is encoded.

Runs in the proxy process, on its event loop. Split from ``server.py`` (which parses and keeps
connections) so that handlers and the P/D logic depend on these types only.

Invariants: a ``StreamResponse`` writes nothing before ``prepare``; its chunks are never empty
(an empty chunk would end a chunked body); a write to a client that went away raises
``ConnectionResetError``, and a write waits while the connection's send buffer is full.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol


class Connection(Protocol):
    """The side of a client connection a streamed answer writes to
    (``server_connection.ServerConnection``)."""

    closing: bool
    keep_alive: bool
    version: str
    write_paused: bool

    @property
    def shutting_down(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class Request:
    """One client request, body included (the server reads it whole before the handler)."""

    __slots__ = (
        "method",
        "path",
        "query",
        "version",
        "body",
        "keep_alive",
        "_headers",
        "connection",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        version: str,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        connection: Connection | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.body = body
        self.keep_alive = keep_alive
        self._headers = headers  # lower-case names; repeated headers joined with ", "
        self.connection = connection  # where to write a streamed answer

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
    """An answer written as it is produced: ``prepare`` decides the framing, ``write`` sends a
    piece of the body, ``write_eof`` the end. Chunked for HTTP/1.1 clients, close-delimited for
    1.0.

    Bytes go out in as few writes (system calls, each costing the receiver's TCP work too on
    loopback) as the caller allows: the head waits for the first body bytes (``prepare`` sends
    nothing), and ``hold`` keeps a piece for the next ``write`` or ``write_eof`` when the caller
    knows that one follows at once (e.g. the upstream answer is complete)."""

    __slots__ = ("status", "headers", "_conn", "_chunked", "_done", "_held")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self._conn: Connection | None = None
        self._chunked = True
        self._done = False
        self._held = b""  # encoded bytes not written yet: the head, pieces held

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: Request) -> None:
        """Fix the status, headers and framing; the head goes out with the first body bytes
        (``write``) or the end (``write_eof``)."""
        conn = request.connection
        if conn is None or conn.closing:
            raise ConnectionResetError("the client went away")
        self._conn = conn
        self._chunked = request.version != "1.0"
        if not self._chunked or conn.shutting_down:
            conn.keep_alive = False  # 1.0: the end of the body is the end of the connection
        framing = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        self._held = encode_head(self.status, self.headers, conn.keep_alive, conn.version, framing)

    def _encode(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    def hold(self, data: bytes) -> None:
        """Keep ``data`` for the next ``write`` or ``write_eof``, which the caller makes without
        awaiting anything else first."""
        if self._conn is None:
            raise RuntimeError("write before prepare")
        if data:  # an empty chunk would end a chunked body
            self._held += self._encode(data)

    async def write(self, data: bytes) -> None:
        """Send ``data`` (and whatever was held). Nothing to send: nothing is written."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("write before prepare")
        if conn.closing:
            raise ConnectionResetError("the client went away")
        if data:  # an empty chunk would end a chunked body
            data = self._encode(data)
        if self._held:
            data, self._held = self._held + data, b""
        if not data:
            return
        conn.write(data)
        if conn.write_paused:
            await conn.drain()

    async def write_eof(self) -> None:
        """The end of the body, with whatever was held, in one write."""
        conn = self._conn
        if conn is None or self._done:
            return
        self._done = True
        data, self._held = self._held, b""
        if self._chunked:
            data += b"0\r\n\r\n"
        if data and not conn.closing:
            conn.write(data)
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


# Encoded header lines by the headers' items: the proxy answers with a few fixed sets (JSON,
# SSE, an error with Retry-After), so each set is encoded once, not on every answer.
_LINES: dict[tuple[tuple[str, object], ...], bytes] = {}
_MAX_LINES = 256  # sets kept; a caller with ever new values is encoded each time past it
_CONNECTION = {
    (False, "1.1"): b"Connection: close\r\n\r\n",
    (False, "1.0"): b"Connection: close\r\n\r\n",
    (True, "1.1"): b"\r\n",
    (True, "1.0"): b"Connection: keep-alive\r\n\r\n",
}


def _header_lines(headers: dict[str, str]) -> bytes:
    key = tuple(headers.items())
    try:
        lines = _LINES.get(key)
    except TypeError:  # a value that cannot be a key: encoded, not kept
        lines, key = None, None
    if lines is None:
        lines = b"".join(
            f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items()
        )
        if key is not None and len(_LINES) < _MAX_LINES:
            _LINES[key] = lines
    return lines


def encode_head(
    status: int, headers: dict[str, str], keep_alive: bool, version: str, extra: bytes = b""
) -> bytes:
    """The status line and headers of an answer (``extra``: pre-encoded header lines)."""
    line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d %b\r\n" % (status, _reason(status))
    end = _CONNECTION.get((keep_alive, version))
    if end is None:  # any other version string: as 1.1
        if not keep_alive:
            end = b"Connection: close\r\n\r\n"
        else:
            end = b"Connection: keep-alive\r\n\r\n" if version == "1.0" else b"\r\n"
    return b"".join((line, _date(), extra, _header_lines(headers), end))
