"""One client request through a prefill/decode pair: dispatch, relay, retry.

Runs in the proxy process, on its event loop. The request bodies come from ``dispatch`` (the one
copy of each engine's protocol); this module only moves them and D's answer.

Flows:
- ``sequential`` (vLLM): P first (one token, not streamed), then D with P's
  ``kv_transfer_params``.
- ``concurrent`` (vLLM with SplitserveConnector, and SGLang): P and D at the same time; P's
  answer is awaited beside D's first byte so that a failing P is noticed while D waits for KV.
- vLLM ``concurrent`` with ``first_token_from_prefill`` (``first_token.py``): the client's
  first token is P's, sent when P answers; D continues from it. A request for one token goes
  to P alone; one whose stop string may span the seam (P's text ends with the start of one),
  or whose first token has no text, is served in the plain concurrent flow on the same pair
  after P answered (``stitch.plain_flow_reason``).

Invariants:
- Nothing is sent to the client before D's first body byte (or D's full answer when not
  streaming). Until then a failure of P (any kind) or a failed connect to D is retried on another
  pair with a new transfer id, at most ``retries.max_attempts`` pairs; after it, never.
- D's stream is relayed chunk by chunk as it arrives, unparsed, so usage counts are D's
  (first-token flow: parsed and rewritten per event by ``stitch``, usage counting P's token).
- Every upstream response is closed on every exit path; a client that goes away (the handler is
  cancelled, or a write fails) closes both upstream connections, so the engines abort the request
  and free its KV.
- Every failure reaches the client as a ``ProxyError`` (OpenAI error body, 4xx/5xx status)
  before streaming, or as an SSE ``error`` event after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from splitserve.proxy import dispatch, first_token, jsonio
from splitserve.proxy.config import ProxyConfig
from splitserve.proxy.errors import (
    ProxyError,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
)
from splitserve.proxy.health import HealthTracker
from splitserve.proxy.http_server import SSE_HEADERS, Request, Response, StreamResponse
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, Pool, prompt_head
from splitserve.proxy.stitch import first_token_eligible, max_new_tokens
from splitserve.proxy.upstream import UpstreamClient, UpstreamConnectError, UpstreamResponse

logger = logging.getLogger(__name__)

# After D has answered, how long P's own (one-token) answer may still take to arrive.
_PREFILL_GRACE_S = 10.0


class _Retry(Exception):
    """An attempt failed before any byte reached the client and may go to another pair."""

    def __init__(self, error: ProxyError, failed: Backend, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.failed = failed
        self.reason = reason


@dataclass
class Outcome:
    """What the handler reports in the request metrics."""

    status: int
    error_kind: str | None = None


@dataclass
class Call:
    """One client request as it goes through its attempts (the same for every pair tried)."""

    request: Request
    route: str  # "completions" or "chat"
    path: str  # the upstream path, e.g. /v1/completions
    body: dict[str, Any]
    stream: bool
    deadline: float  # loop time by which everything must be over
    outcome: Outcome
    t_start: float  # loop time the request arrived


class Forwarder:
    """Pairs, dispatches and relays; owns no sockets of its own (the upstream client does)."""

    def __init__(
        self,
        config: ProxyConfig,
        client: UpstreamClient,
        prefill: Pool,
        decode: Pool,
        tracker: HealthTracker,
        metrics: ProxyMetrics,
    ) -> None:
        self.config = config
        self.client = client
        self.prefill = prefill
        self.decode = decode
        self.tracker = tracker
        self.metrics = metrics
        t = config.timeouts
        self._first_byte_s = t.first_byte_s
        self._idle_s = t.stream_idle_s
        self._mode = "sglang" if config.engine == "sglang" else f"vllm-{config.flow}"
        self._first_token = bool(config.first_token_from_prefill)
        # The loop this forwarder serves on, kept: on Python 3.11 each
        # ``asyncio.get_running_loop()`` is a getpid() system call (fork detection), and the
        # hot path asked for it eight times per request.
        self.loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ entry point

    async def handle(
        self, request: Request, route: str, path: str, body: dict[str, Any], outcome: Outcome
    ) -> StreamResponse:
        """Serve one request; raises ``ProxyError`` for anything answered before streaming."""
        t_start = self.loop.time()
        call = Call(
            request,
            route,
            path,
            body,
            bool(body.get("stream")),
            t_start + self.config.timeouts.total_s,
            outcome,
            t_start,
        )
        routing = self.config.routing
        key = prompt_head(body, routing.prefix_chars) if routing.prefix_affinity else None
        failed: list[Backend] = []
        last: ProxyError | None = None
        for attempt in range(self.config.retries.max_attempts):
            try:
                p = self.prefill.pick(key, exclude=failed)
                d = self.decode.pick(None, exclude=failed)
            except ProxyError:
                if last is not None:
                    raise last from None
                raise
            try:
                return await self._attempt(call, p, d)
            except _Retry as r:
                last = r.error
                failed.append(r.failed)
                if attempt + 1 < self.config.retries.max_attempts:
                    self.metrics.retries.labels(r.reason).inc()
                    logger.warning(
                        "retrying on another pair after %s: %s", r.reason, r.error.message
                    )
        assert last is not None
        raise last

    # ------------------------------------------------------------------ one attempt

    async def _attempt(self, call: Call, p: Backend, d: Backend) -> StreamResponse:
        path, body, deadline = call.path, call.body, call.deadline
        if self._mode == "vllm-sequential":
            tid = dispatch.new_transfer_id()
            # The id keys our connector's held KV and is the request id on P and D (what
            # NixlPushConnector pairs them by; NixlConnector ignores both).
            p_body = dispatch.vllm_sequential_prefill_request(body, tid)
            try:
                answer = await self._prefill(p, path, p_body, deadline)
            except ProxyError as e:
                raise self._prefill_retry(e, p) from None
            try:
                d_body = dispatch.vllm_sequential_decode_request(body, answer, tid)
            except dispatch.DispatchError as e:
                raise UpstreamError(str(e), pool="prefill", server=p.url) from None
            logger.debug("transfer %s: P %s done, D %s", tid, p.url, d.url)
            p_done = self.loop.time()
            return await self._decode(call, d_body, d, None, p_done)

        if self._mode == "vllm-concurrent" and self._first_token and first_token_eligible(body):
            if max_new_tokens(body) == 1:
                # One token is P's whole job: P serves it alone, as a colocated server.
                return await self._decode(call, dispatch.colocated_request(body), p, None, None)
            try:
                return await first_token.attempt(self, call, p, d)
            except first_token.TakePlainFlow as fallback:
                self.metrics.first_token_fallbacks.labels(fallback.reason).inc()
                logger.debug("request served in the plain flow: %s", fallback.reason)

        if self._mode == "vllm-concurrent":
            side = p.settings
            p_body, d_body = dispatch.vllm_concurrent_requests(
                body, dispatch.new_transfer_id(), side.side_host, side.side_channel_port
            )
        else:
            ep = p.settings
            p_body, d_body = dispatch.sglang_requests(
                body, ep.bootstrap_at, ep.bootstrap_port, dispatch.new_bootstrap_room()
            )
        loop = self.loop
        p_task = loop.create_task(self._prefill(p, path, p_body, deadline))
        served = False
        try:
            response = await self._decode(call, d_body, d, (p, p_task), None)
            served = True
            return response
        finally:
            try:
                if served and not p_task.done():
                    # D answered, so P's prefill is over and its answer is on its way: let it
                    # arrive (cancelling would make P count an aborted transfer), within a bound.
                    await _wait_any(min(loop.time() + _PREFILL_GRACE_S, deadline), p_task)
            finally:
                if not p_task.done():
                    p_task.cancel()  # D failed, or the client left: P aborts and frees its KV
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await p_task

    def _prefill_retry(self, e: ProxyError, p: Backend) -> Exception:
        """P failed before anything reached the client: retry unless it refused the request."""
        if isinstance(e, UpstreamStatus) and e.status < 500:
            return e
        if isinstance(e, UpstreamError | UpstreamStatus):
            return _Retry(e, p, f"prefill_{e.kind}")
        return e

    # ------------------------------------------------------------------ upstream calls

    def _map_error(self, e: BaseException, b: Backend, what: str) -> UpstreamError:
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

    async def _prefill(
        self, p: Backend, path: str, payload: dict[str, Any], deadline: float
    ) -> dict[str, Any]:
        """P's whole (one-token) answer as JSON; raises a ``ProxyError``."""
        loop = self.loop
        t0 = loop.time()
        p.outstanding += 1
        gauge = self.metrics.of(self.metrics.in_flight, *p.labels)
        gauge.inc()
        try:
            try:
                until = min(t0 + self._first_byte_s, deadline)
                status, raw = await self._post_read(p, path, payload, until)
            except ProxyError:
                raise
            except (TimeoutError, OSError) as e:
                raise self._map_error(e, p, "the prefill answer") from None
            if status != 200:
                raise UpstreamStatus(status, raw, pool=p.pool, server=p.url)
            try:
                answer = jsonio.loads(raw)
            except (ValueError, RecursionError):
                raise UpstreamError(
                    f"prefill server {p.url} answered invalid JSON", pool=p.pool, server=p.url
                ) from None
            if not isinstance(answer, dict):
                raise UpstreamError(
                    f"prefill server {p.url} answered {type(answer).__name__}",
                    pool=p.pool,
                    server=p.url,
                )
            elapsed = loop.time() - t0
            self.metrics.prefill.observe(elapsed)
            self.metrics.of(self.metrics.upstream, *p.labels).observe(elapsed)
            return answer
        finally:
            p.outstanding -= 1
            gauge.dec()

    async def _post_read(
        self, b: Backend, path: str, payload: dict[str, Any], until: float
    ) -> tuple[int, bytes]:
        """Status and whole body; ``TimeoutError`` unless both came by loop time ``until``."""
        resp = await self.client.post(b.url, path, jsonio.dumps(payload), until)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()  # read to the end: back to the pool; cancelled: closed

    async def _open_decode(
        self,
        d: Backend,
        path: str,
        payload: dict[str, Any],
        stream: bool,
        until: float,
        watch: _PrefillWatch | None = None,
    ) -> tuple[UpstreamResponse, bytes]:
        """D's response with its first chunk (streaming) or its whole body (not), by loop time
        ``until`` (else ``TimeoutError``; ``_PrefillFailed`` when ``watch`` sees P fail)."""
        on_response = None if watch is None else watch.attach
        resp = await self.client.post(d.url, path, jsonio.dumps(payload), until, on_response)
        try:
            if resp.status != 200 or not stream:
                return resp, await resp.read()
            return resp, await resp.readany()
        except BaseException:
            resp.close()
            raise

    # ------------------------------------------------------------------ decode and relay

    async def _decode(
        self,
        call: Call,
        d_body: dict[str, Any],
        d: Backend,
        prefill: tuple[Backend, asyncio.Future[dict[str, Any]]] | None,
        p_done: float | None,
    ) -> StreamResponse:
        route, stream, deadline, outcome = call.route, call.stream, call.deadline, call.outcome
        loop = self.loop
        t0 = loop.time()
        d.outstanding += 1
        gauge = self.metrics.of(self.metrics.in_flight, *d.labels)
        gauge.inc()
        resp: UpstreamResponse | None = None
        # Phase 1: until D's first byte, nothing is committed and P is watched: a failing P
        # fails D's wait at once (no task for D: the watch is a callback on P's task).
        wait_s = self._first_byte_s if stream else self.config.timeouts.total_s
        until = min(deadline, t0 + wait_s)
        watch: _PrefillWatch | None = None
        if prefill is not None:
            watch = _PrefillWatch(loop)
            prefill[1].add_done_callback(watch)
        try:
            try:
                resp, first = await self._open_decode(d, call.path, d_body, stream, until, watch)
            except _PrefillFailed:
                assert prefill is not None
                p, p_task = prefill
                exc = p_task.exception()
                if isinstance(exc, ProxyError):
                    raise self._prefill_retry(exc, p) from None
                assert exc is not None  # the watch only fires on a failed task
                raise exc from None
            except ProxyError:
                raise
            except (TimeoutError, OSError) as e:
                err = self._map_error(e, d, "the decode server's first byte")
                if err.connect_failed:
                    raise _Retry(err, d, "decode_connect") from None
                raise err from None
            finally:
                if prefill is not None and watch is not None:
                    watch.active = False
                    prefill[1].remove_done_callback(watch)
            if watch is not None and watch.done_at is not None:
                p_done = watch.done_at
            if resp.status != 200:
                raise UpstreamStatus(resp.status, first, pool=d.pool, server=d.url)
            t_first = loop.time()
            if p_done is None and prefill is not None and prefill[1].done():
                p_done = t_first
            if p_done is not None:
                self.metrics.handoff.observe(max(0.0, t_first - p_done))

            # Phase 2: committed. Relay D's answer.
            if not stream:
                resp.release()  # read to the end: the connection goes back to the pool
                resp = None
                self.metrics.of(self.metrics.upstream, *d.labels).observe(t_first - t0)
                self.metrics.of(self.metrics.ttft, route).observe(t_first - call.t_start)
                outcome.status = 200
                return Response(first)
            out = StreamResponse(status=200, headers=SSE_HEADERS)
            try:
                await out.prepare(call.request)
                await out.write(first)
                self.metrics.of(self.metrics.ttft, route).observe(loop.time() - call.t_start)
                outcome.status = 200
                if await self._relay(resp, out, d, outcome, deadline):
                    resp.release()
                    resp = None
                self.metrics.of(self.metrics.upstream, *d.labels).observe(loop.time() - t0)
                await out.write_eof()
            except ConnectionError:  # a write to a client that went away
                outcome.status, outcome.error_kind = 499, "client_disconnected"
                logger.info("client went away mid-stream; closing %s", d.url)
            return out
        finally:
            if resp is not None:
                resp.close()
            d.outstanding -= 1
            gauge.dec()

    async def _relay(
        self,
        resp: UpstreamResponse,
        out: StreamResponse,
        d: Backend,
        outcome: Outcome,
        deadline: float,
        rewrite: Callable[[bytes], bytes] | None = None,
    ) -> bool:
        """Copy D's stream to the client as it comes (through ``rewrite`` when given: the
        first-token flow's ``stitch.StreamRewriter``); True when it ended cleanly.

        Each read waits at most ``stream_idle_s`` (and never past the request's deadline). An
        upstream failure ends the client's stream with an SSE ``error`` event (the status line
        is already sent, so the status cannot change any more).
        """
        loop = self.loop
        idle = self._idle_s
        while True:
            try:
                now = loop.time()
                if now >= deadline:
                    raise TimeoutError
                resp.until = min(now + idle, deadline)  # a timer only if the read must wait
                chunk = await resp.readany()
            except (TimeoutError, OSError) as e:
                err = self._map_error(e, d, "the next chunk")
                outcome.error_kind = f"midstream_{err.kind}"
                logger.warning("decode stream broke: %s", err.message)
                await out.write(err.sse_event())
                return False
            if not chunk:
                return True
            if rewrite is not None:
                chunk = rewrite(chunk)
                if not chunk:
                    continue
            await out.write(chunk)


