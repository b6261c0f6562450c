"""The upstream calls every flow makes on a prefill/decode pair, and what an attempt reports.

Runs in the proxy process, on its event loop. ``forward.py`` (the sequential, concurrent and
SGLang flows) and ``first_token.py`` (the first-token flow) build on this module and on nothing
of each other's: ``UpstreamCalls`` sends P's request and reads its answer, opens D's, maps every
upstream failure to a ``ProxyError`` and says which failures may go to another pair
(``RetryElsewhere``).

Invariants:
- Every call counts its server's outstanding requests and in-flight gauge up on entry and down
  on every exit (``enter`` / ``leave``).
- A failed connect ejects the server at once (the health tracker decides); only a failure that
  happened before anything reached the client is ever a ``RetryElsewhere``, and a 4xx never is.
- Every request's outcome reaches the health tracker (outlier detection): a 5xx, a timeout or
  a broken connection is a failure (``map_error`` / ``status_seen``), an answer read whole or a
  4xx a success; a request cancelled (the client left, the other leg failed) is neither.
- Retry rule (docs/proxy.md, "Faults"): D's request, the generation the client sees, goes to
  another server only when D cannot have read it (the connect failed; the upstream client
  itself re-sends only on a pooled connection found closed before writing). P's one-token
  prefill request is retried on another pair after any failure before the client got a byte,
  a connection dropped after the request was written included: it is idempotent by
  construction (its token is the client's only once P answered, D's request of that attempt
  is cancelled first, the retry has a new transfer id, and the KV P may hold under the old one
  is freed by D's ABORT or P's lease).
- ``PeerWatch``: while one leg's request is opened in the handler's task, the other leg runs as
  a task with the watch as its done-callback, or (first-token flow) is a response already
  written with the watch as its ``on_fail``; the other leg's failure interrupts this one's wait
  at once (``PeerFailed``) without a task or a wait of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.proxy import jsonio
from splitserve.proxy.config import ProxyConfig
from splitserve.proxy.errors import ProxyError, UpstreamError, UpstreamStatus, UpstreamTimeout
from splitserve.proxy.health import HealthTracker
from splitserve.proxy.http.client import UpstreamClient, UpstreamConnectError, UpstreamResponse
from splitserve.proxy.http.messages import Request
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend


@dataclass(slots=True)
class RequestOutcome:
    """What the request handler reports in the request metrics (status, error kind)."""

    status: int
    error_kind: str | None = None


@dataclass(slots=True)
class Call:
    """One client request as it goes through its attempts (the same for every pair tried)."""

    request: Request
    route: str  # "completions" or "chat"
    path: str  # the upstream path, e.g. /v1/completions
    body: dict[str, Any]
    stream: bool
    deadline: float  # loop time by which everything must be over
    outcome: RequestOutcome
    t_start: float  # loop time the request arrived


class RetryElsewhere(Exception):
    """An attempt failed before any byte reached the client and may go to another pair."""

    def __init__(self, error: ProxyError, failed: Backend, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.failed = failed
        self.reason = reason


class PeerFailed(Exception):
    """The other leg's task failed while this leg was being opened (the exception is the
    task's)."""


class PeerWatch:
    """A done-callback on the other leg's task (or the ``on_fail`` of its response) while this
    leg's request is opened in the handler's task (``UpstreamClient.post``'s ``on_response`` is
    ``attach``).

    The other leg failing fails this leg's wait at once (``UpstreamResponse.interrupt``), as
    awaiting both would, without a task of its own; the other leg succeeding records when
    (``done_at``: the handoff metric starts there). ``stop()`` as soon as this leg's answer is
    in: a callback the loop already scheduled must not touch a response being relayed."""

    __slots__ = ("loop", "task", "other", "active", "failed", "done_at", "response")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        task: asyncio.Future[Any] | None = None,
        other: UpstreamResponse | None = None,
    ) -> None:
        """Watch the other leg's ``task``, or (first-token flow) its response ``other``
        already written: only its failure counts then (``UpstreamResponse.on_fail``)."""
        self.loop = loop
        self.task = task
        self.other = other
        self.active = True
        self.failed = False
        self.done_at: float | None = None
        self.response: UpstreamResponse | None = None
        if task is not None:
            task.add_done_callback(self)
        if other is not None:
            other.on_fail = self.fail
            if other.error is not None:
                self.failed = True

    def __call__(self, task: asyncio.Future[Any]) -> None:
        if not self.active:
            return
        if task.cancelled() or task.exception() is None:
            self.done_at = self.loop.time()
            return
        self.fail()

    def fail(self) -> None:
        """The other leg failed: this leg's wait ends (``PeerFailed``)."""
        if not self.active:
            return
        self.failed = True
        if self.response is not None:
            self.response.interrupt(PeerFailed())

    def attach(self, response: UpstreamResponse) -> None:
        """The upstream client made this leg's response (once per connection it tries)."""
        self.response = response
        if self.failed:
            response.interrupt(PeerFailed())

    def stop(self) -> None:
        self.active = False
        if self.task is not None:
            self.task.remove_done_callback(self)
        if self.other is not None:
            self.other.on_fail = None


