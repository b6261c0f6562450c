"""One request through a vLLM pair with the first token from the prefill server.

Runs in the proxy process, on its event loop, for ``Forwarder`` (``forward.py``) when the
option ``first_token_from_prefill`` is on and the request qualifies
(``stitch.first_token_eligible``). P and D get the request at the same time, as in the plain
concurrent flow, but D's ``kv_transfer_params`` say ``first_token_from_prefill``: D loads the KV
of every prompt token and continues from the token P sampled. So the client's first token is
P's, sent as soon as P answers (time to first token = P's prefill, like a colocated server),
and D's answer, rewritten by ``stitch``, follows from the second token.

Invariants:
- Before P answered nothing reaches the client; a failing P (or a failed connect to D) is
  retried on another pair as in the plain flow, D's request cancelled first.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from splitserve.proxy import dispatch, jsonio, stitch
from splitserve.proxy.errors import ProxyError, UpstreamError, UpstreamStatus, UpstreamTimeout
from splitserve.proxy.http_server import SSE_HEADERS, Response, StreamResponse
from splitserve.proxy.upstream import UpstreamResponse

if TYPE_CHECKING:
    from splitserve.proxy.forward import Call, Forwarder
    from splitserve.proxy.routing import Backend

logger = logging.getLogger(__name__)


class TakePlainFlow(Exception):
    """P answered, nothing reached the client, and this request must not continue from P's
    token (``reason``): D's request is cancelled and the caller serves it in the plain
    concurrent flow on the same pair (P's second prefill of the prompt hits its prefix cache)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def attempt(fw: Forwarder, call: Call, p: Backend, d: Backend) -> StreamResponse:
    """One attempt on the pair (p, d); raises ``_Retry`` / ``ProxyError`` before committing,
    ``TakePlainFlow`` when the request must be served without P's token."""
    from splitserve.proxy.forward import _Retry, _wait_any, _within

    request, route, path, body = call.request, call.route, call.path, call.body
    stream, deadline, outcome, t_start = call.stream, call.deadline, call.outcome, call.t_start

    loop = fw.loop
    side = p.settings
    p_body, d_body = dispatch.vllm_concurrent_requests(
        body,
        dispatch.new_transfer_id(),
        side.side_host,
        side.side_channel_port,
        first_token_from_prefill=True,
    )
    p_task = loop.create_task(fw._prefill(p, path, p_body, deadline))
    t0 = loop.time()
    d.outstanding += 1
    gauge = fw.metrics.of(fw.metrics.in_flight, *d.labels)
    gauge.inc()
    open_task = loop.create_task(fw._open_decode(d, path, d_body, stream, deadline))
    resp: UpstreamResponse | None = None
    try:
        # Phase 1: P's answer; D connects meanwhile (and only fails early if it cannot).
        until = min(deadline, t0 + fw._first_byte_s)
        while not p_task.done():
            # Both while D is connecting (it only fails early if it cannot), then P alone.
            watched = (p_task,) if open_task.done() else (p_task, open_task)
            if not await _wait_any(until, *watched):
                raise UpstreamTimeout(
                    f"prefill server {p.url}: timed out waiting for the prefill answer",
                    pool=p.pool,
                    server=p.url,
                )
            if open_task.done() and not open_task.cancelled() and open_task.exception():
                raise _decode_error(fw, open_task.exception(), d, _Retry)
        exc = p_task.exception()
        if exc is not None:
            if isinstance(exc, ProxyError):
                raise fw._prefill_retry(exc, p)
            raise exc
        answer = p_task.result()
        p_done = loop.time()
        try:
            head = stitch.FirstToken.from_prefill_answer(answer, chat=route == "chat")
        except ValueError as e:
            raise UpstreamError(f"prefill server {p.url}: {e}", pool=p.pool, server=p.url) from e
        if head.finish_reason not in (None, "length", "stop"):  # "abort", "error"
            raise fw._prefill_retry(
                UpstreamError(
                    f"prefill server {p.url} ended the request ({head.finish_reason})",
                    pool=p.pool,
                    server=p.url,
                ),
                p,
            )

        if head.ends_request(body):
            open_task.cancel()  # D aborts its request; its connector releases P's blocks
            fw.metrics.of(fw.metrics.ttft, route).observe(loop.time() - t_start)
            outcome.status = 200
            if not stream:
                return _json_answer(head.alone(answer))
            out = StreamResponse(status=200, headers=SSE_HEADERS)
            with contextlib.suppress(ConnectionError):
                await out.prepare(request)
                await out.write(head.head_events(body, last=True))
                await out.write_eof()
            return out

        plain_reason = stitch.plain_flow_reason(body, head.text)
        if plain_reason is not None:
            raise TakePlainFlow(plain_reason)

        if not stream:
            try:
                resp, raw = await _within(open_task, deadline)
            except ProxyError:
                raise
            except (TimeoutError, OSError) as e:
                raise _decode_error(fw, e, d, _Retry) from None
            resp.release()  # read to the end: the connection goes back to the pool
            if resp.status != 200:
                raise UpstreamStatus(resp.status, raw, pool=d.pool, server=d.url)
            try:
                merged = head.merge(jsonio.loads(raw))
            except (ValueError, TypeError, AttributeError, RecursionError):
                raise UpstreamError(
                    f"decode server {d.url} answered invalid JSON", pool=d.pool, server=d.url
                ) from None
            fw.metrics.handoff.observe(max(0.0, loop.time() - p_done))
            fw.metrics.of(fw.metrics.ttft, route).observe(loop.time() - t_start)
            outcome.status = 200
            return _json_answer(merged)

        # Phase 2 (streaming): the first token goes out now; the answer is committed.
        out = StreamResponse(status=200, headers=SSE_HEADERS)
        try:
            await out.prepare(request)
            await out.write(head.head_events(body, last=False))
            fw.metrics.of(fw.metrics.ttft, route).observe(loop.time() - t_start)
            outcome.status = 200
            rewriter = stitch.StreamRewriter(head)
            try:
                resp, first = await _within(open_task, min(deadline, p_done + fw._first_byte_s))
            except (TimeoutError, OSError) as e:
                err = fw._map_error(e, d, "the decode server's first byte")
                outcome.error_kind = f"midstream_{err.kind}"
                await out.write(_error_event(err.body()["error"]))
                return out
            if resp.status != 200:
                err_status = UpstreamStatus(resp.status, first, pool=d.pool, server=d.url)
                outcome.error_kind = "midstream_upstream_status"
                await out.write(_error_event(err_status.body()["error"]))
                return out
            fw.metrics.handoff.observe(max(0.0, loop.time() - p_done))
            await out.write(rewriter.feed(first))
            clean = await fw._relay(resp, out, d, outcome, deadline, rewrite=rewriter.feed)
            rest = rewriter.flush()
            if rest:
                await out.write(rest)
            if clean:
                resp.release()
                resp = None
            fw.metrics.of(fw.metrics.upstream, *d.labels).observe(loop.time() - t0)
            await out.write_eof()
        except ConnectionError:  # a write to a client that went away
            outcome.status, outcome.error_kind = 499, "client_disconnected"
            logger.info("client went away mid-stream; closing %s", d.url)
        return out
    finally:
        if not open_task.done():
            open_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            opened, _ = await open_task
            if resp is None:
                opened.close()  # opened, never used (the first token ended the request)
        if resp is not None:
            resp.close()
        if not p_task.done():
            p_task.cancel()  # D or the client failed first: P aborts and frees its KV
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await p_task
        d.outstanding -= 1
        gauge.dec()


def _decode_error(fw: Forwarder, e: BaseException, d: Backend, retry_cls) -> Exception:
    """D failed before anything reached the client: retry a failed connect, else report."""
    if isinstance(e, ProxyError):
        return e
    if isinstance(e, TimeoutError | OSError):
        err = fw._map_error(e, d, "the decode server")
        if err.connect_failed:
            return retry_cls(err, d, "decode_connect")
        return err
    return e


def _json_answer(data: dict[str, Any]) -> Response:
    # orjson (jsonio) rather than json_response's json.dumps: this is every request's answer.
    return Response(jsonio.dumps(data))


def _error_event(error: dict[str, Any]) -> bytes:
    return b"data: " + jsonio.dumps({"error": error}) + b"\n\n"
