"""Pool sizing and the verdict: both answers are reachable, and the figures behind them hold."""

from __future__ import annotations

import json
import math

import pytest

from splitserve.planner.catalog import get_accelerator, get_link, get_model
from splitserve.planner.plan import auto_gpus_per_replica, make_plan
from splitserve.planner.pools import Slo, Workload, md1_wait

LLAMA_70B = get_model("Llama-3.1-70B")
H100 = get_accelerator("H100")


def test_md1_wait():
    assert md1_wait(0.5, 2.0) == pytest.approx(1.0)
    assert md1_wait(1.0, 1.0) == math.inf


def test_auto_gpus_per_replica_holds_the_weights():
    assert auto_gpus_per_replica(get_model("Llama-3.1-8B"), H100) == 1
    assert auto_gpus_per_replica(LLAMA_70B, H100) == 4  # 141 GB of BF16 weights
    assert auto_gpus_per_replica(get_model("Llama-3.1-405B"), H100) == 16


def test_short_prompts_loose_slo_colocate():
    plan = make_plan(
        LLAMA_70B,
        H100,
        get_link("NVLink4"),
        workload=Workload(prompt_tokens=4096, output_tokens=256, request_rate=10),
        slo=Slo(ttft_s=2.0, itl_s=0.05),
        slo_given=True,
    )
    pools = plan.pools
    assert pools is not None
    assert pools.prefill.feasible and pools.decode.feasible and pools.colocated.feasible
    assert pools.verdict.choice == "colocate"
    colocated_gpus = pools.colocated.replicas * 4
    disagg_gpus = (pools.prefill.replicas + pools.decode.replicas) * 4
    assert colocated_gpus <= disagg_gpus
    assert any("GPUs" in r for r in pools.verdict.reasons)


def test_long_prompts_tight_itl_disaggregate():
    # At an ITL barely above one decode step, a colocated replica has almost no room for prompt
    # chunks: a 16k prompt cannot be prefilled within the TTFT target. A prefill pool can.
    plan = make_plan(
        LLAMA_70B,
        H100,
        get_link("NVLink4"),
        workload=Workload(prompt_tokens=16384, output_tokens=512, request_rate=4),
        slo=Slo(ttft_s=1.0, itl_s=0.011),
        slo_given=True,
    )
    pools = plan.pools
    assert pools is not None
    assert not pools.colocated.feasible
    assert pools.prefill.feasible and pools.decode.feasible
    assert pools.verdict.choice == "disaggregate"
    assert pools.prefill.ttft_s <= 1.0
    assert pools.decode.step_s <= 0.011


def test_slow_link_is_flagged_and_counted_in_ttft():
    # The bench preset is KV-heavy with cheap GEMMs: over 25GbE its slices cannot keep up.
    bench = get_model("splitserve-bench")
    slow = make_plan(
        bench,
        H100,
        get_link("25GbE"),
        kv_dtype="fp32",
        workload=Workload(prompt_tokens=4096, output_tokens=64, request_rate=1),
    )
    fast = make_plan(
        bench,
        H100,
        get_link("NVLink4"),
        kv_dtype="fp32",
        workload=Workload(prompt_tokens=4096, output_tokens=64, request_rate=1),
    )
    assert not slow.handoff.streaming_hides and fast.handoff.streaming_hides
    assert slow.handoff.exposed_streaming_s > fast.handoff.exposed_streaming_s
    assert slow.handoff.exposed_streaming_s < slow.handoff.exposed_bulk_s
    assert any("cannot hide" in r for r in slow.pools.verdict.reasons)
    assert slow.pools.prefill.ttft_s > fast.pools.prefill.ttft_s


def test_model_too_big_for_replica_says_add_gpus():
    plan = make_plan(
        LLAMA_70B, H100, get_link("NVLink4"), gpus_per_replica=1, workload=Workload(request_rate=1)
    )
    assert not plan.pools.decode.feasible
    assert "add GPUs" in plan.pools.decode.why
    assert plan.pools.verdict.choice == "neither"


def test_plan_json_round_trips_and_lists_assumptions():
    plan = make_plan(
        get_model("Mixtral-8x7B"),
        get_accelerator("B200"),
        get_link("NDR"),
        kv_dtype="fp8",
        workload=Workload(request_rate=5),
    )
    data = json.loads(json.dumps(plan.to_dict(), allow_nan=False))
    assert data["kv"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 1
    assert {row["link"] for row in data["handoff_by_link"]} >= {"NDR", "NVLink4", "HDR100"}
    assert data["pools"]["verdict"]["choice"] in {"colocate", "disaggregate", "neither"}
    assert any("MoE" in a for a in data["assumptions"])
    assert any("no SLO given" in a for a in data["assumptions"])


def test_chunk_advice_shrinks_with_decode_load():
    plan = make_plan(get_model("Llama-3.1-8B"), H100, get_link("HDR"))
    chunks = [c.largest_chunk for c in plan.chunks if c.largest_chunk is not None]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > 0
    assert plan.pools.prefill.replicas is None  # no rate: no replica count
