"""D's streamed answer to the client, from the commit to the end of the stream: the one copy of
that tail for every flow (``forward.py``'s and ``first_token.py``'s).

Runs in the proxy process, on its event loop, in the request handler's task.

Invariants:
- ``commit`` is the point of no return: the status line (200) and the first bytes go out, the
  time to first token is observed and the outcome becomes 200. No retry after it.
- D's stream is copied chunk by chunk as it arrives (through the first-token flow's
  ``stitch.StreamRewriter`` when given, else unparsed); each read waits at most
  ``stream_idle_s`` and never past the request's deadline.
- An upstream failure after the commit ends the client's stream with an SSE ``error`` event
  (the status cannot change any more); a client that went away (``ConnectionError`` on a
  write) is the outcome 499, and the caller closes D's response so D aborts the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from splitserve.proxy.calls import Call, RequestOutcome, UpstreamCalls
from splitserve.proxy.http.client import UpstreamResponse
from splitserve.proxy.http.messages import SSE_HEADERS, StreamResponse
from splitserve.proxy.routing import Backend
from splitserve.proxy.stitch import StreamRewriter

logger = logging.getLogger(__name__)


def new_stream() -> StreamResponse:
    """The client's SSE answer (not yet sent)."""
    return StreamResponse(status=200, headers=SSE_HEADERS)


async def commit(
    calls: UpstreamCalls, call: Call, out: StreamResponse, first: bytes, more_now: bool = False
) -> None:
    """Send the status line and ``first`` (the client's first bytes: D's first chunk, or P's
    token); from here on the answer is the client's. ``more_now``: the caller writes more (or
    the end) without awaiting anything first, so these bytes go out with it in one write."""
    await out.prepare(call.request)
    if more_now:
        out.hold(first)
    else:
        await out.write(first)
    calls.metrics.of(calls.metrics.ttft, call.route).observe(calls.loop.time() - call.t_start)
    call.outcome.status = 200


async def pipe(
    calls: UpstreamCalls,
    call: Call,
    out: StreamResponse,
    resp: UpstreamResponse,
    d: Backend,
    t0: float,
    rewriter: StreamRewriter | None = None,
) -> bool:
    """The rest of D's stream (what follows the chunks already written) to the client, then the
    end of the client's stream; True when D's stream ended cleanly and ``resp`` was released
    (else the caller closes it). ``t0``: when D's request was sent (D's upstream-time metric)."""
    rewrite = None if rewriter is None else rewriter.feed
    clean = await _copy(calls, resp, out, d, call.outcome, call.deadline, rewrite)
    if rewriter is not None:
        out.hold(rewriter.flush())  # goes out with the end, below
    if clean:
        resp.release()
        calls.succeeded(d)
    calls.metrics.of(calls.metrics.upstream, *d.labels).observe(calls.loop.time() - t0)
    await out.write_eof()
    return clean


async def _copy(
    calls: UpstreamCalls,
    resp: UpstreamResponse,
    out: StreamResponse,
    d: Backend,
    outcome: RequestOutcome,
    deadline: float,
    rewrite: Callable[[bytes], bytes] | None = None,
) -> bool:
    """Copy D's stream to the client as it comes (through ``rewrite`` when given); True when
    it ended cleanly, False when it broke (the client then got an SSE ``error`` event)."""
    loop = calls.loop
    idle = calls.idle_s
    while True:
        try:
            now = loop.time()
            if now >= deadline:
                raise TimeoutError
            resp.until = min(now + idle, deadline)  # a timer only if the read must wait
            chunk = await resp.readany()
        except (TimeoutError, OSError) as e:
            err = calls.map_error(e, d, "the next chunk")
            outcome.error_kind = f"midstream_{err.kind}"
            logger.warning("decode stream broke: %s", err.message)
            await out.write(err.sse_event())
            return False
        if not chunk:
            return True
        if rewrite is not None:
            chunk = rewrite(chunk)
        await send(out, chunk, resp)
        if resp.at_end:
            return True


async def send(out: StreamResponse, data: bytes, resp: UpstreamResponse) -> None:
    """Relay ``data``, D's latest bytes: at once, or, when D's answer is complete (the end of
    the client's stream follows without a wait), held to go out with that end in one write."""
    if resp.at_end:
        out.hold(data)
    else:
        await out.write(data)


def client_went_away(outcome: RequestOutcome, d: Backend) -> None:
    """A write to the client failed: it left (D's response is closed by the caller)."""
    outcome.status, outcome.error_kind = 499, "client_disconnected"
    logger.info("client went away mid-stream; closing %s", d.url)
