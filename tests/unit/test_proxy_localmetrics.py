"""``localmetrics``' families against ``prometheus_client``'s own: the same updates give the same
scrape (bar ``_created`` samples), so a dashboard cannot tell which one the proxy used."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.proxy.localmetrics import LocalCounter, LocalGauge, LocalHistogram

BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def scrape(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_local_families_scrape_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    for registry, counter, gauge, histogram in (
        (ours, LocalCounter, LocalGauge, LocalHistogram),
        (theirs, Counter, Gauge, Histogram),
    ):
        c = counter("x_requests", "requests", ["route", "status"], registry=registry)
        g = gauge("x_in_flight", "in flight", ["pool"], registry=registry)
        h = histogram("x_seconds", "latency", ["route"], buckets=BUCKETS, registry=registry)
        plain = histogram("x_plain_seconds", "no labels", buckets=BUCKETS, registry=registry)
        c.labels("chat", "200").inc()
        c.labels("chat", "200").inc(2)
        c.labels("completions", "503").inc()
        g.labels("decode").inc()
        g.labels("decode").inc()
        g.labels("decode").dec()
        g.labels("prefill").set(3)
        # On a bound, between bounds, below the first, above the last (+Inf).
        for v in (0.001, 0.005, 0.0001, 0.5, 10, 11):
            h.labels("chat").observe(v)
            plain.observe(v)
        h.labels("completions").observe(0.2)
    assert scrape(ours) == scrape(theirs)


def test_labels_are_checked() -> None:
    c = LocalCounter("y", "d", ["a", "b"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        c.labels("only one")
