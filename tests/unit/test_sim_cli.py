"""``splitserve simulate``: tables, JSON, goodput, the cheapest-fleet search, traces,
calibration files, plots, and one-line actionable errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from splitserve.cli import cli

TINY = ["--model", "Llama-3.1-8B", "--requests", "300"]


def run(*args: str):
    return CliRunner().invoke(cli, ["simulate", *args])


def test_compare_fleets_at_two_rates_as_text_and_json():
    args = [*TINY, "--fleet", "4C:H100", "--fleet", "1P:H100,3D:A100/adaptive", "--rate", "5,10"]
    text = run(*args)
    assert text.exit_code == 0, text.output
    assert "4C H100" in text.output and "1P H100 + 3D A100" in text.output
    data = json.loads(run(*args, "--json").output)
    assert len(data["runs"]) == 4
    row = data["runs"][2]
    assert row["gpus"] == 4 and row["cost_per_hour"] == pytest.approx(3.00 + 3 * 1.30)
    assert 0 <= row["attainment"] <= 1 and row["per_class"][0]["ttft_ms"]["p90"] > 0


def test_per_phase_gpu_options_build_the_pools():
    out = run(*TINY, "--prefill", "2", "--decode", "3", "--prefill-gpu", "H100", "--decode-gpu",
              "A100", "--decode-gpus-per-server", "2", "--rate", "4", "--json")  # fmt: skip
    assert out.exit_code == 0, out.output
    row = json.loads(out.output)["runs"][0]
    assert row["label"] == "2P H100 + 3D A100x2" and row["gpus"] == 8


def test_goodput_orders_a_bigger_fleet_above_a_smaller_one():
    out = run(*TINY, "--fleet", "1C:H100", "--fleet", "2C:H100", "--goodput", "--json",
              "--prompt-tokens", "2048", "--ttft-ms", "500", "--min-duration-s", "5")  # fmt: skip
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["goodput"]
    assert 0 < rows[0]["goodput_rps"] < rows[1]["goodput_rps"]


def test_search_returns_the_cheapest_and_the_runner_up():
    out = run("--model", "Llama-3.1-8B", "--requests", "100", "--search", "--rate", "20",
              "--output-tokens", "32", "--min-duration-s", "2", "--search-gpus", "A100,H100",
              "--json")  # fmt: skip
    assert out.exit_code == 0, out.output
    ans = json.loads(out.output)["search"]
    assert ans["best"]["attainment"] >= 0.9
    assert ans["runner_up"]["cost_per_hour"] >= ans["best"]["cost_per_hour"]
    assert ans["runner_up"]["fleet"] in ans["why_runner_up"]


def test_trace_replay_and_its_errors(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"t": i * 0.1, "prompt_tokens": 500, "output_tokens": 20, "prefix_id": i % 3,
             "prefix_tokens": 200} for i in range(50)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = run(*TINY, "--colocated", "2", "--trace", str(trace), "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["runs"][0]["requests"] == 50
    trace.write_text('{"t": 0, "prompt_tokens": 5}\n')
    bad = run(*TINY, "--colocated", "2", "--trace", str(trace))
    assert bad.exit_code == 1
    assert bad.output.startswith("Error: --trace") and "line 1" in bad.output


def test_calibration_file_replaces_the_gpu_it_names(tmp_path):
    cal = {"calibration": {
        "accelerator": {"name": "cpu (measured)", "bf16_flops": 1e10, "mem_bytes_per_s": 4e9,
                        "mem_bytes": 24e9},
        "layer": {"dtype": "float32"},
    }}  # fmt: skip
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    out = run("--model", "splitserve-bench", "--requests", "20", "--colocated", "1",
              "--gpu", "calibrated", "--calibration", str(path), "--rate", "0.05",
              "--prompt-tokens", "256", "--output-tokens", "8", "--ttft-ms", "60000",
              "--itl-ms", "5000", "--json")  # fmt: skip
    assert out.exit_code == 0, out.output
    row = json.loads(out.output)["runs"][0]
    assert row["cost_per_hour"] is None  # a measured machine has no list price
    assert row["per_class"][0]["ttft_ms"]["p50"] > 100  # CPU speed, not an H100's


def test_a_calibration_step_model_times_its_model_and_refuses_another(tmp_path):
    step_model = {
        "model": "splitserve-mid",
        "intercept_ms": 10,
        "ms_per_1k_tokens": 500,
        "ms_per_100_sequences": 20,
        "ms_per_1m_pairs": 100,
    }
    cal = {"calibration": {
        "accelerator": {"name": "cpu (measured)", "bf16_flops": 1e10, "mem_bytes_per_s": 4e9,
                        "mem_bytes": 24e9},
        "layer": {"dtype": "float32"},
        "step_model": step_model,
    }}  # fmt: skip
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    args = ["--requests", "1", "--colocated", "1", "--gpu", "calibrated", "--calibration",
            str(path), "--rate", "0.05", "--prompt-tokens", "1000", "--output-tokens", "2",
            "--ttft-ms", "60000", "--itl-ms", "5000", "--json"]  # fmt: skip
    out = run("--model", "splitserve-mid", *args, "--long-prefill-token-threshold", "256")
    assert out.exit_code == 0, out.output
    ttft = json.loads(out.output)["runs"][0]["per_class"][0]["ttft_ms"]["p50"]
    # four chunks of the 1000-token prompt: 4 x (10 + 0.2) + 500 + 1000 x 1001 / 2 x 1e-4
    assert ttft == pytest.approx(4 * 10.2 + 500 + 50.05)
    other = run("--model", "splitserve-bench", *args)
    assert other.exit_code != 0
    assert "measured with splitserve-mid, not splitserve-bench" in other.output


def test_plots_are_written(tmp_path):
    out = run(*TINY, "--fleet", "2C:H100", "--rate", "5,20", "--plot-dir", str(tmp_path))
    assert out.exit_code == 0, out.output
    assert (tmp_path / "attainment_vs_rate.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fleet", "3X:H100", "--rate", "1"], "role letter"),
        (["--fleet", "P:H100", "--rate", "1"], "is not <count><P|D|C>"),
        (["--fleet", "2C:TPU", "--rate", "1"], "unknown GPU 'TPU'"),
        (["--fleet", "2P:H100", "--rate", "1"], "needs a decode pool"),
        (["--fleet", "2C:H100/fast", "--rate", "1"], "unknown flag"),
        (["--colocated", "2"], "give --rate"),
        (["--rate", "1"], "no servers"),
        (["--colocated", "1", "--rate", "x"], "--rate: expected comma-separated numbers"),
        (["--colocated", "1", "--search"], "--search needs one --rate"),
        (["--colocated", "1", "--rate", "1", "--price", "H100"], "GPU=DOLLARS"),
        (["--colocated", "1", "--rate", "1", "--routing", "random"], "'random' is not one of"),
    ],
)
def test_errors_are_one_actionable_line(args, message):
    out = run("--model", "Llama-3.1-8B", *args)
    assert out.exit_code == 1, out.output
    assert out.output.startswith("Error: ") and out.output.count("\n") == 1, out.output
    assert message in out.output
