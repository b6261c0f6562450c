"""SGLang adapter of the adaptive chunk budget: a ``PrefillAdder`` whose ``rem_chunk_tokens`` (the
per-step chunk budget) comes from :class:`~splitserve.schedulers.policy.BudgetPolicy`.

Runs in SGLang's scheduler process (one per TP rank). It is installed by the splitserve SGLang
plugin (``splitserve.plugins.register_sglang``) through SGLang's ``HookRegistry``, only when the
user switches it on:

- ``SPLITSERVE_ADAPTIVE_BUDGET=1`` (also true/yes/on; 0/false/no/off or unset: off) in the
  server's environment switches it on;
- settings: ``SPLITSERVE_SCHEDULER_CONFIG=/path/settings.yaml`` (YAML or JSON, the same
  ``BudgetPolicySettings`` as vLLM's adapter); defaults when unset.

Hooks (each a no-op on a scheduler where the budget is off):

1. ``Scheduler.__init__`` (after): reads the switch and the settings and builds the policy; an
   invalid switch value or setting raises ``SchedulerSettingsError`` there, which stops SGLang's
   start-up with the message (a plugin's own exceptions are only logged by SGLang).
2. ``Scheduler.get_prefill_adder_class`` (around): describes the next step (decoding requests of
   the running batch and their context lengths; the chunked request, then the waiting queue),
   asks the policy, and returns this scheduler's ``PrefillAdder`` subclass, which caps
   ``rem_chunk_tokens`` at the budget right after SGLang's own constructor.
3. ``Scheduler.run_batch`` (around) and ``Scheduler.process_batch_result`` (after): what each
   batch computed and the time from launch to its result being processed, fed back to the policy.

SGLang runs prefill and decode batches separately unless ``--enable-mixed-chunk``: a running
decode then waits for the whole prefill step, so the prefill step's duration is its inter-token
latency. The state given to the policy always counts the decodes (so a budget is chosen whenever
requests decode); without mixed chunks the predicted step includes their tokens although they run
in the next batch, which errs on the safe side by one decode step's cost. On a PD **prefill**
server nothing ever decodes, so the policy always answers its ``max_chunk``
(``chunked_prefill_size`` unless set lower): the adaptive budget only matters on a unified
server. The policy's ``share_prefill`` does not apply (SGLang chunks one prompt at a time; the
adapter turns it off). Invariant: the budget never raises
``rem_chunk_tokens`` above what SGLang chose.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.schedulers.metrics import BudgetExporter, serve_metrics
from splitserve.schedulers.policy import (
    BudgetPolicy,
    PendingPrefill,
    SchedulerSettingsError,
    StepState,
    load_budget_settings,
)
from splitserve.schedulers.step_model import StepFeatures, chunk_attention_pairs

logger = logging.getLogger(__name__)

ENABLE_ENV = "SPLITSERVE_ADAPTIVE_BUDGET"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
# Waiting requests looked at when describing pending prefill.
_WAITING_LOOKED_AT = 64
# Batches launched but not processed yet (1 normally, 2 with the overlap scheduler).
_MAX_IN_FLIGHT = 64

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
HOOK_TARGETS = (
    f"{SCHEDULER}.__init__",
    f"{SCHEDULER}.get_prefill_adder_class",
    f"{SCHEDULER}.run_batch",
    f"{SCHEDULER}.process_batch_result",
)
_STATE_ATTR = "_splitserve_budget"


def adaptive_budget_requested(environ: Mapping[str, str]) -> bool:
    """Whether ``$SPLITSERVE_ADAPTIVE_BUDGET`` switches the budget on (strict parse)."""
    raw = environ.get(ENABLE_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SchedulerSettingsError(
        f"${ENABLE_ENV}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off"
    )


def hooks_wanted(environ: Mapping[str, str]) -> bool:
    """Whether the plugin should register the hooks at all: the switch is set to anything (an
    invalid value must still reach ``Scheduler.__init__`` so that start-up fails on it)."""
    return environ.get(ENABLE_ENV, "").strip() != ""


@dataclass
class _InFlight:
    started: float
    features: StepFeatures


@dataclass
class SchedulerBudget:
    """One scheduler's policy, its adder class and the batches awaiting their measurement."""

    policy: BudgetPolicy
    exporter: BudgetExporter
    adder_class: type
    in_flight: dict[int, _InFlight] = field(default_factory=dict)
    last_budget: int | None = None


def make_adder_class(base: type) -> type:
    """A subclass of SGLang's ``PrefillAdder`` that caps ``rem_chunk_tokens`` at the class's
    current ``splitserve_budget`` (set by the hook before each use)."""

    class AdaptivePrefillAdder(base):  # type: ignore[misc, valid-type]
        splitserve_budget: int | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            budget = type(self).splitserve_budget
            if budget is not None and (
                self.rem_chunk_tokens is None or self.rem_chunk_tokens > budget
            ):
                self.rem_chunk_tokens = budget

    AdaptivePrefillAdder.__qualname__ = f"Adaptive{base.__name__}"
    return AdaptivePrefillAdder


