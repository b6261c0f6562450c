"""The client edge of the proxy's HTTP server: its limits, the framing rules that stop request
smuggling, and what a connection past ``max_connections`` gets.

Runs in the proxy process, on its event loop; ``server.py`` applies these to every connection.
Split from ``server.py`` so that the rules a reviewer checks (docs/security.md, docs/proxy.md
"Edge limits") sit in one short module.

Invariants:
- A request whose body length is ambiguous (``Content-Length`` with ``Transfer-Encoding``, two
  ``Content-Length`` headers even when equal, a ``Transfer-Encoding`` other than exactly
  ``chunked``, a ``Content-Length`` that is not a decimal number) is refused with 400 and its
  connection closed: a proxy and the server behind it must never disagree on where a request
  ends.
- A connection turned away for ``max_connections`` is answered 503 with ``Retry-After`` and
  closed within ``_TURN_AWAY_LINGER_S``; it is never parsed, and turned-away connections
  themselves are bounded (past the bound they are reset without an answer).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from splitserve.proxy.http.messages import ErrorResponse, encode_head

# How long a turned-away connection waits for the client's request before it closes (reading
# the request first lets the client read the 503 instead of a reset).
_TURN_AWAY_LINGER_S = 1.0
RETRY_AFTER_S = 1  # what an overloaded proxy asks a client to wait, in seconds


class Refused(Exception):
    """A request that cannot be served: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # told to the server's ``on_reject`` (a metric) when set


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """What one client connection may cost. Every timeout is per phase of a request and
    restarts with each request (docs/proxy.md, "Edge limits")."""

    max_body_bytes: int
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 30.0  # a request's first byte to its full head; accept to 1st byte
    body_timeout_s: float = 120.0  # the end of the head to the end of the body
    idle_timeout_s: float = 75.0  # an answered keep-alive connection to the next request's byte
    max_connections: int = 10_000  # client connections per server (per proxy process)


def framing_problem(headers: dict[bytes, bytes], repeats: int, version: str) -> str | None:
    """Why the body framing of a request is ambiguous, or None when it is sound.

    ``headers`` are lower-cased names with repeated values joined by ", "; ``repeats`` is how
    many ``Content-Length`` headers the request had."""
    length = headers.get(b"content-length")
    coding = headers.get(b"transfer-encoding")
    if repeats > 1:
        return "more than one Content-Length header"
    if coding is not None:
        if length is not None:
            return "both Content-Length and Transfer-Encoding"
        if coding.strip().lower() != b"chunked":
            return "Transfer-Encoding other than chunked"
        if version == "1.0":
            return "Transfer-Encoding in an HTTP/1.0 request"
    if length is not None and not (length.isdigit() and len(length) <= 18):
        return "invalid Content-Length"
    return None


def check_framing(
    headers: dict[bytes, bytes], repeats: int, version: str, limits: EdgeLimits
) -> None:
    """Raise ``Refused``: 400 for ambiguous framing (``framing_problem``), 413 for a declared
    length over ``limits.max_body_bytes``."""
    problem = framing_problem(headers, repeats, version)
    if problem is not None:
        raise Refused(400, f"ambiguous request body framing: {problem}", "bad_framing")
    length = headers.get(b"content-length")
    limit = limits.max_body_bytes
    if length is not None and int(length) > limit:
        raise Refused(
            413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes"
        )


class TurnAway(asyncio.Protocol):
    """A connection past ``max_connections``: answer 503 with ``Retry-After``, then close once
    the client's request head arrived (or after ``_TURN_AWAY_LINGER_S``)."""

    def __init__(
        self, error_response: ErrorResponse, registry: set[TurnAway], answer: bool = True
    ) -> None:
        self._answer = answer  # False: reset at once (too many are being turned away)
        self._error_response = error_response
        self._registry = registry
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if not self._answer:
            transport.abort()  # type: ignore[attr-defined]
            return
        self._registry.add(self)
        response = self._error_response(503, "too many connections to the proxy, retry later")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        length = b"Content-Length: %d\r\n" % len(response.body)
        transport.write(  # type: ignore[attr-defined]
            encode_head(503, response.headers, False, "1.1", length) + response.body
        )
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(_TURN_AWAY_LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:  # the head is read: closing now sends FIN, not a reset
            self.close()

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self._registry.discard(self)
        if self._timer is not None:
            self._timer.cancel()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
