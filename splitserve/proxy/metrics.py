"""Prometheus metrics of the proxy, in a registry of its own (so several proxies can live in one
process, e.g. in tests) and served at ``/metrics``.

Runs in the proxy process. Names start with ``splitserve_proxy_``; ``pool`` is ``prefill`` or
``decode`` and ``server`` the server's base URL. The metrics every request updates (requests,
in-flight gauge, latency histograms) are ``localmetrics`` families in a single process (an
update is an addition); with several workers (``PROMETHEUS_MULTIPROC_DIR``) they are
``prometheus_client``'s own, whose values the workers share through files.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from splitserve.proxy.localmetrics import LocalCounter, LocalGauge, LocalHistogram

# Seconds; from sub-millisecond (a stub backend) to minutes (a long prefill on a CPU).
_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip


class ProxyMetrics:
    """Every metric the proxy exports."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # The metrics of every request: plain numbers unless workers share them through files.
        shared = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        counter: Any = Counter if shared else LocalCounter
        gauge: Any = Gauge if shared else LocalGauge
        histogram: Any = Histogram if shared else LocalHistogram
        self.requests = counter(
            "splitserve_proxy_requests", "Client requests by route and final status",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "splitserve_proxy_errors", "Failed client requests by kind", ["kind"], registry=r
        )
        self.retries = Counter(
            "splitserve_proxy_retries", "Attempts retried on another pair, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.first_token_fallbacks = Counter(
            "splitserve_proxy_first_token_fallbacks",
            "Requests served in the plain flow after P's first token, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.edge_rejections = Counter(
            "splitserve_proxy_edge_rejections",
            "Clients refused or cut off at the edge, by reason (docs/proxy.md, Edge limits)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.ejections = Counter(
            "splitserve_proxy_ejections",
            "Servers taken out of rotation, by reason (health_check, health_timeout, "
            "connect_error, outlier)",
            ["pool", "server", "reason"], registry=r,
        )  # fmt: skip
        self.panic_routes = Counter(
            "splitserve_proxy_panic_routes",
            "Requests routed to an ejected server because too few of its pool were in rotation",
            ["pool"], registry=r,
        )  # fmt: skip
        self.in_flight = gauge(
            "splitserve_proxy_in_flight", "Requests in flight per upstream server",
            ["pool", "server"], registry=r, **({"multiprocess_mode": "livesum"} if shared else {}),
        )  # fmt: skip
        self.healthy = Gauge(
            "splitserve_proxy_server_healthy", "1 when the server is in rotation",
            ["pool", "server"], registry=r, multiprocess_mode="livemin",
        )  # fmt: skip
        self.ttft = histogram(
            "splitserve_proxy_ttft_seconds", "Client request to first byte sent back",
            ["route"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = histogram(
            "splitserve_proxy_request_seconds", "Client request to last byte sent back",
            ["route"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream = histogram(
            "splitserve_proxy_upstream_seconds", "One upstream request, sent to answered in full",
            ["pool", "server"], buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill = histogram(
            "splitserve_proxy_prefill_seconds", "Prefill request sent to P's answer",
            buckets=_BUCKETS, registry=r,
        )  # fmt: skip
        self.handoff = histogram(
            "splitserve_proxy_handoff_seconds", "P's answer to D's first byte",
            buckets=_BUCKETS, registry=r,
        )  # fmt: skip

    def of(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: the hot path skips prometheus' label checks."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def render(self) -> bytes:
        """This proxy's metrics; with several workers (Prometheus multiprocess mode), the
        aggregate over all of them."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
