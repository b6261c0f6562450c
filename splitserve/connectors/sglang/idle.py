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
not fully idle, it waits up to that many milliseconds on the scheduler's own input sockets
(SGLang's ``IdleSleeper`` poller, so a new request still wakes it at once; a plain sleep
without ``--sleep-on-idle``). Our backend's own events (D's DONE, P's REGISTER) are seen by the
next poll, so a nap delays them by at most its length.

Invariants: the hook never raises into SGLang's loop; a fully idle scheduler is left to SGLang
(it already slept); nothing changes while a batch runs (``on_idle`` is only called without one).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"

# This process's manager when it naps (set by it, with ``nap_s`` > 0).
ACTIVE: Any = None
_registered = False


def after_on_idle(result, scheduler, *args, **kwargs):
    mgr = ACTIVE
    if mgr is None:
        return None
    try:
        nap(scheduler, mgr.nap_s)
    except Exception:  # noqa: BLE001 - never into SGLang's loop; SGLang then polls as it would
        logger.exception("splitserve: idle nap failed")
    return None


def nap(scheduler, seconds: float) -> bool:
    """Wait up to ``seconds`` on the scheduler's input sockets unless it is fully idle (SGLang
    slept already then) or ``seconds`` is 0. Returns whether it napped."""
    if seconds <= 0 or scheduler.is_fully_idle():
        return False
    sleeper = getattr(scheduler, "idle_sleeper", None)
    poller = getattr(sleeper, "poller", None)
    if poller is not None:
        poller.poll(seconds * 1e3)  # ms; returns at once when a request arrives
    else:
        time.sleep(seconds)
    return True


def register_hooks() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ON_IDLE, after_on_idle, HookType.AFTER)
    _registered = True