class _PrefillFailed(Exception):
    """P's task failed while D was being opened (the exception is the task's)."""


class _PrefillWatch:
    """A done-callback on P's task while the decode request is opened in the same task.

    P failing fails D's wait at once (``UpstreamResponse.interrupt``), as awaiting both would,
    without a task of its own for D; P succeeding records when (the handoff metric starts
    there). ``active`` is cleared as soon as D's first byte is in: a callback the loop already
    scheduled must not touch a response that is being relayed."""

    __slots__ = ("loop", "active", "failed", "done_at", "response")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.active = True
        self.failed = False
        self.done_at: float | None = None
        self.response: UpstreamResponse | None = None

    def __call__(self, task: asyncio.Future[Any]) -> None:
        if not self.active:
            return
        if task.cancelled() or task.exception() is None:
            self.done_at = self.loop.time()
            return
        self.failed = True
        if self.response is not None:
            self.response.interrupt(_PrefillFailed())

    def attach(self, response: UpstreamResponse) -> None:
        """The upstream client made D's response (once per connection it tries)."""
        self.response = response
        if self.failed:
            response.interrupt(_PrefillFailed())


async def _wait_any(when: float, *futures: asyncio.Future[Any]) -> bool:
    """Until one of ``futures`` is done (True) or loop time ``when`` (False); none is cancelled.

    ``asyncio.wait(..., return_when=FIRST_COMPLETED)`` for a fixed few futures, without the
    sets, type checks and result sets it builds on every call (it was a few per cent of the
    proxy's CPU per request in the concurrent flows)."""
    if any(f.done() for f in futures):
        return True
    loop = futures[0].get_loop()
    waiter: asyncio.Future[bool] = loop.create_future()

    def wake(_: object, result: bool = True) -> None:
        if not waiter.done():
            waiter.set_result(result)

    for f in futures:
        f.add_done_callback(wake)
    timer = loop.call_at(when, wake, None, False)
    try:
        return await waiter
    finally:
        timer.cancel()
        for f in futures:
            f.remove_done_callback(wake)


if sys.version_info >= (3, 11):

    async def _within(aw: Awaitable[Any], when: float) -> Any:
        """Await ``aw`` until loop time ``when``; TimeoutError after (no extra task)."""
        async with asyncio.timeout_at(when):
            return await aw

else:  # pragma: no cover - Python 3.10

    async def _within(aw: Awaitable[Any], when: float) -> Any:
        remaining = max(0.0, when - asyncio.get_running_loop().time())
        return await asyncio.wait_for(aw, remaining)
