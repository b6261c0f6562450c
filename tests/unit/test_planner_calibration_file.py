"""``splitserve plan --calibration FILE``: loading, the --gpu check, and the plan it makes.

The files here are written by hand in the formats the loader documents; the real ones come from
``benchmarks/gpu_proof.py`` (tests/integration/test_gpu_proof_cpu.py loads one it wrote).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from splitserve.cli import cli
from splitserve.planner.calibration_file import FORMAT, load_calibration
from splitserve.planner.catalog import PlannerInputError

H200_MEASURED = {
    "name": "NVIDIA H200 (measured)",
    "bf16_flops": 600e12,
    "mem_bytes_per_s": 4.0e12,
    "mem_bytes": 141e9,
}


def gpu_proof_file(tmp_path, **changes):
    data = {
        "format": FORMAT,
        "gpu": "H200",
        "device_name": "NVIDIA H200",
        "weight_bytes": 2,
        "accelerator": H200_MEASURED,
        "transfer_link": {"name": "NIXL cuda measured", "bytes_per_s": 1e11},
        "steps": {
            "points": [
                {
                    "prefill_tokens": 1024,
                    "prefill_context": 0,
                    "decode_seqs": 0,
                    "decode_context": 0,
                    "measured_s": 0.002,
                    "roofline_measured_s": 0.0018,
                }
            ]
        },
        "notes": ["a note"],
        **changes,
    }
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(data))
    return path


def plan(*args: str):
    return CliRunner().invoke(cli, ["plan", "--model", "Llama-3.1-8B", *args])


def test_a_gpu_proof_file_replaces_the_accelerator_not_the_link(tmp_path):
    path = gpu_proof_file(tmp_path)
    loaded = load_calibration(path)
    assert loaded.accelerator.bf16_flops == 600e12 and loaded.weight_bytes == 2
    assert loaded.link is None  # two processes on one GPU are no P->D link
    assert loaded.matches("H200") and not loaded.matches("H100")
    result = plan("--gpu", "H200", "--calibration", str(path), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["hardware"]["ridge_flop_per_byte"] == pytest.approx(150)
    assert data["handoff"]["link"] == "NVLink4"
    assert data["assumptions"][0].startswith(f"calibrated from {path}")
    assert data["calibration"]["steps"]["points"][0]["measured_s"] == 0.002
    text = plan("--calibration", str(path))
    assert text.exit_code == 0, text.output
    assert f"Calibration (from {path})" in text.output and "n=1024 c=0 B=0 d=0" in text.output


def test_the_gpu_named_must_be_the_one_measured(tmp_path):
    path = gpu_proof_file(tmp_path)
    result = plan("--gpu", "H100", "--calibration", str(path))
    assert result.exit_code == 1
    assert "was measured on H200, not --gpu H100" in result.output
    both = plan("--calibrate", "--calibration", str(path))
    assert both.exit_code == 1 and "choose one" in both.output


def test_plan_calibrate_json_loads_with_its_link(tmp_path):
    path = tmp_path / "plan.json"
    calibration = {
        "accelerator": {**H200_MEASURED, "name": "measured cuda"},
        "link": {"name": "NIXL measured", "bytes_per_s": 2e10, "per_transfer_s": 1e-5},
        "layer": {"dtype": "bfloat16", "points": []},
        "notes": [],
    }
    path.write_text(json.dumps({"model": {}, "calibration": calibration}))
    loaded = load_calibration(path)
    assert loaded.weight_bytes == 2 and loaded.link is not None
    result = plan("--calibration", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["handoff"]["link"] == "NIXL measured"
    given = plan("--calibration", str(path), "--link", "HDR100", "--json")
    assert json.loads(given.output)["handoff"]["link"] == "HDR100"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "Expecting value"),
        (json.dumps({"notes": []}), "no 'accelerator' object"),
        (json.dumps({"format": "other/9", "accelerator": H200_MEASURED}), "expected"),
        (
            json.dumps({"format": FORMAT, "gpu": "H200", "accelerator": H200_MEASURED}),
            "weight bytes unknown",
        ),
        (
            json.dumps({"accelerator": {**H200_MEASURED, "bf16_flops": -1}}),
            "bf16_flops",
        ),
    ],
)
def test_bad_files_are_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PlannerInputError, match=message):
        load_calibration(path)
    result = plan("--calibration", str(path))
    assert result.exit_code == 1
    assert result.output.startswith("Error: --calibration") and result.output.count("\n") == 1
