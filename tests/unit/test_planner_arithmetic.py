"""The planner's arithmetic reproduces the textbook's worked numbers (issue 7) and its own
closed forms."""

from __future__ import annotations

import pytest

from splitserve.planner.catalog import (
    Link,
    PlannerInputError,
    custom_link,
    get_accelerator,
    get_link,
    get_model,
)
from splitserve.planner.handoff import exposed_streaming_seconds, handoff, transfer_seconds
from splitserve.planner.kv import dtype_bytes, kv_bytes_per_token, kv_sizes
from splitserve.planner.roofline import (
    attention_flops,
    gemm_intensity,
    largest_chunk_under,
    layer_intensity,
    make_replica,
    mean_layer,
    min_tokens_above_ridge,
    min_tokens_for_gemm,
    step_cost,
    weight_bytes_total,
)

LLAMA_70B = get_model("Llama-3.1-70B")  # 80 layers, 8 KV heads, head dim 128


def test_70b_kv_at_4096_tokens_bf16_is_about_1_34_gb():
    kv = kv_sizes(LLAMA_70B, "bf16", 4096)
    assert kv.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv.request_bytes == 1_342_177_280
    assert round(kv.request_bytes / 1e9, 2) == 1.34


def test_70b_layer_slice_is_about_17_mb():
    kv = kv_sizes(LLAMA_70B, "bf16", 4096)
    assert kv.layer_slice_bytes == 16_777_216
    assert round(kv.layer_slice_bytes / 1e6) == 17


def test_bulk_transfer_nvlink4_about_1_5_ms_and_hdr100_over_100_ms():
    nbytes = kv_sizes(LLAMA_70B, "bf16", 4096).request_bytes
    nvlink = transfer_seconds(nbytes, get_link("NVLink4"))
    hdr100 = transfer_seconds(nbytes, get_link("HDR100"))
    assert get_link("NVLink4").bytes_per_s == 900e9
    assert get_link("HDR100").bytes_per_s == 12.5e9
    assert round(nvlink * 1e3, 1) == 1.5
    assert hdr100 > 0.100
    assert round(hdr100 * 1e3) == 107


def test_gemm_4096_over_512_tokens_is_about_455_flop_per_byte_above_h100_ridge():
    intensity = gemm_intensity(512, 4096, 4096, dtype_bytes=2)
    assert round(intensity) == 455
    ridge = get_accelerator("H100").ridge_flop_per_byte
    assert round(ridge) == 295
    assert intensity > ridge
    # The closed form: 2 n d' / (b (n + d')), independent of d.
    assert gemm_intensity(512, 8192, 4096) == pytest.approx(512 * 4096 / (512 + 4096))


def test_min_tokens_for_gemm_is_the_exact_crossing():
    ridge = get_accelerator("H100").ridge_flop_per_byte
    n = min_tokens_for_gemm(4096, ridge)
    assert n is not None
    assert gemm_intensity(n, 4096, 4096) >= ridge > gemm_intensity(n - 1, 4096, 4096)
    assert min_tokens_for_gemm(256, ridge) is None  # 2 d' <= b R: never compute-bound


def test_kv_dtypes_and_derived_head_dim(tmp_path):
    assert [dtype_bytes(d) for d in ("fp32", "bf16", "fp16", "fp8")] == [4, 2, 2, 1]
    cfg = tmp_path / "config.json"
    cfg.write_text(
        '{"num_hidden_layers": 2, "hidden_size": 512, "num_attention_heads": 8,'
        ' "intermediate_size": 1024, "vocab_size": 1000}'
    )
    m = get_model(str(cfg))
    assert (m.head_dim, m.num_kv_heads) == (64, 8)  # derived; no GQA key means MHA
    assert kv_bytes_per_token(m, "fp8") == 2 * 2 * 8 * 64
    assert get_model(str(tmp_path)).num_layers == 2  # a folder holding config.json


