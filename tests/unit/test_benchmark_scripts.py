"""The benchmark scripts: each still starts (its imports resolve after a module moves) and
offers its documented options; the shared metrics reader sums samples as the figures need.

The benchmarks themselves are never run here (they are measurements, not tests).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "options"),
    [
        (
            "proxy_overhead.py",
            ["--requests", "--concurrency", "--rounds", "--out", "--plot", "--proxy-workers",
             "--baseline", "--only", "--prompt-chars", "--load", "--seconds", "--stub-server",
             "--pin"],
        ),
        (
            "handoff.py",
            ["--lengths", "--repeats", "--transports", "--contenders", "--out", "--seed",
             "--kv-cache-gib", "--resummarize"],
        ),
        ("chunking.py", ["--duration", "--out"]),
        ("goodput.py", ["--rates", "--duration", "--seed", "--only", "--quick", "--dry-run"]),
        (
            "soak.py",
            ["--minutes", "--pairs", "--concurrency", "--disconnect", "--check", "--kill-at",
             "--out", "--plot", "--check-targets"],
        ),
    ],
)  # fmt: skip
def test_script_help_lists_its_options(script: str, options: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for option in options:
        assert option in done.stdout, option


def test_every_benchmark_module_imports() -> None:
    """Also the modules no ``--help`` imports (``handoff_sglang`` is imported mid-run)."""
    modules = ["handoff_sglang", "chunking"] + [
        f"{package}.{path.stem}"
        for package in (
            "common",
            "proxybench",
            "handoffbench",
            "chunkingbench",
            "goodputbench",
            "noregretbench",
        )
        for path in sorted((BENCHMARKS / package).glob("*.py"))
        if path.stem != "__init__"
    ]
    code = f"import importlib, sys; sys.path.insert(0, {str(BENCHMARKS)!r}); " + "; ".join(
        f"importlib.import_module({m!r})" for m in modules
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _metrics_module():
    spec = importlib.util.spec_from_file_location(
        "bench_common_metrics", BENCHMARKS / "common" / "metrics.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sample_sum_adds_label_sets_and_reads_absent_as_zero() -> None:
    metrics = _metrics_module()
    registry = CollectorRegistry()
    exposed = Histogram(
        "vllm:splitserve_exposed_handoff_seconds", "h", ["engine"], registry=registry
    )
    exposed.labels("0").observe(0.25)
    exposed.labels("1").observe(0.5)
    posts = Counter("vllm:splitserve_post_seconds", "c", ["engine"], registry=registry)
    posts.labels("0").inc(1.5)
    posts.labels("1").inc(2)
    text = generate_latest(registry).decode()
    assert metrics.sample_sum(text, "vllm:splitserve_post_seconds_total") == 3.5
    assert metrics.histogram_in(text, "vllm:splitserve_exposed_handoff_seconds") == (0.75, 2.0)
    assert metrics.sample_sum(text, "vllm:splitserve_loads_completed_on_first_token_total") == 0
    # A name is matched whole: a histogram's buckets are not its sum.
    assert metrics.sample_sum(text, "vllm:splitserve_exposed_handoff_seconds") == 0


def test_token_times_counts_only_events_with_choices() -> None:
    import asyncio

    sys.path.insert(0, str(BENCHMARKS))
    from common.sse import token_times

    async def lines():
        for raw in (
            b": keep-alive\n",
            b'data: {"choices": [{"text": "a"}]}\n',
            b"\n",
            b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n',
            b'data: {"choices": [{"text": "b"}]}\n',
            b"data: [DONE]\n",
        ):
            yield raw

    async def collect() -> list[float]:
        return [t async for t in token_times(lines())]

    times = asyncio.run(collect())
    assert len(times) == 2 and times[0] <= times[1]


def test_proxy_overhead_pin_reads_two_disjoint_cpu_sets() -> None:
    import os

    sys.path.insert(0, str(BENCHMARKS))
    from proxy_overhead import parse_pin

    assert parse_pin(None) is None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        a, b = cpus[0], cpus[1]
        assert parse_pin(f"{a}:{b}") == ({a}, {b})
        with pytest.raises(SystemExit, match="disjoint"):
            parse_pin(f"{a}:{a},{b}")
    with pytest.raises(SystemExit, match="may only use CPUs"):
        parse_pin(f"{cpus[0]}:{10**6}")
    with pytest.raises(SystemExit, match="expected CONTENDER_CPUS:HARNESS_CPUS"):
        parse_pin("0-1")
