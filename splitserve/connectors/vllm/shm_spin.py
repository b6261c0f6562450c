"""How long vLLM's shared-memory broadcast readers spin after a read: an opt-in setting for hosts
where engine processes outnumber cores.

vLLM's multiprocessing executor hands every step to its workers through a shared-memory ring
(``shm_broadcast.MessageQueue``), and each reader (every worker, and the engine reading the
workers' answers) busy-waits with ``sched_yield`` for ``SpinCondition.busy_loop_s`` after each
read before it sleeps on the ring's ZMQ notification. That time is 1 s and not a vLLM setting. On a
GPU host each process has a core of its own and the spin saves microseconds per step. Where
processes outnumber cores (vLLM CPU with TP > 1, several servers on one host), a D that waits for
KV steps every millisecond, so its engine and workers spin without pause and take the cores from
the P whose prefill they wait for (measured: docs/environment.md, "Scheduling stalls").

``SPLITSERVE_VLLM_SHM_SPIN_S`` (seconds, 0 to 60) sets that time in every vLLM process: our
``vllm.general_plugins`` entry point (``splitserve.plugins.register_vllm``) runs in each of them
before the executor builds its rings. Past its spin a reader sleeps on the notification, at most
``POLL_MS`` at a time: vLLM's writer sends the notification before it marks the block written, so
a reader woken by it can find the block not ready yet, and would then sleep until the next write
or vLLM's 5 s recheck (with 0 s, TP 2 requests took seconds per step here). 0 thus turns the spin
into a 1 ms poll. Unset, vLLM's own behaviour stands. A value that is not a number in range,
or a vLLM whose ``SpinCondition`` no longer has ``busy_loop_s``, is logged and changes nothing:
this is a performance setting, and the server serves the same with or without it.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Mapping

from splitserve.connectors.vllm.logs import route_logs_to_vllm

logger = logging.getLogger(__name__)

ENV = "SPLITSERVE_VLLM_SHM_SPIN_S"
MAX_SPIN_S = 60.0
PARAMETER = "busy_loop_s"
POLL_MS = 1  # the longest sleep of a reader past its spin, between two looks at the ring


def spin_from_env(environ: Mapping[str, str]) -> float | None:
    """The spin time asked for in ``environ``; None when unset or not valid (logged)."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0.0 <= seconds <= MAX_SPIN_S:  # also false for nan
        logger.error(
            "%s=%r is not a number of seconds from 0 to %g: vLLM's default spin is kept",
            ENV,
            raw,
            MAX_SPIN_S,
        )
        return None
    return seconds


def apply_from_env(environ: Mapping[str, str] = os.environ) -> float | None:
    """Set vLLM's reader spin time from ``environ`` in this process (idempotent); the value set,
    or None when nothing was changed."""
    seconds = spin_from_env(environ)
    if seconds is None:
        return None
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as e:
        logger.warning("%s is set but vLLM's shm broadcast is not importable: %s", ENV, e)
        return None
    init = SpinCondition.__init__
    last = list(inspect.signature(init).parameters.values())[-1]
    if last.name != PARAMETER or last.default is inspect.Parameter.empty or not init.__defaults__:
        logger.warning(
            "%s is set but this vLLM's SpinCondition has no %s default: left unchanged",
            ENV,
            PARAMETER,
        )
        return None
    if init.__defaults__[-1] != seconds:
        # The rings' constructors never pass it (vLLM 0.32): the default is the setting.
        init.__defaults__ = (*init.__defaults__[:-1], seconds)
        if not getattr(SpinCondition.wait, "_splitserve_poll_ms", None):
            SpinCondition.wait = _capped_wait(SpinCondition.wait)
        route_logs_to_vllm()
        logger.info(
            "vLLM shm broadcast readers spin %g s after a read (%s; pid %d)",
            seconds,
            ENV,
            os.getpid(),
        )
    return seconds


def _capped_wait(wait):
    """``SpinCondition.wait`` whose sleep on the notification lasts at most ``POLL_MS``."""

    def capped(self, timeout_ms: int | None = None) -> None:
        return wait(self, POLL_MS if timeout_ms is None else min(timeout_ms, POLL_MS))

    capped._splitserve_poll_ms = POLL_MS  # type: ignore[attr-defined]
    capped.__doc__ = wait.__doc__
    return capped