def test_gqa_and_explicit_head_dim_from_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        '{"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,'
        ' "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512,'
        ' "vocab_size": 1024}'
    )
    m = get_model(str(cfg))
    assert kv_bytes_per_token(m, "fp32") == 2 * 4 * 2 * 128 * 4


def test_mla_caches_one_latent_per_token():
    m = get_model("DeepSeek-V2-Lite")
    assert kv_sizes(m, "bf16", 1).bytes_per_token_per_layer == (512 + 64) * 2


def test_catalog_parameter_counts_match_published_sizes():
    assert weight_bytes_total(get_model("Llama-3.1-8B"), 1) == pytest.approx(8.03e9, rel=0.01)
    assert weight_bytes_total(LLAMA_70B, 1) == pytest.approx(70.6e9, rel=0.01)
    assert weight_bytes_total(get_model("Llama-3.1-405B"), 1) == pytest.approx(405.9e9, rel=0.01)
    mixtral = get_model("Mixtral-8x7B")
    assert weight_bytes_total(mixtral, 1) == pytest.approx(46.7e9, rel=0.01)
    layer = mean_layer(mixtral)
    active = layer.active_weight_elems * 32 + 2 * 4096 * 32000
    assert active == pytest.approx(12.9e9, rel=0.02)
    assert weight_bytes_total(get_model("DeepSeek-V2-Lite"), 1) == pytest.approx(15.7e9, rel=0.02)


@pytest.mark.parametrize("model", ["Llama-3.1-8B", "Mixtral-8x7B", "DeepSeek-V2-Lite"])
def test_min_budget_is_the_layer_crossing(model):
    m = get_model(model)
    ridge = get_accelerator("H100").ridge_flop_per_byte
    n = min_tokens_above_ridge(m, ridge)
    assert n is not None
    # With every expert read (the bound the closed form uses), n is the exact crossing; the
    # real intensity at n is at least as high, because fewer experts are touched.
    assert layer_intensity(m, n) >= ridge * (1 - 1e-9)
    if not m.is_moe:
        assert layer_intensity(m, n - 1) < ridge


def test_streaming_exposes_one_slice_when_transfer_keeps_up():
    assert exposed_streaming_seconds(80, 0.001, 0.002) == 0.001
    # Slower link: a queue of (L - 1) (t_x - t_c) builds behind the last layer.
    assert exposed_streaming_seconds(80, 0.003, 0.002) == pytest.approx(0.003 + 79 * 0.001)
    # Never worse than bulk, never better than one slice.
    for t_x, t_c in [(0.001, 0.01), (0.01, 0.001), (0.005, 0.005)]:
        exposed = exposed_streaming_seconds(16, t_x, t_c)
        assert t_x <= exposed <= 16 * t_x + 1e-12


def test_streaming_tail_hides_part_of_the_last_slice_and_done_adds_its_delivery():
    """``max(0, t_x + (L - 1) max(0, t_x - t_c) - t_tail) + t_done``; both 0 is the plain
    figure (what ``splitserve plan`` prints unless given them)."""
    for t_x, t_c in [(0.001, 0.002), (0.003, 0.002)]:
        assert exposed_streaming_seconds(80, t_x, t_c, 0.0, 0.0) == exposed_streaming_seconds(
            80, t_x, t_c
        )
    # link keeps up: one slice, of which the tail hides 0.4 ms; DONE adds 0.1 ms
    assert exposed_streaming_seconds(80, 0.001, 0.002, 0.0004, 0.0001) == pytest.approx(0.0007)
    # a tail longer than the slice hides all of it: only DONE's delivery is left
    assert exposed_streaming_seconds(80, 0.001, 0.002, 0.005, 0.0001) == pytest.approx(0.0001)
    # a backlog: the tail comes off the whole of it
    backlog = 0.003 + 79 * 0.001
    assert exposed_streaming_seconds(80, 0.003, 0.002, 0.002, 0.0) == pytest.approx(backlog - 0.002)
    link = Link(name="x", bytes_per_s=1e9, per_transfer_s=0.0)
    h = handoff(link, 10, 2e6, 1e-2, forward_tail_s=1e-3, done_s=5e-4)
    assert h.exposed_streaming_s == pytest.approx(2e-3 - 1e-3 + 5e-4)
    assert handoff(link, 10, 2e6, 1e-2).exposed_streaming_s == pytest.approx(2e-3)


