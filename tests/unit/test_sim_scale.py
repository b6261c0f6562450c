"""benchmarks/sim_scale.py, small: the scale benchmark's own code on 100 servers and 20,000
requests finishes every request (the timing itself is the benchmark's, not a test's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_scale.py"


def test_scale_benchmark_small():
    spec = importlib.util.spec_from_file_location("sim_scale", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = module.run_scale(servers=100, requests=20_000)
    assert row["finished"] == 20_000
    assert row["events"] > 3 * 20_000  # arrival, handoff and at least a step per request
    assert row["attainment"] > 0.9  # the benchmark's load is below the fleet's capacity
