"""The simulator's step time is the planner's roofline, evaluated faster.

``StepTimer`` reduces ``roofline.step_cost`` to coefficients once; these tests hold it to
``step_cost`` itself on every batch shape ``step_cost`` can describe, for a dense, an MoE and an
MLA model, so the simulator cannot drift from the planner's formulas.
"""

from __future__ import annotations

import pytest

from splitserve.planner.catalog import ACCELERATORS, get_model
from splitserve.planner.kv import kv_bytes_per_token_per_layer
from splitserve.planner.roofline import make_replica, step_cost
from splitserve.planner.sim.steptime import StepTimer


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Mixtral-8x7B", "DeepSeek-V2-Lite"])
@pytest.mark.parametrize("gpu,gpus", [("H100", 1), ("A100", 2)])
@pytest.mark.parametrize(
    "prefill_tokens,prefill_seqs,prefill_context,decode_seqs,decode_context",
    [
        (0, 1, 0, 1, 0),
        (0, 1, 0, 64, 1500),
        (2048, 1, 0, 0, 0),
        (4096, 4, 512, 0, 0),
        (512, 1, 1024, 32, 3000),
        (8192, 2, 0, 200, 700),
    ],
)
def test_step_timer_equals_step_cost(
    name, gpu, gpus, prefill_tokens, prefill_seqs, prefill_context, decode_seqs, decode_context
):
    model = get_model(name)
    acc = ACCELERATORS[gpu]
    kv = kv_bytes_per_token_per_layer(model, "bf16")
    expected = step_cost(
        model,
        make_replica(acc, gpus),
        kv,
        prefill_tokens=prefill_tokens,
        prefill_context=prefill_context,
        prefill_seqs=prefill_seqs,
        decode_seqs=decode_seqs,
        decode_context=decode_context,
    ).seconds
    per = prefill_tokens // prefill_seqs
    prefill_pairs = prefill_seqs * (per * prefill_context + per * (per + 1) / 2)
    tokens = prefill_tokens + decode_seqs
    pairs = (prefill_pairs if prefill_tokens else 0) + decode_seqs * (decode_context + 1)
    kv_read = decode_seqs * decode_context + (
        prefill_seqs * prefill_context if prefill_tokens else 0
    )
    sampled = decode_seqs + (prefill_seqs if prefill_tokens else 0)
    got = StepTimer(model, acc, gpus=gpus).seconds(tokens, pairs, kv_read, sampled)
    assert got == pytest.approx(expected, rel=1e-9)


def test_overhead_and_efficiency_apply():
    model = get_model("Llama-3.1-8B")
    base = StepTimer(model, ACCELERATORS["H100"]).seconds(64, 64 * 1001, 64 * 1000, 64)
    slow = StepTimer(model, ACCELERATORS["H100"], efficiency=0.5, overhead_s=0.002)
    assert slow.seconds(64, 64 * 1001, 64 * 1000, 64) == pytest.approx(2 * base + 0.002)