class UpstreamCalls:
    """P's and D's requests through the upstream client, with their metrics and error mapping.

    The public API the flows share: ``prefill``, ``open_decode``, ``map_error``,
    ``prefill_retry``, ``decode_error``, ``enter`` / ``leave``, and the settings and clock they
    read (``loop``, ``first_byte_s``, ``idle_s``, ``total_s``, ``metrics``)."""

    def __init__(
        self,
        config: ProxyConfig,
        client: UpstreamClient,
        tracker: HealthTracker,
        metrics: ProxyMetrics,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.client = client
        self.tracker = tracker
        self.metrics = metrics
        self.loop = loop
        t = config.timeouts
        self.first_byte_s = t.first_byte_s
        self.idle_s = t.stream_idle_s
        self.total_s = t.total_s

    # ------------------------------------------------------------------ bookkeeping

    def enter(self, b: Backend) -> Any:
        """Count a request to ``b`` in flight; returns the gauge to give to ``leave``."""
        b.outstanding += 1
        gauge = self.metrics.of(self.metrics.in_flight, *b.labels)
        gauge.inc()
        return gauge

    @staticmethod
    def leave(b: Backend, gauge: Any) -> None:
        b.outstanding -= 1
        gauge.dec()

    # ------------------------------------------------------------------ failures

    def status_seen(self, b: Backend, status: int) -> None:
        """``b`` answered ``status``: a 5xx is a failed request, anything else shows it alive."""
        if status >= 500:
            self.tracker.request_failed(b, f"answered {status}")
        else:
            self.tracker.request_succeeded(b)

    def succeeded(self, b: Backend) -> None:
        """``b``'s answer was read whole (a stream to its end)."""
        self.tracker.request_succeeded(b)

    def map_error(self, e: BaseException, b: Backend, what: str) -> UpstreamError:
        """A timeout or socket failure of server ``b`` while waiting for ``what``, as the
        ``ProxyError`` the client gets; the health tracker hears of it (a failed connect may
        eject at once, anything else counts towards outlier ejection)."""
        error = self._mapped(e, b, what)
        if not error.connect_failed:
            self.tracker.request_failed(b, error.message)
        return error

    def _mapped(self, e: BaseException, b: Backend, what: str) -> UpstreamError:
        where = f"{b.pool} server {b.url}"
        if isinstance(e, UpstreamConnectError) and e.timed_out:
            self.tracker.connect_failed(b, f"connect timeout: {e}")
            return UpstreamTimeout(
                f"{where}: connect timed out", pool=b.pool, server=b.url, connect_failed=True
            )
        if isinstance(e, TimeoutError):
            return UpstreamTimeout(
                f"{where}: timed out waiting for {what}", pool=b.pool, server=b.url
            )
        if isinstance(e, UpstreamConnectError):
            self.tracker.connect_failed(b, f"cannot connect: {e}")
            return UpstreamError(
                f"{where}: cannot connect ({e})",
                pool=b.pool,
                server=b.url,
                connect_failed=True,
            )
        return UpstreamError(f"{where}: {type(e).__name__} {e}".rstrip(), pool=b.pool, server=b.url)

    @staticmethod
    def prefill_retry(e: ProxyError, p: Backend) -> Exception:
        """P failed before anything reached the client: retry unless it refused the request."""
        if isinstance(e, UpstreamStatus) and e.status < 500:
            return e
        if isinstance(e, UpstreamError | UpstreamStatus):
            return RetryElsewhere(e, p, f"prefill_{e.kind}")
        return e

    def decode_error(self, e: BaseException, d: Backend, what: str) -> BaseException:
        """D failed before anything reached the client: retry a failed connect, else report."""
        if isinstance(e, ProxyError):
            return e
        if isinstance(e, TimeoutError | OSError):
            err = self.map_error(e, d, what)
            if err.connect_failed:
                return RetryElsewhere(err, d, "decode_connect")
            return err
        return e

    # ------------------------------------------------------------------ requests

    async def prefill(
        self,
        p: Backend,
        path: str,
        payload: dict[str, Any],
        deadline: float,
        on_response: Callable[[UpstreamResponse], None] | None = None,
    ) -> dict[str, Any]:
        """P's whole (one-token) answer as JSON, within ``first_byte_s``; raises a
        ``ProxyError`` (or ``PeerFailed`` through ``on_response``'s watch)."""
        loop = self.loop
        t0 = loop.time()
        gauge = self.enter(p)
        try:
            until = min(t0 + self.first_byte_s, deadline)
            body = jsonio.dumps(payload)
            try:
                resp = await self.client.post(p.url, path, body, until, on_response)
                try:
                    status, raw = resp.status, await resp.read()
                finally:
                    resp.release()  # read to the end: back to the pool; cancelled: closed
            except (TimeoutError, OSError) as e:
                raise self.map_error(e, p, "the prefill answer") from None
            if status != 200:
                self.status_seen(p, status)
                raise UpstreamStatus(status, raw, pool=p.pool, server=p.url)
            try:
                answer = jsonio.loads(raw)
            except (ValueError, RecursionError):
                self.tracker.request_failed(p, "invalid JSON")
                raise UpstreamError(
                    f"prefill server {p.url} answered invalid JSON", pool=p.pool, server=p.url
                ) from None
            if not isinstance(answer, dict):
                self.tracker.request_failed(p, "not a JSON object")
                raise UpstreamError(
                    f"prefill server {p.url} answered {type(answer).__name__}",
                    pool=p.pool,
                    server=p.url,
                )
            self.tracker.request_succeeded(p)
            elapsed = loop.time() - t0
            self.metrics.prefill.observe(elapsed)
            self.metrics.of(self.metrics.upstream, *p.labels).observe(elapsed)
            return answer
        finally:
            self.leave(p, gauge)

    async def open_decode(
        self,
        d: Backend,
        path: str,
        payload: dict[str, Any],
        stream: bool,
        until: float,
        watch: PeerWatch | None = None,
    ) -> tuple[UpstreamResponse, bytes]:
        """D's response with its first chunk (streaming) or its whole body (not), by loop time
        ``until`` (else ``TimeoutError``; ``PeerFailed`` when ``watch`` sees P fail)."""
        on_response = None if watch is None else watch.attach
        resp = await self.client.post(d.url, path, jsonio.dumps(payload), until, on_response)
        return resp, await self.decode_start(d, resp, stream)

    async def send_decode(
        self, d: Backend, path: str, payload: dict[str, Any], until: float
    ) -> UpstreamResponse:
        """D's request written (on a pooled connection at once, else once connected; errors
        as the upstream client's), without waiting for its answer: the caller goes on (P's
        request) and later reads it (``decode_start``) or closes it."""
        client = self.client
        conn = client.idle(d.url) or await client.connection(d.url, until)
        resp = client.response(until)
        client.send(conn, path, jsonio.dumps(payload), resp)
        return resp

    async def decode_start(self, d: Backend, resp: UpstreamResponse, stream: bool) -> bytes:
        """D's first chunk (streaming) or its whole body (not streaming, or not a 200), once
        its head is in, by ``resp.until``; ``resp`` is closed on any failure."""
        try:
            if not resp.headers_done:
                await resp.wait_head()
            if resp.status != 200 or not stream:
                raw = await resp.read()
                self.status_seen(d, resp.status)
                return raw
            return await resp.readany()
        except BaseException:
            resp.close()
            raise
