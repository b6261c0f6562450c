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

COUNTERS: dict[str, str] = {
    "bytes_sent": "Bytes of KV written to decode servers (push) or announced for them to read "
    "(pull)",
    "writes_posted": "NIXL WRITE transfers posted (one per layer per step, or one bulk)",
    "transfers_completed": "Prefill-side transfers completed (DONE delivered)",
    "transfers_failed": "Prefill-side transfers failed (WRITE error, invalid registration)",
    "transfers_aborted": "Prefill-side transfers aborted (by the decode side or the engine)",
    "lease_expiries": "Prefill-side requests freed because no registration came in the lease",
    "registrations_received": "Registrations received from decode servers (any outcome)",
    "registrations_rejected": "Registrations refused (unknown id, bad block ids, no HELLO)",
    "messages_rejected": "Control messages and side-channel connections refused (a failed "
    "CurveZMQ handshake: no or another key; bad HMAC, malformed, oversized, wrong version)",
    "transfers_stalled": "Prefill-side transfers failed because no post completed within the "
    "lease (a transport gone silent); their posts were cancelled",
    "reads_cancelled": "Decode-side READs of an ended load cancelled because they did not "
    "settle within abort_ack_timeout_s",
    "peers_dropped": "Side-channel connections this server opened and dropped: unreachable, "
    "silent (heartbeats), key mismatch, or a peer that stopped reading",
    "loads_completed": "Decode-side loads completed",
    "loads_failed": "Decode-side loads failed (ABORT, timeout, prefill side lost)",
    "done_timeouts": "Decode-side loads that saw no DONE within done_timeout_s",
    "post_seconds": "Seconds this server spent inside its transfer posts: as prefill side its "
    "WRITEs (push; over UCX cma the copy itself runs in the post) or ANNOUNCEs (pull), as decode "
    "side its READs (pull; over cma the copy, on the decode server)",
    "announces_sent": "ANNOUNCE messages sent to decode servers (pull: one per layer per step, "
    "or one bulk)",
    "reads_posted": "NIXL READ transfers posted from prefill servers' memory (pull: one per "
    "ANNOUNCE)",
    "bytes_read": "Bytes of KV read from prefill servers (pull)",
    "first_tokens_relayed": "First output tokens this prefill server's side channel relayed "
    "from its engine straight to a decode server (pull, first token from prefill)",
    "loads_completed_on_first_token": "Decode-side loads completed on the prefill engine's "
    "relayed first token, before (without) its DONE",
    "layers_posted_in_forward": "Layers the engine's per-layer hook reported during a prefill "
    "step with transfers in it, posted while the forward ran (the layer-wise overlap)",
    "layers_posted_at_step_end": "Layers the per-layer hook never reported, which the end of "
    "the step had to post after the forward (zero while the hook fires)",
}
HANDOFF = "exposed_handoff_s"


@dataclass
class SplitserveKVConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}
        self.data[HANDOFF] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        self.data[HANDOFF] = list(self.data.get(HANDOFF, [])) + list(other.data.get(HANDOFF, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data.get(name, 0) for name in COUNTERS}
        out["post_seconds"] = round(float(out["post_seconds"]), 4)
        handoffs = self.data.get(HANDOFF, [])
        if handoffs:
            out["avg exposed handoff (ms)"] = round(1e3 * sum(handoffs) / len(handoffs), 3)
            out["max exposed handoff (ms)"] = round(1e3 * max(handoffs), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS) and not self.data.get(HANDOFF)


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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = transfer_stats_data.get(name, 0)
            if value:
                self.counters[name][engine_idx].inc(value)
        for seconds in transfer_stats_data.get(HANDOFF, []):
            self.handoff[engine_idx].observe(seconds)
