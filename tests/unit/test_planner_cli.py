"""``splitserve plan``: tables, JSON, one-line errors, and no engine import."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from splitserve.cli import cli


def run(*args: str):
    return CliRunner().invoke(cli, ["plan", *args])


def test_textbook_70b_over_hdr100_as_json():
    result = run(
        "--model",
        "Llama-3.1-70B",
        "--gpus-per-replica",
        "1",
        "--link",
        "HDR100",
        "--prompt-tokens",
        "4096",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kv"]["request_bytes"] == 1_342_177_280
    assert data["kv"]["layer_slice_bytes"] == 16_777_216
    assert data["handoff"]["link"] == "HDR100"
    assert data["handoff"]["bulk_s"] > 0.100
    nvlink = next(r for r in data["handoff_by_link"] if r["link"] == "NVLink4")
    assert round(nvlink["bulk_s"] * 1e3, 1) == 1.5
    assert round(data["hardware"]["ridge_flop_per_byte"]) == 295
    # One H100 cannot hold 141 GB of weights: the plan says so instead of sizing pools.
    assert data["pools"]["decode"]["feasible"] is False


def test_tables_for_a_workload():
    result = run(
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "h200",
        "--link",
        "ndr",
        "--rate",
        "4",
        "--ttft-ms",
        "1500",
        "--itl-ms",
        "40",
        "--kv-dtype",
        "fp8",
    )
    assert result.exit_code == 0, result.output
    out = result.output
    for heading in (
        "KV cache (fp8",
        "Handoff of one 4096-token request",
        "NDR *",
        "Prefill arithmetic intensity",
        "Largest prefill chunk",
        "Pools for 4 req/s",
        "Verdict:",
        "Assumptions",
    ):
        assert heading in out
    assert "no SLO given" not in out


def test_custom_link_and_config_path(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "num_hidden_layers": 16,
                "hidden_size": 512,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "head_dim": 128,
                "intermediate_size": 1024,
                "vocab_size": 1024,
            }
        )
    )
    result = run("--model", str(cfg), "--link-gbps", "2.5", "--kv-dtype", "fp32", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kv"]["bytes_per_token"] == 256 * 1024
    assert data["handoff"]["link"] == "custom 2.5 GB/s"
    assert data["handoff"]["link_bytes_per_s"] == 2.5e9


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "Llama-9"], "unknown model 'Llama-9'"),
        (["--model", "Llama-3.1-8B", "--gpu", "V100"], "unknown GPU 'V100'"),
        (["--model", "Llama-3.1-8B", "--link", "pigeon"], "unknown link 'pigeon'"),
        (["--model", "Llama-3.1-8B", "--prompt-tokens", "-5"], "--prompt-tokens"),
        (["--model", "Llama-3.1-8B", "--rate", "-1"], "--rate"),
        (["--model", "Llama-3.1-8B", "--itl-ms", "0"], "--itl-ms"),
        (["--model", "Llama-3.1-8B", "--link-gbps", "-3"], "--link-gbps"),
        (["--model", "Llama-3.1-8B", "--kv-dtype", "int3"], "--kv-dtype"),
        (["--model", "Llama-3.1-8B", "--handoff-results", "x.json"], "--handoff-results"),
        (
            ["--model", "Llama-3.1-8B", "--calibrate", "--calibrate-tokens", "a,b"],
            "--calibrate-tokens",
        ),
        (["--model", "/nowhere/config.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_naming_it(args, words):
    result = run(*args)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert words in lines[0]
    assert isinstance(result.exception, SystemExit)  # a clean exit, not a traceback


def test_handoff_results_without_calibrate_is_refused(tmp_path):
    bench = tmp_path / "h.json"
    bench.write_text("{}")
    result = run("--model", "Llama-3.1-8B", "--handoff-results", str(bench))
    assert result.exit_code == 1
    assert "--handoff-results needs --calibrate" in result.output


def test_config_missing_field_is_one_line(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 2, "hidden_size": 512, "vocab_size": 10}')
    result = run("--model", str(cfg))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {cfg}: config.json has no num_attention_heads / n_head"
    ]


def _fake_calibration(*_: object, **__: object):
    """A fake of ``calibrate_machine``'s result, to test how the CLI uses it (the real
    measurement runs in tests/integration/test_planner_calibrate.py)."""
    from splitserve.planner.calibrate import CalibrationResult, LayerTiming, TimedShape
    from splitserve.planner.catalog import Accelerator, Link
    from splitserve.planner.nixl_probe import NixlBandwidth, NixlPoint

    shape = TimedShape(hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512, scale=1)
    layer = LayerTiming(
        "cpu",
        "float32",
        shape,
        [{"tokens": 64, "measured_s": 0.01, "flops": 1e8, "bytes": 1e6, "predicted_s": 0.01}],
        1e10,
        5e9,
        24e9,
        ["fake"],
    )
    nixl = NixlBandwidth([NixlPoint(1 << 20, 1e-3, 3)], 1e9, 0.0, "fake", ["fake"])
    return CalibrationResult(
        Accelerator(name="measured cpu", bf16_flops=1e10, mem_bytes_per_s=5e9, mem_bytes=24e9),
        Link(name="NIXL measured", bytes_per_s=1e9),
        4,
        layer,
        nixl,
        None,
        0.1,
    )


@pytest.mark.parametrize(
    ("extra", "link"),
    [
        ([], "NIXL measured"),
        (["--link", "HDR100"], "HDR100"),
        (["--link-gbps", "7"], "custom 7 GB/s"),
    ],
)
def test_calibrated_plan_uses_the_measured_link_unless_one_is_given(monkeypatch, extra, link):
    import splitserve.planner.calibrate as calibrate

    monkeypatch.setattr(calibrate, "calibrate_machine", _fake_calibration)
    result = run("--model", "splitserve-tiny", "--calibrate", "--json", *extra)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["hardware"]["accelerator"] == "measured cpu"
    assert data["handoff"]["link"] == link
    assert data["assumptions"][0].startswith("calibrated:")
