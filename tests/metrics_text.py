"""Read a server's Prometheus ``/metrics`` in tests, through ``prometheus_client``'s own parser.

One reader for every test that checks a metric of vLLM, SGLang or our proxy, instead of a regex
per test (a regex silently matches nothing when a label or a suffix changes; the parser reads
what the exposition format says). Imported as ``from metrics_text import ...``: pytest puts
``tests/`` (the folder of the root ``conftest.py``, without ``__init__.py``) on ``sys.path``.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def fetch_metrics(url: str, timeout: float = 30.0) -> str:
    """The text of ``{url}/metrics``."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
        return response.read().decode()


def samples(text: str, name: str, **labels: str) -> list[Sample]:
    """Samples named exactly ``name`` (a counter's ``..._total``, a histogram's ``..._count``)
    whose labels include ``labels``."""
    return [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the values of ``samples(text, name, **labels)`` (0.0 when there is none)."""
    return float(sum(sample.value for sample in samples(text, name, **labels)))
