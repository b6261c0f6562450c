"""The pure parts of calibration: the bandwidth fit, layer scaling, benchmark-record parsing."""

from __future__ import annotations

import json

import pytest

from splitserve.planner.calibrate import check_handoff_results, layer_shape
from splitserve.planner.catalog import Link, PlannerInputError, get_model
from splitserve.planner.nixl_probe import NixlPoint, fit_bandwidth


def test_fit_recovers_bandwidth_and_fixed_cost():
    points = [NixlPoint(n, 50e-6 + n / 5e9, 5) for n in (1 << 20, 8 << 20, 32 << 20)]
    bandwidth, fixed = fit_bandwidth(points)
    assert bandwidth == pytest.approx(5e9)
    assert fixed == pytest.approx(50e-6)


def test_fit_uses_the_extremes_and_bounds_the_fixed_cost():
    points = [NixlPoint(1 << 20, 1e-3, 5), NixlPoint(32 << 20, 2e-3, 5)]
    points.append(NixlPoint(8 << 20, 30e-3, 5))  # a noisy middle point is ignored
    bandwidth, fixed = fit_bandwidth(points)
    assert bandwidth == pytest.approx((31 << 20) / 1e-3)
    assert 0 <= fixed <= 1e-3
    assert fixed + (1 << 20) / bandwidth == pytest.approx(1e-3)
    # A largest transfer no slower than the smallest: bytes / time of the largest, no fixed cost.
    flat = [NixlPoint(1 << 20, 2e-3, 5), NixlPoint(32 << 20, 2e-3, 5)]
    assert fit_bandwidth(flat) == ((32 << 20) / 2e-3, 0.0)
    assert fit_bandwidth([NixlPoint(1 << 20, 1e-3, 5)]) == ((1 << 20) / 1e-3, 0.0)


def test_layer_shape_scales_and_keeps_gqa_and_head_dim():
    shape, notes = layer_shape(get_model("Llama-3.1-70B"), 4)
    assert (shape.hidden, shape.kv_heads, shape.heads, shape.head_dim) == (2048, 2, 16, 128)
    assert shape.mlp == 28672 // 4 and notes == []
    moe, notes = layer_shape(get_model("Mixtral-8x7B"))
    assert moe.mlp == 2 * 14336 and "MoE" in notes[0]
    _, notes = layer_shape(get_model("DeepSeek-V2-Lite"))
    assert any("MLA" in n for n in notes)


def test_handoff_results_rows_and_errors(tmp_path):
    model = get_model("splitserve-bench")  # 256 KiB of fp32 KV per token
    link = Link(name="measured", bytes_per_s=1e9)
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"runs": [{"prompt_len": 1000, "pull_ms": 524.288}]}))
    rows = check_handoff_results(path, model, "fp32", link)["rows"]
    assert rows[0]["predicted_s"] == pytest.approx(1000 * 262144 / 1e9)
    assert rows[0]["ratio"] == pytest.approx(2.0)
    path.write_text(json.dumps({"runs": [{"ttft_ms": 3}]}))
    with pytest.raises(PlannerInputError, match="no record"):
        check_handoff_results(path, model, "fp32", link)
    with pytest.raises(PlannerInputError, match="--handoff-results"):
        check_handoff_results(tmp_path / "missing.json", model, "fp32", link)


def test_torch_threads_set_for_the_block_and_restored():
    torch = pytest.importorskip("torch")
    from splitserve.planner.calibrate import _torch_threads

    before = torch.get_num_threads()
    with _torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with _torch_threads(None):
        assert torch.get_num_threads() == before
