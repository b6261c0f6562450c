"""``splitserve plan --prefill-gpu/--decode-gpu``: pools sized on their own hardware and
compared by cost (the simulator's prices), the same pools as before when the hardware is."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from splitserve.cli import cli

BASE = ["plan", "--model", "Llama-3.1-70B", "--rate", "10", "--prompt-tokens", "4096", "--json"]


def plan(*args: str) -> dict:
    out = CliRunner().invoke(cli, [*BASE, *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_same_hardware_per_phase_gives_the_same_pools():
    one = plan("--gpu", "H100")
    split = plan("--gpu", "H100", "--prefill-gpu", "H100", "--decode-gpu", "H100")
    for pool in ("prefill", "decode", "colocated"):
        assert split["pools"][pool] == one["pools"][pool]
    assert "phases" not in one["hardware"] and "phases" in split["hardware"]


def test_decode_on_another_part_is_sized_there_and_priced():
    p = plan("--prefill-gpu", "H100", "--decode-gpu", "A100", "--decode-gpus-per-replica", "4")
    ph = p["hardware"]["phases"]
    assert ph["decode"] == {"accelerator": "A100", "gpus_per_replica": 4, "price_per_gpu_hour": 1.3}
    one = plan("--gpu", "H100")
    assert p["pools"]["decode"]["step_s"] > one["pools"]["decode"]["step_s"]  # less bandwidth
    d, pre = p["pools"]["decode"], p["pools"]["prefill"]
    expected = pre["replicas"] * 4 * 3.00 + d["replicas"] * 4 * 1.30  # 70B: 4 H100 per replica
    assert ph["disaggregated_cost_per_hour"] == pytest.approx(expected)
    assert any("$" in r for r in p["pools"]["verdict"]["reasons"])


def test_user_prices_change_the_verdict():
    cheap_h100 = plan("--prefill-gpu", "H100", "--decode-gpu", "H100", "--price", "H100=0.5")
    assert cheap_h100["hardware"]["phases"]["prefill"]["price_per_gpu_hour"] == 0.5


@pytest.mark.parametrize(
    "args,message",
    [
        (["--decode-gpu", "TPU"], "unknown GPU 'TPU'"),
        (["--price", "H100=cheap"], "GPU=DOLLARS_PER_GPU_HOUR"),
    ],
)
def test_errors_name_the_option(args, message):
    out = CliRunner().invoke(cli, [*BASE, *args])
    assert out.exit_code == 1 and out.output.startswith("Error: ") and message in out.output
