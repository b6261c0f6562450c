"""``splitserve plan --calibrate`` for real: torch times a layer on this machine, NIXL moves
host memory between two real processes, and the plan uses the measured figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve.planner.calibrate import time_layer
from splitserve.planner.catalog import get_model
from splitserve.planner.kv import kv_bytes_per_token

pytestmark = pytest.mark.integration


def test_calibrated_plan_uses_measured_figures(tmp_path):
    model = get_model("splitserve-tiny")
    # A benchmark result in the shape benchmarks/handoff.py may write (two prompt lengths).
    bench = tmp_path / "handoff.json"
    bench.write_text(
        json.dumps(
            {
                "results": [
                    {"prompt_tokens": 512, "transfer_ms": 3.0},
                    {"prompt_tokens": 2048, "transfer_ms": 9.0},
                ]
            }
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "splitserve.cli",
        "plan",
        "--model",
        "splitserve-tiny",
        "--kv-dtype",
        "fp32",
        "--prompt-tokens",
        "1024",
        "--calibrate",
        "--calibrate-device",
        "cpu",
        "--calibrate-tokens",
        "64,256",
        "--calibrate-budget-s",
        "5",
        "--nixl-sizes-mib",
        "1,4",
        "--handoff-results",
        str(bench),
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)
    cal = plan["calibration"]

    layer = cal["layer"]
    assert layer["device"] == "cpu" and layer["dtype"] == "float32"
    assert [p["tokens"] for p in layer["points"]] == [64, 256]
    assert all(p["measured_s"] > 0 and p["flops"] > 0 for p in layer["points"])
    assert layer["shape"]["scale"] == 1  # the tiny layer is timed at full size

    nixl = cal["nixl"]
    assert [p["bytes"] for p in nixl["points"]] == [1 << 20, 4 << 20]
    assert all(p["median_s"] > 0 for p in nixl["points"])
    assert nixl["bytes_per_s"] > 0

    # The plan is made with what was measured, not with the catalog.
    hw = plan["hardware"]
    assert hw["accelerator"] == "measured cpu"
    assert hw["flops"] == pytest.approx(layer["flops_per_s"])
    assert hw["mem_bytes_per_s"] == pytest.approx(layer["mem_bytes_per_s"])
    assert plan["handoff"]["link"] == "NIXL measured"
    kv_bytes = 1024 * kv_bytes_per_token(model, "fp32")
    expected_bulk = nixl["per_transfer_s"] + kv_bytes / nixl["bytes_per_s"]
    assert plan["handoff"]["bulk_s"] == pytest.approx(expected_bulk)
    assert any("calibrated" in a for a in plan["assumptions"])

    rows = cal["handoff_check"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [512, 2048]
    for row in rows:
        predicted = (
            nixl["per_transfer_s"]
            + row["prompt_tokens"] * kv_bytes_per_token(model, "fp32") / nixl["bytes_per_s"]
        )
        assert row["predicted_s"] == pytest.approx(predicted)
        assert row["ratio"] == pytest.approx(row["measured_s"] / predicted)


def test_a_layer_too_big_for_the_budget_is_scaled_down_and_says_so():
    timing = time_layer(get_model("Llama-3.1-70B"), [32], device="cpu", budget_s=1.0)
    # A full 70B layer holds 3.2 GiB of fp32 weights, over the 1 GiB cap: memory alone forces at
    # least 2x; how much further the time budget scales it depends on this machine's speed.
    assert timing.shape.scale >= 2
    assert timing.shape.head_dim == 128
    assert timing.shape.heads // timing.shape.kv_heads == 8  # GQA ratio kept
    assert "scaled down" in timing.notes[0]
    assert timing.points[0]["measured_s"] > 0
