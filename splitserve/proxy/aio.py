"""Small asyncio helpers for the proxy's request path, cheaper than the general ones.

Runs in the proxy process, on its event loop, on every request of the concurrent flows. Each
helper does what an ``asyncio`` call does for the few futures the proxy has, without what that
call builds on every use (sets, result sets, type checks, an extra task); the measurements that
led here are in docs/benchmarks.md ("Hot path after a profile").

Invariants: no helper cancels, or leaves a callback on, a future it was given.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_any(when: float, *futures: asyncio.Future[Any]) -> bool:
    """Until one of ``futures`` is done (True) or loop time ``when`` (False); none is cancelled.

    ``asyncio.wait(..., return_when=FIRST_COMPLETED)`` for a fixed few futures, without the
    sets, type checks and result sets it builds on every call."""
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
