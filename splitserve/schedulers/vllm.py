"""vLLM adapter of the adaptive chunk-size policy: ``--scheduler-cls
splitserve.schedulers.vllm.AdaptiveChunkScheduler``.

Runs in vLLM's EngineCore process (the API server's own process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It subclasses vLLM v1's ``Scheduler`` and only:

1. reads state before each ``schedule()``: the running requests that decode (one token each, with
   their context lengths) and the prompt tokens still to compute (running chunked prefills first,
   then the waiting queue, in vLLM's FCFS order);
2. asks :class:`~splitserve.schedulers.policy.BudgetPolicy` for the prefill budget and sets
   ``self.max_num_scheduled_tokens = min(start-up value, prefill budget + decode tokens)``: vLLM
   serves the running requests first, so the decodes always fit and prefill gets the rest;
3. sets the step's per-prompt cap (the policy's max-min fair share of the budget among pending
   prompts, ``BudgetDecision.prompt_cap``) as vLLM's ``long_prefill_token_threshold``, which
   ``schedule()`` reads every step, combined with a threshold set at start-up (the smaller one);
   the scheduler works on its own copy of the scheduler config, so nothing else sees the change;
4. after ``update_from_output()``, feeds the policy what the step computed (from the
   ``SchedulerOutput``) and how long it took.

Step time is measured from ``schedule()`` entry to ``update_from_output()`` exit for the same
``SchedulerOutput``: the whole engine-side cost of one step (scheduling, forward, sampling,
output processing) and nothing of the idle time between requests, which the wall time between
two ``schedule()`` calls would include. With the synchronous engine loop (vLLM on CPU, and any
``Scheduler`` subclass since async scheduling needs ``AsyncScheduler``) one step's period is
this span plus a little queue handling, i.e. what a decoding client sees as inter-token latency.

Settings: ``--additional-config '{"splitserve_scheduler": {...}}'`` or
``SPLITSERVE_SCHEDULER_CONFIG=/path/settings.yaml`` (one of the two); any invalid setting fails
the engine's start-up with a message naming the field. Invariant: the budget never exceeds the
start-up ``max_num_scheduled_tokens`` (itself ``max_num_batched_tokens`` unless speculative
decoding reserves slots).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from splitserve.schedulers.metrics import BudgetExporter, serve_metrics
from splitserve.schedulers.policy import (
    ADDITIONAL_CONFIG_KEY,
    BudgetPolicy,
    PendingPrefill,
    StepState,
    load_budget_settings,
)
from splitserve.schedulers.step_model import StepFeatures, chunk_attention_pairs

# vLLM configures logging for the "vllm" logger hierarchy only (its handler, format and
# VLLM_LOGGING_LEVEL); EngineCore runs in its own process, so a logger outside that hierarchy
# would print nothing there. Per-step lines are DEBUG, summaries INFO.
logger = logging.getLogger("vllm.splitserve.scheduler")

# Waiting requests looked at when describing pending prefill (the queue can be long; the budget
# rarely spans more prompts than this).
_WAITING_LOOKED_AT = 64
# Steps scheduled but not yet reported back: 1 with the synchronous loop, the batch-queue depth
# with pipeline parallelism.
_MAX_IN_FLIGHT = 64


@dataclass(frozen=True)
class _StepRecord:
    started: float
    features: StepFeatures


class AdaptiveChunkScheduler(Scheduler):
    """vLLM's scheduler with a per-step prefill budget chosen by the adaptive policy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        additional = self.vllm_config.additional_config
        inline = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
        settings = load_budget_settings(inline, os.environ)
        self._startup_max_tokens = self.max_num_scheduled_tokens
        self.scheduler_config = copy.copy(self.scheduler_config)  # ours to change per step
        self._startup_prompt_cap = self.scheduler_config.long_prefill_token_threshold
        self._policy = BudgetPolicy.create(
            settings,
            engine_block_size=self.block_size,
            engine_max_tokens=self._startup_max_tokens,
        )
        self._exporter = BudgetExporter(logger, settings.target_itl_ms, settings.log_interval_s)
        if settings.metrics_port is not None:
            serve_metrics(settings.metrics_port)
        self._in_flight: dict[int, _StepRecord] = {}
        bounds = self._policy.bounds
        logger.info(
            "adaptive chunk scheduler: target ITL %.1f ms, prefill budget %d..%d tokens in "
            "steps of %d (start-up max_num_scheduled_tokens %d)",
            settings.target_itl_ms,
            bounds.min_chunk,
            bounds.max_chunk,
            bounds.alignment,
            self._startup_max_tokens,
        )

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        started = time.perf_counter()
        state, decode_tokens = self._step_state()
        decision = self._policy.decide(state)
        self.max_num_scheduled_tokens = min(
            self._startup_max_tokens, decision.prefill_budget + decode_tokens
        )
        self.scheduler_config.long_prefill_token_threshold = _smaller_cap(
            self._startup_prompt_cap, decision.prompt_cap
        )
        output = super().schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens > 0:
            # Only steps that run count as decisions: an engine loop that schedules nothing
            # (a request waiting for its KV from P, the empty step after the last request)
            # would read as a "no decodes" decision at the maximum and skew what D reports.
            features, prompt_chunks = self._executed(output)
            self._exporter.decided(
                decision,
                state.num_decodes,
                state.waiting_prefill_tokens,
                shared=decision.prompt_cap > 0 and prompt_chunks >= 2,
            )
            if len(self._in_flight) >= _MAX_IN_FLIGHT:
                # Outputs vLLM never reported back (none are expected): forget the oldest rather
                # than grow without bound.
                self._in_flight.pop(next(iter(self._in_flight)))
            self._in_flight[id(output)] = _StepRecord(started, features)
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any):
        result = super().update_from_output(scheduler_output, *args, **kwargs)
        record = self._in_flight.pop(id(scheduler_output), None)
        if record is not None:
            observation = self._policy.observe(
                record.features, time.perf_counter() - record.started
            )
            self._exporter.observed(
                observation, self._policy.model.coefficients, self._policy.model.relative_scale
            )
        return result

    def _step_state(self) -> tuple[StepState, int]:
        """Decodes and pending prefill, read from the queues (nothing is changed), and the tokens
        the decodes need (one each, plus any speculative draft tokens)."""
        decode_contexts: list[int] = []
        decode_tokens = 0
        prefills: list[PendingPrefill] = []
        for request in self.running:
            remaining = request.num_tokens_with_spec - request.num_computed_tokens
            if request.num_computed_tokens >= request.num_prompt_tokens:
                decode_contexts.append(request.num_computed_tokens)
                decode_tokens += max(1, remaining)
            else:
                prefills.append(PendingPrefill(remaining, request.num_computed_tokens))
        for index, request in enumerate(self.waiting):
            if index >= _WAITING_LOOKED_AT:
                break
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                continue  # waiting for remote KV, a grammar or a stream: no prefill to budget
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 0:
                prefills.append(PendingPrefill(remaining, request.num_computed_tokens))
        return StepState(decode_context_lens=decode_contexts, prefills=prefills), decode_tokens

    def _executed(self, output: SchedulerOutput) -> tuple[StepFeatures, int]:
        """What the scheduled step computes (``num_computed_tokens`` was already advanced), and
        how many prompts' chunks it carries."""
        tokens = pairs = prompt_chunks = 0
        for req_id, new_tokens in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens - new_tokens
            tokens += new_tokens
            pairs += chunk_attention_pairs(start, new_tokens)
            prompt_chunks += start < request.num_prompt_tokens
        features = StepFeatures(
            tokens=tokens, sequences=len(output.num_scheduled_tokens), attention_pairs=pairs
        )
        return features, prompt_chunks


def _smaller_cap(a: int, b: int) -> int:
    """The tighter of two per-prompt caps, where 0 means none."""
    return min(a, b) if a and b else a or b
