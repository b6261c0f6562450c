"""Prometheus counters, gauges and histograms kept in plain Python numbers, for the metrics the
proxy touches on every request.

Runs in the proxy process, on its event loop. ``prometheus_client``'s own metrics take a lock
and check their state on every update: a histogram's ``observe`` cost about 3 us, a gauge's
``inc`` 1.2 us, and a request made about a dozen such updates (docs/benchmarks.md, "Proxy
overhead"). The proxy's event loop is the only writer, so these families hold a number (or a
list of bucket counts) per label set and hand them to the registry when it is scraped, as a
custom collector; an update is an integer or float addition.

Scope: a single process. With several proxy workers (``PROMETHEUS_MULTIPROC_DIR`` set) the
proxy uses ``prometheus_client``'s file-backed metrics instead (``metrics.py`` decides), which
sum over the workers.

Invariants: a scrape shows what ``prometheus_client`` would for the same updates (names,
``_total`` / ``_bucket`` / ``_count`` / ``_sum`` samples, cumulative buckets with ``+Inf``,
label names and values), bar the ``_created`` samples; ``labels()`` checks its values as
``prometheus_client`` does (count, strings), once per label set.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString


class _Family:
    """Label sets to children, and the registration as a collector."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def _new_child(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: str) -> Any:
        """The child of this label set (made on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            values = tuple(str(v) for v in values)
            child = self._children.setdefault(values, self._new_child())
        return child

    def _items(self) -> list[tuple[tuple[str, ...], Any]]:
        return list(self._children.items())  # a snapshot: a scrape may run on another thread

    def describe(self) -> list[Metric]:
        return []  # no name clash check needed beyond the registry's own on collect

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class _ValueFamily(_Family):
    """A family whose children are one number each, exported as ``metric_family``."""

    metric_family: Any = None

    def _new_child(self) -> _Value:
        return _Value()

    def collect(self) -> Iterator[Metric]:
        family = self.metric_family(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            family.add_metric(values, child.value)
        yield family


class LocalCounter(_ValueFamily):
    """A counter family (``name`` without ``_total``, as ``prometheus_client.Counter``)."""

    metric_family = CounterMetricFamily


class LocalGauge(_ValueFamily):
    """A gauge family."""

    metric_family = GaugeMetricFamily


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class LocalHistogram(_Family):
    """A histogram family; with no label names it is its own (one) child: ``observe``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._bounds = tuple(float(b) for b in buckets if b != float("inf"))
        self._les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)
        if not self.labelnames:
            self.observe = self.labels().observe

    def _new_child(self) -> _Buckets:
        return _Buckets(self._bounds)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            cumulative, total = [], 0
            for le, n in zip(self._les, list(child.counts), strict=True):
                total += n
                cumulative.append((le, float(total)))
            family.add_metric(values, cumulative, child.sum)
        yield family
