"""One client request through a prefill/decode pair: dispatch, relay, retry.

Runs in the proxy process, on its event loop. The request bodies come from ``dispatch`` (the one
copy of each engine's protocol); the upstream calls from ``calls.UpstreamCalls``; the streamed
tail to the client from ``relay``. This module picks the pairs, retries, and runs each flow.

Flows:
- ``sequential`` (vLLM): P first (one token, not streamed), then D with P's
  ``kv_transfer_params``.
- ``concurrent`` (vLLM with SplitserveConnector, and SGLang): P and D at the same time; P's
  answer is awaited beside D's first byte so that a failing P is noticed while D waits for KV.
- vLLM ``concurrent`` with ``first_token_from_prefill`` (``first_token.FirstTokenFlow``): the
  client's first token is P's, sent when P answers; D continues from it. A request for one
  token goes to P alone; one whose stop string may span the seam (P's text ends with the start
  of one), or whose first token has no text, is served in the plain concurrent flow on the same
  pair after P answered (``stitch.plain_flow_reason``).

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
from typing import Any

from splitserve.proxy import dispatch, relay
from splitserve.proxy.aio import wait_any
from splitserve.proxy.calls import (
    Call,
    PeerFailed,
    PeerWatch,
    RequestOutcome,
    RetryElsewhere,
    UpstreamCalls,
)
from splitserve.proxy.config import ProxyConfig
from splitserve.proxy.errors import ProxyError, UpstreamError, UpstreamStatus
from splitserve.proxy.first_token import FirstTokenFlow, TakePlainFlow
from splitserve.proxy.health import HealthTracker
from splitserve.proxy.http.client import UpstreamClient, UpstreamResponse
from splitserve.proxy.http.messages import Request, Response, StreamResponse
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, Pool, prompt_head
from splitserve.proxy.stitch import first_token_eligible, max_new_tokens

logger = logging.getLogger(__name__)

# After D has answered, how long P's own (one-token) answer may still take to arrive.
_PREFILL_GRACE_S = 10.0


class Forwarder:
    """Pairs, dispatches and relays; owns no sockets of its own (the upstream client does)."""

    decider: Any = None  # decider.Decider, set by ProxyState when per-request decisions are on

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
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        # The loop this forwarder serves on, kept: on Python 3.11 each
        # ``asyncio.get_running_loop()`` is a getpid() system call (fork detection; see
        # docs/benchmarks.md, "A server of our own").
        self.loop = asyncio.get_running_loop()
        self.calls = UpstreamCalls(config, client, tracker, metrics, self.loop)
        self._mode = "sglang" if config.engine == "sglang" else f"vllm-{config.flow}"
        self._first_token = FirstTokenFlow(self.calls) if config.first_token_from_prefill else None

    # ------------------------------------------------------------------ entry point

    async def handle(
        self,
        request: Request,
        route: str,
        path: str,
        body: dict[str, Any],
        outcome: RequestOutcome,
    ) -> Response | StreamResponse:
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
            except RetryElsewhere as r:
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

    async def _attempt(self, call: Call, p: Backend, d: Backend) -> Response | StreamResponse:
        decider = self.decider
        if decider is not None and await decider.straight_to_decode(call.body, call.route, p, d):
            return await self._decode(call, dispatch.colocated_request(call.body), d)
        if self._mode == "vllm-sequential":
            return await self._sequential(call, p, d)
        flow = self._first_token
        if flow is not None and self._mode == "vllm-concurrent" and first_token_eligible(call.body):
            if max_new_tokens(call.body) == 1:
                # One token is P's whole job: P serves it alone, as a colocated server.
                return await self._decode(call, dispatch.colocated_request(call.body), p)
            try:
                return await flow.attempt(call, p, d)
            except TakePlainFlow as fallback:
                self.metrics.first_token_fallbacks.labels(fallback.reason).inc()
                logger.debug("request served in the plain flow: %s", fallback.reason)
        return await self._concurrent(call, p, d)

    async def _sequential(self, call: Call, p: Backend, d: Backend) -> Response | StreamResponse:
        """vLLM: P's one-token answer first, then D with P's ``kv_transfer_params``."""
        transfer_id = dispatch.new_transfer_id()
        # The id keys our connector's held KV and is the request id on P and D (what
        # NixlPushConnector pairs them by; NixlConnector ignores both).
        p_body = dispatch.vllm_sequential_prefill_request(call.body, transfer_id)
        try:
            answer = await self.calls.prefill(p, call.path, p_body, call.deadline)
        except ProxyError as e:
            raise self.calls.prefill_retry(e, p) from None
        try:
            d_body = dispatch.vllm_sequential_decode_request(call.body, answer, transfer_id)
        except dispatch.DispatchError as e:
            raise UpstreamError(str(e), pool="prefill", server=p.url) from None
        logger.debug("transfer %s: P %s done, D %s", transfer_id, p.url, d.url)
        return await self._decode(call, d_body, d, p_done=self.loop.time())

    async def _concurrent(self, call: Call, p: Backend, d: Backend) -> Response | StreamResponse:
        """vLLM concurrent or SGLang: P as a task, D opened in this task beside it."""
        body = call.body
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
        p_task = loop.create_task(self.calls.prefill(p, call.path, p_body, call.deadline))
        served = False
        try:
            response = await self._decode(call, d_body, d, (p, p_task))
            served = True
            return response
        finally:
            try:
                if served and not p_task.done():
                    # D answered, so P's prefill is over and its answer is on its way: let it
                    # arrive (cancelling would make P count an aborted transfer), within a bound.
                    await wait_any(min(loop.time() + _PREFILL_GRACE_S, call.deadline), p_task)
            finally:
                if not p_task.done():
                    p_task.cancel()  # D failed, or the client left: P aborts and frees its KV
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await p_task

    # ------------------------------------------------------------------ decode and relay

    async def _decode(
        self,
        call: Call,
        d_body: dict[str, Any],
        d: Backend,
        prefill: tuple[Backend, asyncio.Task[dict[str, Any]]] | None = None,
        p_done: float | None = None,
    ) -> Response | StreamResponse:
        """D's answer to the client; ``prefill``: P's request still running beside it."""
        calls = self.calls
        t0 = self.loop.time()
        gauge = calls.enter(d)
        resp: UpstreamResponse | None = None
        try:
            resp, first, p_done = await self._open(call, d_body, d, prefill, p_done, t0)
            if resp.status != 200:
                raise UpstreamStatus(resp.status, first, pool=d.pool, server=d.url)
            t_first = self.loop.time()
            if p_done is None and prefill is not None and prefill[1].done():
                p_done = t_first
            if p_done is not None:
                self.metrics.handoff.observe(max(0.0, t_first - p_done))
            # Committed from here: relay D's answer.
            if not call.stream:
                resp.release()  # read to the end: the connection goes back to the pool
                resp = None
                self.metrics.of(self.metrics.upstream, *d.labels).observe(t_first - t0)
                self.metrics.of(self.metrics.ttft, call.route).observe(t_first - call.t_start)
                call.outcome.status = 200
                return Response(first)
            out = relay.new_stream()
            try:
                await relay.commit(calls, call, out, first, more_now=resp.at_end)
                if await relay.pipe(calls, call, out, resp, d, t0):
                    resp = None
            except ConnectionError:  # a write to a client that went away
                relay.client_went_away(call.outcome, d)
            return out
        finally:
            if resp is not None:
                resp.close()
            calls.leave(d, gauge)

    async def _open(
        self,
        call: Call,
        d_body: dict[str, Any],
        d: Backend,
        prefill: tuple[Backend, asyncio.Task[dict[str, Any]]] | None,
        p_done: float | None,
        t0: float,
    ) -> tuple[UpstreamResponse, bytes, float | None]:
        """D's response and first chunk (whole body when not streaming), and when P was done.

        Until then nothing is committed and P, when still running, is watched: a failing P
        fails D's wait at once (no task for D: the watch is a callback on P's task)."""
        calls = self.calls
        wait_s = calls.first_byte_s if call.stream else calls.total_s
        until = min(call.deadline, t0 + wait_s)
        watch = None if prefill is None else PeerWatch(self.loop, prefill[1])
        try:
            resp, first = await calls.open_decode(d, call.path, d_body, call.stream, until, watch)
        except PeerFailed:
            assert prefill is not None
            p, p_task = prefill
            exc = p_task.exception()
            if isinstance(exc, ProxyError):
                raise calls.prefill_retry(exc, p) from None
            assert exc is not None  # the watch only fires on a failed task
            raise exc from None
        except (TimeoutError, OSError) as e:
            raise calls.decode_error(e, d, "the decode server's first byte") from None
        finally:
            if watch is not None:
                watch.stop()
        if watch is not None and watch.done_at is not None:
            p_done = watch.done_at
        return resp, first, p_done
