"""The ``splitserve`` SGLang backend's Prometheus metrics, on the server's own ``/metrics``.

Runs in SGLang's scheduler process of a prefill (P) or decode (D) server, called by the manager
(``splitserve.connectors.sglang.conn``). SGLang has no metrics hook for a transfer backend, but
with ``--enable-metrics`` it runs ``prometheus_client`` in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` is set before the scheduler starts, and the HTTP server's
``/metrics`` reads every process's files through a ``MultiProcessCollector``). So counters and a
histogram made here, in the scheduler, show on the server's ``/metrics`` with SGLang's own.

Names and meanings are the shared catalogue's (``splitserve.connectors.counters``), with
SGLang's prefix: ``sglang:splitserve_<name>_total`` for each counter of ``COUNTERS`` (the
subset a push-only, host-memory backend has), ``sglang:splitserve_exposed_handoff_seconds``
(D), labelled with
``model_name`` and ``engine_type`` (``prefill`` / ``decode``) as SGLang labels its own.

Invariants: the transport's stats are cumulative totals; ``Deltas`` turns them into increments
once (a counter never goes down); without ``--enable-metrics`` nothing is made and publishing
costs nothing. No logic here depends on SGLang (``open_metrics`` reads its config by name).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from splitserve.connectors.counters import COUNTERS as ALL_COUNTERS

logger = logging.getLogger(__name__)

PREFIX = "sglang:splitserve_"

# The sender's own totals, exported under the same names.
SENDER_COUNTERS = (
    "bytes_sent",
    "writes_posted",
    "transfers_completed",
    "transfers_failed",
    "transfers_aborted",
    "lease_expiries",
    "registrations_received",
    "registrations_rejected",
    "transfers_stalled",
    "layers_posted_in_forward",
    "layers_posted_at_step_end",
)
# The shared catalogue's subset this backend has (no pull mode, no first-token relay).
COUNTERS: dict[str, str] = {
    name: ALL_COUNTERS[name]
    for name in (
        *SENDER_COUNTERS,
        "messages_rejected",
        "peers_dropped",
        "loads_completed",
        "loads_failed",
        "done_timeouts",
        "post_seconds",
    )
}
HANDOFF = "exposed_handoff_seconds"
HANDOFF_DOC = (
    "Per request (decode side): from the end of the prefill side's last forward (every layer "
    "computed) to DONE seen on the decode side"
)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)


def transport_totals(sender: Any, receiver: Any, channel: Any) -> dict[str, float]:
    """Cumulative totals by ``COUNTERS`` name of one server's sender (P), receiver (D) and side
    channel (either may be None)."""
    out: dict[str, float] = dict.fromkeys(COUNTERS, 0)
    if sender is not None:
        s = sender.stats
        for name in SENDER_COUNTERS:
            out[name] = getattr(s, name)
        out["post_seconds"] += s.post_seconds
    if receiver is not None:
        r = receiver.stats
        out["loads_completed"] = r.transfers_completed
        out["loads_failed"] = r.transfers_failed
        out["done_timeouts"] = r.done_timeouts
        out["messages_rejected"] += r.messages_rejected
        out["post_seconds"] += r.post_seconds
    if channel is not None:
        out["messages_rejected"] += channel.rejected
        dropped = channel.stats.dropped_peers
        out["peers_dropped"] = sum(n for kind, n in dropped.items() if kind != "idle")
    return out


class Deltas:
    """Increments since the previous call, from cumulative totals."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def __call__(self, totals: Mapping[str, float]) -> dict[str, float]:
        out = {}
        for name, value in totals.items():
            delta = value - self.last.get(name, 0)
            if delta > 0:
                out[name] = delta
                self.last[name] = value
        return out


class BackendMetrics:
    """The backend's counters and handoff histogram (``registry``: prometheus_client's default
    when None, which in SGLang's multiprocess mode is what ``/metrics`` collects)."""

    def __init__(self, labels: Mapping[str, str], registry: Any = None) -> None:
        from prometheus_client import Counter, Histogram

        kwargs = {} if registry is None else {"registry": registry}
        names, values = list(labels), list(labels.values())
        self.counters = {
            name: Counter(PREFIX + name, doc, labelnames=names, **kwargs).labels(*values)
            for name, doc in COUNTERS.items()
        }
        self.handoff = Histogram(
            PREFIX + HANDOFF, HANDOFF_DOC, labelnames=names, buckets=HANDOFF_BUCKETS, **kwargs
        ).labels(*values)
        self.deltas = Deltas()

    def publish(self, totals: Mapping[str, float], handoffs_s: list[float]) -> None:
        """Add what changed since the last call; observe (and clear) ``handoffs_s``."""
        for name, delta in self.deltas(totals).items():
            self.counters[name].inc(delta)
        for seconds in handoffs_s:
            self.handoff.observe(seconds)
        handoffs_s.clear()


def open_metrics(server_args: Any, *, prefill: bool) -> BackendMetrics | None:
    """The backend's metrics when SGLang runs with ``--enable-metrics`` (else None)."""
    enabled, model = False, getattr(server_args, "served_model_name", None)
    try:
        from sglang.srt.runtime_context import get_observability, get_serving

        enabled = bool(get_observability().enable_metrics)
        model = get_serving().served_model_name or model
    except (ImportError, AttributeError):  # other layouts: the flag on ServerArgs
        enabled = bool(getattr(server_args, "enable_metrics", False))
    if not enabled:
        return None
    labels = {"model_name": str(model), "engine_type": "prefill" if prefill else "decode"}
    logger.info("splitserve: metrics %s* on /metrics (%s)", PREFIX, labels["engine_type"])
    return BackendMetrics(labels)
