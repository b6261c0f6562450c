"""Errors the proxy answers with, each mapped to an HTTP status and an OpenAI-style body.

Runs in the proxy process. Invariant: every failure a client can see is a ``ProxyError`` with a
status below 500 for the client's own mistakes (bad JSON, missing fields, oversized body, bad
key) and 502/503/504 for upstream trouble; ``kind`` is the label the error metrics use.
"""

from __future__ import annotations

from typing import Any

from splitserve.proxy import jsonio


def error_body(
    message: str, err_type: str, code: int | str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The body shape OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ProxyError(Exception):
    """A failure answered to the client with ``status`` and an OpenAI error body."""

    status = 500
    err_type = "internal_error"
    kind = "internal"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)

    def sse_event(self) -> bytes:
        """The error as the SSE event that ends a stream already under way (the status line is
        sent, so only the body can tell; OpenAI SDKs raise ``APIError`` on it)."""
        return b"data: " + jsonio.dumps({"error": self.body()["error"]}) + b"\n\n"


# The errors a client can cause, and "no server to send it to": one line each (status, OpenAI
# error type, metrics label).
class BadRequest(ProxyError):
    status, err_type, kind = 400, "invalid_request_error", "bad_request"


class Unauthorized(ProxyError):
    status, err_type, kind = 401, "authentication_error", "unauthorized"


class PayloadTooLarge(ProxyError):
    status, err_type, kind = 413, "invalid_request_error", "too_large"


class NoHealthyServer(ProxyError):
    status, err_type, kind = 503, "service_unavailable", "no_healthy_server"


class UpstreamError(ProxyError):
    """An upstream server failed (could not connect, broke the connection, or answered 5xx)."""

    status = 502
    err_type = "upstream_error"
    kind = "upstream"

    def __init__(
        self, message: str, *, pool: str, server: str, connect_failed: bool = False
    ) -> None:
        super().__init__(message)
        self.pool = pool
        self.server = server
        self.connect_failed = connect_failed


class UpstreamTimeout(UpstreamError):
    status, err_type, kind = 504, "timeout", "timeout"


class UpstreamStatus(ProxyError):
    """An upstream answered with an error status; relayed with that status and its body."""

    kind = "upstream_status"

    def __init__(self, status: int, raw_body: bytes, *, pool: str, server: str) -> None:
        self.status = status
        self.raw_body = raw_body
        self.pool = pool
        self.server = server
        super().__init__(f"{pool} server {server} answered {status}")

    def body(self) -> dict[str, Any]:
        try:
            parsed = jsonio.loads(self.raw_body)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
        if isinstance(parsed, dict) and "message" in parsed:  # vLLM's ErrorResponse, flat
            return {"error": parsed}
        text = self.raw_body.decode("utf-8", "replace")[:1000]
        err_type = "invalid_request_error" if self.status < 500 else "upstream_error"
        return error_body(f"{self.message}: {text}", err_type, self.status)