def test_handoff_over_parallel_links_and_fixed_cost():
    link = Link(name="x", bytes_per_s=1e9, per_transfer_s=1e-3)
    h = handoff(
        link, num_layers=10, layer_slice_bytes=2e6, layer_compute_s=1e-2, links_in_parallel=2
    )
    assert h.layer_transfer_s == pytest.approx(1e-3 + 1e-3)
    assert h.bulk_s == pytest.approx(1e-3 + 1e-2)
    assert h.streaming_hides and h.exposed_streaming_s == pytest.approx(2e-3)


def test_step_cost_roofline_and_chunk_search():
    h100 = make_replica(get_accelerator("H100"))
    per_layer = kv_sizes(LLAMA_70B, "bf16", 1).bytes_per_token_per_layer
    decode = step_cost(LLAMA_70B, h100, per_layer, decode_seqs=1, decode_context=1000)
    assert not decode.compute_bound  # one decode is memory-bound
    assert decode.seconds == pytest.approx(decode.bytes / 3.35e12)
    prefill = step_cost(LLAMA_70B, h100, per_layer, prefill_tokens=8192)
    assert prefill.compute_bound
    chunk = largest_chunk_under(LLAMA_70B, h100, per_layer, 0.1, 8, 2000)
    assert chunk is not None and chunk > 0

    def step(c: int) -> float:
        return step_cost(
            LLAMA_70B, h100, per_layer, prefill_tokens=c, decode_seqs=8, decode_context=2000
        ).seconds

    assert step(chunk) <= 0.1 < step(chunk + 1)
    assert largest_chunk_under(LLAMA_70B, h100, per_layer, 1e-4, 8, 2000) is None


def test_attention_flops_causal_count():
    m = get_model("splitserve-tiny")  # 4 heads of 64
    assert attention_flops(m, 1, 0) == 2 * 4 * 128 * 1
    assert attention_flops(m, 4, 10) == 2 * 4 * 128 * (40 + 10)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: get_model("Llama-9"), "unknown model 'Llama-9'"),
        (lambda: get_accelerator("V100"), "unknown GPU 'V100'"),
        (lambda: get_link("carrier-pigeon"), "unknown link 'carrier-pigeon'"),
        (lambda: custom_link(-3), "positive GB/s"),
        (lambda: dtype_bytes("int3"), "unknown KV dtype 'int3'"),
        (lambda: kv_sizes(LLAMA_70B, "bf16", -1), "tokens must be >= 0"),
        (lambda: get_model("/nonexistent/config.json"), "does not exist"),
        (lambda: make_replica(get_accelerator("H100"), 0), "GPUs per replica"),
        (lambda: make_replica(get_accelerator("H100"), 1, 1.5), "efficiency"),
    ],
)
def test_bad_inputs_name_themselves(call, words):
    with pytest.raises(PlannerInputError, match=words.replace("(", r"\(")):
        call()


def test_config_missing_a_field_names_it(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 2, "hidden_size": 512, "vocab_size": 1000}')
    with pytest.raises(PlannerInputError, match="num_attention_heads"):
        get_model(str(cfg))
    cfg.write_text(
        '{"num_hidden_layers": -2, "hidden_size": 512, "num_attention_heads": 8,'
        ' "intermediate_size": 1024, "vocab_size": 1000}'
    )
    with pytest.raises(PlannerInputError, match="num_layers"):
        get_model(str(cfg))
    cfg.write_text("not json")
    with pytest.raises(PlannerInputError, match="cannot read model config"):
        get_model(str(cfg))