def step_state(scheduler: Any) -> StepState:
    """Decodes and pending prefill of an SGLang scheduler (nothing is changed)."""
    decode_contexts: list[int] = []
    running = getattr(scheduler, "running_batch", None)
    for req in getattr(running, "reqs", None) or ():
        if not req.finished():
            decode_contexts.append(int(req.seqlen))
    prefills: list[PendingPrefill] = []
    chunked = getattr(scheduler, "chunked_req", None)
    candidates = ([chunked] if chunked is not None else []) + list(
        scheduler.waiting_queue[:_WAITING_LOOKED_AT]
    )
    for req in candidates:
        computed = int(req.prefix_len)  # tokens [0, prefix_len) already in the KV cache
        remaining = int(req.seqlen) - computed
        if remaining > 0:
            prefills.append(PendingPrefill(remaining, computed))
    return StepState(decode_context_lens=decode_contexts, prefills=prefills)


def batch_features(batch: Any) -> StepFeatures | None:
    """What an SGLang ``ScheduleBatch`` computes (None for idle or other kinds of batch)."""
    mode = batch.forward_mode
    if mode.is_extend() and batch.extend_lens:
        pairs = sum(
            chunk_attention_pairs(prefix, extend)
            for prefix, extend in zip(batch.prefix_lens, batch.extend_lens, strict=False)
        )
        return StepFeatures(
            tokens=int(sum(batch.extend_lens)), sequences=len(batch.reqs), attention_pairs=pairs
        )
    if mode.is_decode() and batch.reqs:
        seq_sum = int(batch.seq_lens_sum or 0)
        return StepFeatures(
            tokens=len(batch.reqs), sequences=len(batch.reqs), attention_pairs=seq_sum
        )
    return None


def _engine_max_tokens(scheduler: Any) -> int:
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        return int(chunk)
    return int(scheduler.max_prefill_tokens)


def build_budget(scheduler: Any, environ: Mapping[str, str]) -> SchedulerBudget | None:
    """The budget for one scheduler, or None when switched off; raises on a bad setting."""
    if not adaptive_budget_requested(environ):
        return None
    # SGLang chunks one prompt at a time (its PrefillAdder has no per-prompt cap to set), so the
    # budget is not shared among prompts and the policy predicts first-come-first-served steps.
    settings = load_budget_settings(None, environ).model_copy(update={"share_prefill": False})
    page_size = int(getattr(scheduler, "page_size", 1) or 1)
    try:
        policy = BudgetPolicy.create(
            settings, engine_block_size=page_size, engine_max_tokens=_engine_max_tokens(scheduler)
        )
    except ValueError as exc:
        raise SchedulerSettingsError(f"invalid scheduler settings: {exc}") from exc
    exporter = BudgetExporter(logger, settings.target_itl_ms, settings.log_interval_s)
    if settings.metrics_port is not None:
        serve_metrics(settings.metrics_port)
    from sglang.srt.managers.schedule_policy import PrefillAdder

    bounds = policy.bounds
    logger.info(
        "splitserve adaptive chunk budget on: target ITL %.1f ms, budget %d..%d tokens in steps "
        "of %d (chunked_prefill_size %s, mixed chunks %s)",
        settings.target_itl_ms,
        bounds.min_chunk,
        bounds.max_chunk,
        bounds.alignment,
        getattr(scheduler, "chunked_prefill_size", None),
        bool(getattr(scheduler, "is_mixed_chunk", False)),
    )
    return SchedulerBudget(policy, exporter, make_adder_class(PrefillAdder))


# -- the hooks (registered by the plugin; each looks up this scheduler's budget) -------------


def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    setattr(scheduler, _STATE_ATTR, build_budget(scheduler, os.environ))


def around_get_prefill_adder_class(original: Any, scheduler: Any, *args: Any, **kwargs: Any):
    budget: SchedulerBudget | None = getattr(scheduler, _STATE_ATTR, None)
    base = original(scheduler, *args, **kwargs)
    if budget is None:
        return base
    if not issubclass(budget.adder_class, base):
        budget.adder_class = make_adder_class(base)  # another plugin chose a different adder
    state = step_state(scheduler)
    decision = budget.policy.decide(state)
    budget.exporter.decided(decision, state.num_decodes, state.waiting_prefill_tokens)
    budget.adder_class.splitserve_budget = decision.prefill_budget
    budget.last_budget = decision.prefill_budget
    return budget.adder_class


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any):
    budget: SchedulerBudget | None = getattr(scheduler, _STATE_ATTR, None)
    if budget is None:
        return original(scheduler, batch, *args, **kwargs)
    started = time.perf_counter()
    features = batch_features(batch)
    result = original(scheduler, batch, *args, **kwargs)
    if features is not None:
        if len(budget.in_flight) >= _MAX_IN_FLIGHT:
            budget.in_flight.pop(next(iter(budget.in_flight)))
        budget.in_flight[id(batch)] = _InFlight(started, features)
    return result


def after_process_batch_result(result: Any, scheduler: Any, batch: Any, *a: Any, **k: Any):
    budget: SchedulerBudget | None = getattr(scheduler, _STATE_ATTR, None)
    if budget is None:
        return None
    record = budget.in_flight.pop(id(batch), None)
    if record is not None:
        observation = budget.policy.observe(record.features, time.perf_counter() - record.started)
        budget.exporter.observed(
            observation, budget.policy.model.coefficients, budget.policy.model.relative_scale
        )
    return None


def register_hooks() -> None:
    """Register the four hooks with SGLang's ``HookRegistry`` (the plugin calls this once per
    process, before SGLang applies hooks)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGETS[0], after_scheduler_init, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS[1], around_get_prefill_adder_class, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS[2], around_run_batch, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS[3], after_process_batch_result, HookType.AFTER)
