"""A server's ``/metrics`` page, read once per moment and parsed with ``prometheus_client``.

Runs in the benchmark's process. A figure is the difference of two readings taken around a
request, so every helper sums a sample over its label sets (engine, model, reason ...) and
reads an absent sample as 0: a counter the server has not created yet has not counted.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def metrics_text(url: str, timeout: float = 30.0) -> str:
    """``url``'s ``/metrics`` page (read once per server per moment, then parsed)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as response:
        return response.read().decode()


def sample_sum(text: str, name: str) -> float:
    """Sample ``name`` of a metrics page (a counter's ``..._total``, a histogram's ``..._sum``),
    summed over its label sets; 0 when absent."""
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def histogram_in(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` on a metrics page."""
    return sample_sum(text, name + "_sum"), sample_sum(text, name + "_count")


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` on ``url``'s metrics page now."""
    return histogram_in(metrics_text(url), name)
