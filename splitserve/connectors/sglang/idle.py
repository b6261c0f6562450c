"""A short nap instead of SGLang's busy wait while a PD server only waits on transfers.

Runs in the scheduler process of a prefill or decode server with
``--disaggregation-transfer-backend splitserve``. SGLang's scheduler loop calls ``on_idle`` when
it has no batch to run. A fully idle scheduler then sleeps on its sockets (``--sleep-on-idle``),
but a PD scheduler with a request in its disaggregation queues (P: waiting for D's registration
or for its WRITEs; D: waiting for its KV) is not fully idle, and ``on_idle`` returns after a
``time.sleep(0)``: the loop polls again at once and holds a core at 100% for as long as P's
prefill lasts. Where P and D share cores (one machine, no pinning) that loop takes CPU from P's
compute threads (measured in docs/benchmarks.md, "SGLang P/D TTFT (issue #25)").

The plugin registers one hook with SGLang's ``HookRegistry`` in every SGLang process,
``Scheduler.on_idle`` (after), which does nothing unless this process's splitserve manager made
itself ``ACTIVE`` (``SPLITSERVE_SGLANG_IDLE_NAP_MS`` > 0, the default 1): when the scheduler is
not fully idle, it naps up to that many milliseconds.

Waking on arrival: our backend's own events (D's DONE, P's REGISTER, a WRITE settling) arrive
on our side channel and in NIXL, which SGLang's sockets do not see, so a nap in one wait on
them delays each by up to its length (1 ms on D's DONE: part of the exposed handoff; measured
in docs/benchmarks.md). With ``SPLITSERVE_SGLANG_IDLE_CHECK_MS`` > 0 (default 0.2) the nap is
cut in slices of that length; after each, a request on the scheduler's input sockets
(SGLang's ``IdleSleeper`` poller, polled without waiting) or a room whose status the
manager's ``idle_check`` (a drive of the transport) changed ends it. Slices also make a nap
under 1 ms possible: zmq's poll counts whole milliseconds (pyzmq truncates 0.5 to 0, a spin).
With 0 the nap is one wait on the poller (whole milliseconds) or, without
``--sleep-on-idle``, one sleep.

Invariants: the hook never raises into SGLang's loop (the first failure is logged with its
traceback, the next ones at DEBUG: the hook runs thousands of times a second); a fully idle
scheduler is left to SGLang (it already slept); nothing changes while a batch runs (``on_idle``
is only called without one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"

# This process's manager when it naps (set by it, with ``nap_s`` > 0).
ACTIVE: Any = None
_registered = False
failures = 0  # naps that raised in this process (the first is logged with its traceback)


def after_on_idle(result, scheduler, *args, **kwargs):
    mgr = ACTIVE
    if mgr is None:
        return None
    try:
        nap(scheduler, mgr.nap_s, mgr.check_s, mgr.idle_check)
    except Exception:  # noqa: BLE001 - never into SGLang's loop; SGLang then polls as it would
        _failed()
    return None


def _failed() -> None:
    """Log a failed nap: the first with its traceback, the rest at DEBUG (SGLang calls
    ``on_idle`` in a tight loop, so a persistent failure would flood the log)."""
    global failures
    failures += 1
    if failures == 1:
        logger.exception(
            "splitserve: idle nap failed; SGLang polls without it (further failures at DEBUG)"
        )
    else:
        logger.debug("splitserve: idle nap failed (%d times)", failures, exc_info=True)


def nap(
    scheduler,
    seconds: float,
    check_s: float = 0.0,
    check: Callable[[], bool] | None = None,
) -> bool:
    """Wait up to ``seconds`` unless the scheduler is fully idle (SGLang slept already then) or
    ``seconds`` is 0. With ``check`` and ``check_s`` > 0: in slices of ``check_s``, ending
    after the first slice that finds a request on the scheduler's input sockets or ``check()``
    true (our backend's news); else one wait on those sockets. Returns whether it napped."""
    if seconds <= 0 or scheduler.is_fully_idle():
        return False
    sleeper = getattr(scheduler, "idle_sleeper", None)
    poller = getattr(sleeper, "poller", None)
    if check is None or check_s <= 0:
        if poller is not None:
            poller.poll(seconds * 1e3)  # ms (whole: zmq); returns at once when a request arrives
        else:
            time.sleep(seconds)
        return True
    deadline = time.monotonic() + seconds
    while True:
        time.sleep(min(check_s, max(0.0, deadline - time.monotonic())))
        if poller is not None and poller.poll(0):
            return True  # a request: SGLang's loop takes it
        if check() or time.monotonic() >= deadline:
            return True


def register_hooks() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ON_IDLE, after_on_idle, HookType.AFTER)
    _registered = True
