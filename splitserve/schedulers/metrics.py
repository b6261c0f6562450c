"""Export of the adaptive budget: Prometheus metrics and log lines, one call per step.

Engine-agnostic (no engine import); runs in the engine's scheduling process (vLLM: EngineCore,
a separate process from the API server unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). How the
metrics leave that process (see docs/scheduler.md):

- ``PROMETHEUS_MULTIPROC_DIR`` set in the server's environment (vLLM then serves every process's
  metrics, ours included, from its own ``/metrics`` through a ``MultiProcessCollector``);
- and/or ``metrics_port``: this process serves them itself on that port.

Invariants: metric objects exist once per process (two schedulers in one process share them);
per-step work is a few metric updates and, at debug level only, one log line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import cache

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from splitserve.schedulers.policy import BudgetDecision
from splitserve.schedulers.step_model import FEATURE_NAMES, Observation

_BUDGET_BUCKETS = tuple(float(2**k) for k in range(4, 16))  # 16 .. 32768 tokens
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class BudgetMetrics:
    budget: Gauge
    budget_chosen: Histogram
    decisions: Counter
    shared_steps: Counter
    step_seconds: Histogram
    prediction_error: Gauge
    relative_error: Histogram
    outliers: Counter
    coefficient: Gauge
    target: Gauge


@cache
def budget_metrics() -> BudgetMetrics:
    """The process-wide metric objects (created on first use, after the environment is set)."""
    return BudgetMetrics(
        budget=Gauge(
            "splitserve_scheduler_prefill_budget_tokens",
            "Prefill token budget chosen for the latest step",
            multiprocess_mode="mostrecent",
        ),
        budget_chosen=Histogram(
            "splitserve_scheduler_prefill_budget_chosen_tokens",
            "Prefill token budgets chosen, one observation per step",
            buckets=_BUDGET_BUCKETS,
        ),
        decisions=Counter(
            "splitserve_scheduler_budget_decisions",
            "Budget decisions by reason (no_decodes: maximum chunk; fits: the largest that fits "
            "the target; min_chunk: nothing fits, minimum chunk)",
            ["reason"],
        ),
        shared_steps=Counter(
            "splitserve_scheduler_shared_steps",
            "Steps that carried several prompts' chunks under a per-prompt cap (the budget "
            "shared max-min fairly: short prompts finish, long ones share the rest)",
        ),
        step_seconds=Histogram(
            "splitserve_scheduler_step_seconds",
            "Measured step time: schedule() entry to update_from_output() exit",
            buckets=_STEP_BUCKETS,
        ),
        prediction_error=Gauge(
            "splitserve_scheduler_prediction_error_seconds",
            "Measured minus predicted time of the latest step (positive: slower than predicted)",
            multiprocess_mode="mostrecent",
        ),
        relative_error=Histogram(
            "splitserve_scheduler_prediction_abs_error_ratio",
            "|measured - predicted| / measured per step",
            buckets=_ERROR_BUCKETS,
        ),
        outliers=Counter(
            "splitserve_scheduler_outlier_steps",
            "Steps whose time the step model rejected as outliers",
        ),
        coefficient=Gauge(
            "splitserve_scheduler_step_model_coefficient",
            "Fitted step-time coefficients (milliseconds per feature unit)",
            ["term"],
            multiprocess_mode="mostrecent",
        ),
        target=Gauge(
            "splitserve_scheduler_target_itl_seconds",
            "Configured inter-token latency target",
            multiprocess_mode="mostrecent",
        ),
    )


_server_lock = threading.Lock()
_served_ports: set[int] = set()


def serve_metrics(port: int) -> None:
    """Serve this process's metrics (all processes' in multiprocess mode) on ``port``, once."""
    from prometheus_client import multiprocess, start_http_server

    with _server_lock:
        if port in _served_ports:
            return
        registry = REGISTRY
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        start_http_server(port, addr="127.0.0.1", registry=registry)
        _served_ports.add(port)


class BudgetExporter:
    """Records each step's decision and measurement; logs a summary every ``log_interval_s``."""

    def __init__(self, logger: logging.Logger, target_itl_ms: float, log_interval_s: float) -> None:
        self.logger = logger
        self.metrics = budget_metrics()
        self.metrics.target.set(target_itl_ms / 1e3)
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        self._steps = 0
        self._budget_sum = 0
        self._abs_error_sum = 0.0
        self._reasons: dict[str, int] = {}

    def decided(
        self,
        decision: BudgetDecision,
        num_decodes: int,
        waiting_tokens: int,
        shared: bool = False,
    ) -> None:
        """Record one step's decision; ``shared``: the engine ran it with several prompts'
        chunks under the decision's per-prompt cap."""
        self.metrics.budget.set(decision.prefill_budget)
        self.metrics.budget_chosen.observe(decision.prefill_budget)
        self.metrics.decisions.labels(decision.reason).inc()
        if shared:
            self.metrics.shared_steps.inc()
        self._budget_sum += decision.prefill_budget
        self._reasons[decision.reason] = self._reasons.get(decision.reason, 0) + 1
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                "budget=%d reason=%s prompt_cap=%d decodes=%d waiting_prefill=%d predicted_ms=%.2f",
                decision.prefill_budget,
                decision.reason,
                decision.prompt_cap,
                num_decodes,
                waiting_tokens,
                decision.predicted_step_s * 1e3,
            )

    def observed(
        self, observation: Observation, coefficients: dict[str, float], relative_scale: float
    ) -> None:
        m = self.metrics
        m.step_seconds.observe(observation.measured_s)
        m.prediction_error.set(observation.error_s)
        relative = abs(observation.error_s) / max(observation.measured_s, 1e-9)
        m.relative_error.observe(relative)
        if not observation.accepted:
            m.outliers.inc()
        self._steps += 1
        self._abs_error_sum += relative
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                "step measured_ms=%.2f predicted_ms=%.2f accepted=%s",
                observation.measured_s * 1e3,
                observation.predicted_s * 1e3,
                observation.accepted,
            )
        now = time.monotonic()
        if now - self._last_log >= self.log_interval_s:
            for term in FEATURE_NAMES:
                m.coefficient.labels(term).set(coefficients[term])
            decisions = sum(self._reasons.values()) or 1
            self.logger.info(
                "adaptive budget: %d steps, mean budget %.0f tokens, decisions %s, mean |error| "
                "%.1f%%, residual scale %.1f%%, model %s",
                self._steps,
                self._budget_sum / decisions,
                dict(sorted(self._reasons.items())),
                100 * self._abs_error_sum / max(self._steps, 1),
                100 * relative_scale,
                {k: round(v, 3) for k, v in coefficients.items()},
            )
            self._last_log = now
            self._steps = 0
            self._budget_sum = 0
            self._abs_error_sum = 0.0
            self._reasons = {}
