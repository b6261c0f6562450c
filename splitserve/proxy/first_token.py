"""One request through a vLLM pair with the first token from the prefill server.

Runs in the proxy process, on its event loop: ``FirstTokenFlow.attempt`` is called by
``Forwarder`` (``forward.py``) when the option ``first_token_from_prefill`` is on and the
request qualifies (``stitch.first_token_eligible``); it builds on ``calls.UpstreamCalls`` and
``relay``, as the other flows do. P and D get the request at the same time, as in the plain
concurrent flow, but D's ``kv_transfer_params`` say ``first_token_from_prefill``: D loads the KV
of every prompt token and continues from the token P sampled. So the client's first token is
P's, sent as soon as P answers (time to first token = P's prefill, like a colocated server),
and D's answer, rewritten by ``stitch``, follows from the second token.

Invariants:
- Before P answered nothing reaches the client; a failing P (or a failed connect to D, found
  before P's request is sent) is retried on another pair as in the plain flow, D's request
  cancelled first.
- When the first token ends the request (P stopped, or one token was asked for), D's request
  is cancelled (closing its connection makes vLLM abort it; D's connector then releases P's
  blocks) and the client gets P's token alone.
- A first token without text of its own (part of a split character), or a stop string that
  may begin in its text and end in D's (``stitch.plain_flow_reason``): D's request is
  cancelled and the request served in the plain concurrent flow (``TakePlainFlow``), where
  D's engine sees every output token, as a colocated server's does. Nothing reached the
  client before.
- Streaming: once the first token is sent the answer is committed; a later failure of D ends
  the stream with an SSE ``error`` event, as any mid-stream failure.

Cost: this is the default flow for vLLM, so it adds to the per-request path only what the
first token needs (P's answer parsed into a ``PrefillHead``, D's events rewritten by ``stitch``).
No task of its own: D's request is written first (at once on a pooled connection; a new
connection is made before P's request is sent, a round trip on a cold pool), then P's request
runs in the handler's task while D's answer comes into its response object; D's failure
interrupts P's wait through the response's ``on_fail`` (``calls.PeerWatch``), and no timer runs
beyond the upstream client's own unless D's answer is still to come.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from splitserve.proxy import dispatch, jsonio, relay, stitch
from splitserve.proxy.calls import Call, PeerFailed, PeerWatch, UpstreamCalls
from splitserve.proxy.errors import ProxyError, UpstreamError, UpstreamStatus
from splitserve.proxy.http.client import UpstreamResponse
from splitserve.proxy.http.messages import Response, StreamResponse
from splitserve.proxy.routing import Backend

logger = logging.getLogger(__name__)


class TakePlainFlow(Exception):
    """P answered, nothing reached the client, and this request must not continue from P's
    token (``reason``): D's request is cancelled and the caller serves it in the plain
    concurrent flow on the same pair (P's second prefill of the prompt hits its prefix cache)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FirstTokenFlow:
    """One attempt of the first-token flow on a pair, over ``UpstreamCalls``."""

    def __init__(self, calls: UpstreamCalls) -> None:
        self.calls = calls

    async def attempt(self, call: Call, p: Backend, d: Backend) -> Response | StreamResponse:
        """One attempt on the pair (p, d); raises ``RetryElsewhere`` / ``ProxyError`` before
        committing, ``TakePlainFlow`` when the request must be served without P's token."""
        calls = self.calls
        loop = calls.loop
        side = p.settings
        p_body, d_body = dispatch.vllm_concurrent_requests(
            call.body,
            dispatch.new_transfer_id(),
            side.side_host,
            side.side_channel_port,
            first_token_from_prefill=True,
        )
        t0 = loop.time()
        gauge = calls.enter(d)
        resp: UpstreamResponse | None = None
        try:
            # D's request first (no wait on a pooled connection), P's right after: D reads its
            # answer in while this task waits for P's (and only fails P's wait if it breaks).
            try:
                resp = await calls.send_decode(d, call.path, d_body, call.deadline)
            except (TimeoutError, OSError) as e:
                raise calls.decode_error(e, d, "the decode server") from None
            answer = await self._prefill(call, p, d, p_body, resp)
            p_done = loop.time()
            head = self._head(answer, call, p)
            if head.ends_request(call.body):
                resp.close()  # D aborts its request; its connector releases P's blocks
                return await self._token_alone(call, head, answer)
            reason = stitch.plain_flow_reason(call.body, head.text)
            if reason is not None:
                raise TakePlainFlow(reason)
            if not call.stream:
                raw = await self._whole(resp, d)
                return self._merged(call, head, resp, raw, d, p_done)
            # Phase 2 (streaming): the first token goes out now; the answer is committed.
            out = relay.new_stream()
            try:
                # D's answer already in: P's token goes out with D's first bytes (one write).
                events = head.head_events(call.body, last=False)
                await relay.commit(calls, call, out, events, more_now=_first_in(resp))
                first = await self._first_chunk(call, out, resp, d, p_done)
                if first is not None:
                    rewriter = stitch.StreamRewriter(head)
                    await relay.send(out, rewriter.feed(first), resp)
                    await relay.pipe(calls, call, out, resp, d, t0, rewriter)
            except ConnectionError:  # a write to a client that went away
                relay.client_went_away(call.outcome, d)
            return out
        finally:
            if resp is not None:
                resp.close()  # D's request ends unless its answer was read and released
            calls.leave(d, gauge)

    # ------------------------------------------------------------------ phase 1

    async def _prefill(
        self,
        call: Call,
        p: Backend,
        d: Backend,
        p_body: dict[str, Any],
        d_resp: UpstreamResponse,
    ) -> dict[str, Any]:
        """P's answer, awaited in this task while D's answer comes into ``d_resp``; D's
        failure before P answered interrupts the wait."""
        calls = self.calls
        watch = PeerWatch(calls.loop, other=d_resp)
        try:
            return await calls.prefill(p, call.path, p_body, call.deadline, watch.attach)
        except PeerFailed:
            exc = d_resp.error
            assert exc is not None  # the watch only fires on a failed answer
            raise calls.decode_error(exc, d, "the decode server") from None
        except ProxyError as e:
            raise calls.prefill_retry(e, p) from None
        finally:
            watch.stop()

    def _head(self, answer: dict[str, Any], call: Call, p: Backend) -> stitch.PrefillHead:
        """The client's first token from P's answer; a P that ended the request otherwise than
        by length or stop ("abort", "error") is a failed P."""
        try:
            head = stitch.PrefillHead.from_prefill_answer(answer, chat=call.route == "chat")
        except ValueError as e:
            raise UpstreamError(f"prefill server {p.url}: {e}", pool=p.pool, server=p.url) from e
        if head.finish_reason not in (None, "length", "stop"):
            raise self.calls.prefill_retry(
                UpstreamError(
                    f"prefill server {p.url} ended the request ({head.finish_reason})",
                    pool=p.pool,
                    server=p.url,
                ),
                p,
            )
        return head

    # ------------------------------------------------------------------ answers

    async def _token_alone(
        self, call: Call, head: stitch.PrefillHead, answer: dict[str, Any]
    ) -> Response | StreamResponse:
        """The first token ended the request: P's token is the whole answer."""
        calls = self.calls
        calls.metrics.of(calls.metrics.ttft, call.route).observe(calls.loop.time() - call.t_start)
        call.outcome.status = 200
        if not call.stream:
            return _json_answer(head.alone(answer))
        out = relay.new_stream()
        with contextlib.suppress(ConnectionError):
            await out.prepare(call.request)
            out.hold(head.head_events(call.body, last=True))
            await out.write_eof()  # one write: the head, the events and the end
        return out

    async def _whole(self, resp: UpstreamResponse, d: Backend) -> bytes:
        """D's whole answer (not streamed), within the deadline its request already carries."""
        try:
            return await self.calls.decode_start(d, resp, stream=False)
        except (TimeoutError, OSError) as e:
            raise self.calls.decode_error(e, d, "the decode server") from None

    def _merged(
        self,
        call: Call,
        head: stitch.PrefillHead,
        resp: UpstreamResponse,
        raw: bytes,
        d: Backend,
        p_done: float,
    ) -> Response:
        """P's token in front of D's whole answer."""
        resp.release()  # read to the end: the connection goes back to the pool
        if resp.status != 200:
            raise UpstreamStatus(resp.status, raw, pool=d.pool, server=d.url)
        try:
            merged = head.merge(jsonio.loads(raw))
        except (ValueError, TypeError, AttributeError, RecursionError):
            raise UpstreamError(
                f"decode server {d.url} answered invalid JSON", pool=d.pool, server=d.url
            ) from None
        metrics = self.calls.metrics
        now = self.calls.loop.time()
        metrics.handoff.observe(max(0.0, now - p_done))
        metrics.of(metrics.ttft, call.route).observe(now - call.t_start)
        call.outcome.status = 200
        return _json_answer(merged)

    async def _first_chunk(
        self,
        call: Call,
        out: StreamResponse,
        resp: UpstreamResponse,
        d: Backend,
        p_done: float,
    ) -> bytes | None:
        """D's first chunk after P's token was sent, within ``first_byte_s`` of P's answer; on
        a failure the client's stream gets an SSE ``error`` event and ``None``."""
        calls = self.calls
        if not _first_in(resp):  # else the usual case on a fast D: no timer to arm
            resp.until = min(call.deadline, p_done + calls.first_byte_s)
        try:
            first = await calls.decode_start(d, resp, stream=True)
        except (TimeoutError, OSError) as e:
            err = calls.map_error(e, d, "the decode server's first byte")
            call.outcome.error_kind = f"midstream_{err.kind}"
            await out.write(err.sse_event())
            return None
        if resp.status != 200:
            call.outcome.error_kind = "midstream_upstream_status"
            await out.write(
                UpstreamStatus(resp.status, first, pool=d.pool, server=d.url).sse_event()
            )
            return None
        calls.metrics.handoff.observe(max(0.0, calls.loop.time() - p_done))
        return first


def _first_in(resp: UpstreamResponse) -> bool:
    """What ``decode_start`` reads of D's answer is in (the head and first bytes of a 200, the
    whole of any other answer, or the failure): reading it waits not."""
    if not resp.headers_done:
        return resp.error is not None
    if resp.status == 200:
        return resp.ready
    return resp.complete or resp.error is not None


def _json_answer(data: dict[str, Any]) -> Response:
    # orjson (jsonio) rather than json.dumps: this is every request's answer.
    return Response(jsonio.dumps(data))
