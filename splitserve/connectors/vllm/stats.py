"""SplitserveConnector's statistics: vLLM ``KVConnectorStats`` and Prometheus metrics.

The worker half (worker process) fills a ``SplitserveKVConnectorStats`` with what changed since
the last step; vLLM ships it to the API-server process, where ``SplitservePromMetrics`` turns it
into ``vllm:splitserve_*`` counters and histograms on the server's ``/metrics`` (and vLLM's
periodic log line shows ``reduce()``).

Invariants: ``data`` holds only ints, floats and lists of floats (it is serialized between
processes); counters are deltas, so aggregation is addition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from splitserve.connectors.counters import COUNTERS

HANDOFF = "exposed_handoff_s"
TAIL = "forward_tail_s"  # P: last layer hook -> forward's end, per request (SenderStats)
SAMPLES = (HANDOFF, TAIL)


@dataclass
class SplitserveKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}
        for name in SAMPLES:
            self.data[name] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        for name in SAMPLES:
            self.data[name] = list(self.data.get(name, [])) + list(other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data.get(name, 0) for name in COUNTERS}
        out["post_seconds"] = round(float(out["post_seconds"]), 4)
        handoffs = self.data.get(HANDOFF, [])
        if handoffs:
            out["avg exposed handoff (ms)"] = round(1e3 * sum(handoffs) / len(handoffs), 3)
            out["max exposed handoff (ms)"] = round(1e3 * max(handoffs), 3)
        tails = self.data.get(TAIL, [])
        if tails:
            out["avg forward tail (ms)"] = round(1e3 * sum(tails) / len(tails), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in (*COUNTERS, *SAMPLES))


class SplitservePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:splitserve_{name}", documentation=doc, labelnames=labelnames
            )
            self.counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)
        handoff = self._histogram_cls(
            name="vllm:splitserve_exposed_handoff_seconds",
            documentation="Per request: from the end of the prefill side's last forward (every "
            "layer computed) to DONE seen on the decode side",
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0],
            labelnames=labelnames,
        )
        self.handoff = create_metric_per_engine(handoff, per_engine_labelvalues)
        tail = self._histogram_cls(
            name="vllm:splitserve_forward_tail_seconds",
            documentation="Per request on the prefill side: from the last layer's hook (its KV "
            "slice posted) to the end of the forward that completed the prompt (where the exposed "
            "handoff starts); the last slice moves meanwhile",
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0],
            labelnames=labelnames,
        )
        self.tail = create_metric_per_engine(tail, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self.counters[name][engine_idx].inc(value)
        for seconds in transfer_stats_data.get(HANDOFF, []):
            self.handoff[engine_idx].observe(seconds)
        for seconds in transfer_stats_data.get(TAIL, []):
            self.tail[engine_idx].observe(seconds)
