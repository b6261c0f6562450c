"""Roofline arithmetic: FLOPs and bytes of a layer, its arithmetic intensity, step times.

Pure functions; runs in the caller's process. docs/planner.md derives every formula.

Conventions and invariants:
- a GEMM of ``n`` tokens through a ``d x d'`` weight costs ``2 n d d'`` FLOPs and moves
  ``b (d d' + n d)`` bytes (weights and input activations read; the output write is left out,
  as in the textbook figure), so its intensity is ``2 n d' / (b (n + d'))``;
- a step's time is ``max(FLOPs / F, bytes / B)`` for a replica of peak ``F`` FLOP/s and memory
  bandwidth ``B`` (``Replica`` already scaled by GPUs and efficiency);
- all layers of a model are treated as its mean layer (MoE models with leading dense layers
  average them), so per-layer figures are ``total / num_layers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.planner.catalog import Accelerator, ModelShape, PlannerInputError

BF16_BYTES = 2


def gemm_flops(tokens: int, d_in: int, d_out: int) -> float:
    return 2.0 * tokens * d_in * d_out


def gemm_bytes(
    tokens: int, d_in: int, d_out: int, dtype_bytes: int = BF16_BYTES, count_output: bool = False
) -> float:
    elems = d_in * d_out + tokens * d_in + (tokens * d_out if count_output else 0)
    return float(dtype_bytes * elems)


def gemm_intensity(
    tokens: int, d_in: int, d_out: int, dtype_bytes: int = BF16_BYTES, count_output: bool = False
) -> float:
    """FLOP per byte of one GEMM; without the output it equals ``2 n d'/(b (n + d'))``."""
    return gemm_flops(tokens, d_in, d_out) / gemm_bytes(
        tokens, d_in, d_out, dtype_bytes, count_output
    )


def min_tokens_for_gemm(d_out: int, ridge: float, dtype_bytes: int = BF16_BYTES) -> int | None:
    """Smallest ``n`` with ``gemm_intensity(n, d, d_out) >= ridge``: ``b R d' / (2 d' - b R)``;
    None when no token count reaches the ridge (``2 d' <= b R``)."""
    denom = 2 * d_out - dtype_bytes * ridge
    if denom <= 0:
        return None
    return math.ceil(dtype_bytes * ridge * d_out / denom - 1e-9)


@dataclass(frozen=True)
class LayerMatmuls:
    """The GEMMs of a model's mean layer, summed.

    ``active_weight_elems``: weight elements one token multiplies (FLOPs per token / 2);
    ``dense_weight_elems`` + ``expert_weight_elems``: all weights of the layer, the routed
    experts apart (a batch touches only some of them); ``expert_token_share``: the share of
    tokens one routed expert sees (top-k / experts); ``input_elems_per_token``: activation
    elements one token reads into the layer's GEMMs.
    """

    active_weight_elems: float
    dense_weight_elems: float
    expert_weight_elems: float
    expert_token_share: float
    input_elems_per_token: float

    def weight_elems_touched(self, tokens: float) -> float:
        """Weights a batch of ``tokens`` reads: routed experts are touched with probability
        ``1 - (1 - k/E)^n`` each (uniform routing)."""
        if tokens <= 0:
            return 0.0
        touched = 1.0 - (1.0 - self.expert_token_share) ** tokens
        return self.dense_weight_elems + self.expert_weight_elems * touched

    @property
    def weight_elems(self) -> float:
        return self.dense_weight_elems + self.expert_weight_elems


def _attention_gemms(m: ModelShape) -> list[tuple[int, int]]:
    h = m.hidden_size
    if m.is_mla:
        q_dim = m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        q = [(h, m.q_lora_rank), (m.q_lora_rank, q_dim)] if m.q_lora_rank else [(h, q_dim)]
        return q + [
            (h, m.kv_lora_rank + m.qk_rope_head_dim),
            (m.kv_lora_rank, m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)),
            (m.num_attention_heads * m.v_head_dim, h),
        ]
    qkv_out = (m.num_attention_heads + 2 * m.num_kv_heads) * m.head_dim
    return [(h, qkv_out), (m.num_attention_heads * m.head_dim, h)]


def _mlp(h: int, inter: int) -> list[tuple[int, int]]:
    """Gated MLP (SwiGLU): gate and up fused, then down."""
    return [(h, 2 * inter), (inter, h)] if inter else []


def mean_layer(m: ModelShape) -> LayerMatmuls:
    h = m.hidden_size
    attn = _attention_gemms(m)
    dense = attn + _mlp(h, m.intermediate_size)
    if not m.is_moe:
        w = float(sum(a * b for a, b in dense))
        return LayerMatmuls(w, w, 0.0, 0.0, float(sum(a for a, _ in dense)))
    share = m.experts_per_token / m.num_experts
    moe_fixed = attn + _mlp(h, m.shared_expert_intermediate_size) + [(h, m.num_experts)]
    expert = _mlp(h, m.moe_intermediate_size)
    expert_w = m.num_experts * sum(a * b for a, b in expert)
    moe_layers = m.num_layers - min(m.dense_layers, m.num_layers)
    dense_layers = m.num_layers - moe_layers

    def mean(dense_value: float, moe_value: float) -> float:
        return (dense_layers * dense_value + moe_layers * moe_value) / m.num_layers

    fixed_w = sum(a * b for a, b in moe_fixed)
    dense_w = sum(a * b for a, b in dense)
    return LayerMatmuls(
        active_weight_elems=mean(
            dense_w, fixed_w + m.experts_per_token * sum(a * b for a, b in expert)
        ),
        dense_weight_elems=mean(dense_w, fixed_w),
        expert_weight_elems=mean(0, expert_w),
        expert_token_share=share,
        input_elems_per_token=mean(
            sum(a for a, _ in dense),
            sum(a for a, _ in moe_fixed) + m.experts_per_token * sum(a for a, _ in expert),
        ),
    )


def weight_bytes_total(m: ModelShape, weight_bytes: int = BF16_BYTES) -> float:
    """All weights: layers plus embedding and LM head (counted as two matrices)."""
    layer = mean_layer(m)
    return weight_bytes * (layer.weight_elems * m.num_layers + 2.0 * m.hidden_size * m.vocab_size)


def layer_intensity(
    m: ModelShape, tokens: int, weight_bytes: int = BF16_BYTES, act_bytes: int = BF16_BYTES
) -> float:
    """FLOP per byte of a layer's GEMMs over ``tokens`` tokens (attention left out)."""
    layer = mean_layer(m)
    flops = 2.0 * tokens * layer.active_weight_elems
    nbytes = weight_bytes * layer.weight_elems_touched(tokens) + act_bytes * tokens * (
        layer.input_elems_per_token
    )
    return flops / nbytes


def min_tokens_above_ridge(
    m: ModelShape, ridge: float, weight_bytes: int = BF16_BYTES, act_bytes: int = BF16_BYTES
) -> int | None:
    """Smallest token budget whose GEMMs reach ``ridge`` FLOP/byte, with every weight (all
    experts) read: ``n >= b_w R W / (2 A - b_a R X)``; None if out of reach."""
    layer = mean_layer(m)
    denom = 2 * layer.active_weight_elems - act_bytes * ridge * layer.input_elems_per_token
    if denom <= 0:
        return None
    return math.ceil(weight_bytes * ridge * layer.weight_elems / denom - 1e-9)


def attention_flops(m: ModelShape, new_tokens: float, context: float = 0) -> float:
    """Score and value FLOPs of ``new_tokens`` causal tokens after ``context`` cached ones:
    ``2 heads (d_qk + d_v) (n c + n (n + 1) / 2)``."""
    if m.is_mla:
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    else:
        d_qk = d_v = m.head_dim
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2
    return 2.0 * m.num_attention_heads * (d_qk + d_v) * pairs


@dataclass(frozen=True)
class Replica:
    """What one serving replica can do: ``gpus`` accelerators, scaled by ``efficiency``."""

    name: str
    gpus: int
    flops: float
    mem_bytes_per_s: float
    mem_bytes: float
    efficiency: float

    @property
    def ridge_flop_per_byte(self) -> float:
        return self.flops / self.mem_bytes_per_s


def make_replica(acc: Accelerator, gpus: int = 1, efficiency: float = 1.0) -> Replica:
    if gpus < 1:
        raise PlannerInputError(f"GPUs per replica must be >= 1, got {gpus}")
    if not 0 < efficiency <= 1:
        raise PlannerInputError(f"efficiency must be in (0, 1], got {efficiency}")
    return Replica(
        name=acc.name,
        gpus=gpus,
        flops=acc.bf16_flops * gpus * efficiency,
        mem_bytes_per_s=acc.mem_bytes_per_s * gpus * efficiency,
        mem_bytes=acc.mem_bytes * gpus,
        efficiency=efficiency,
    )


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one engine step over the whole model, and its roofline time."""

    flops: float
    bytes: float
    seconds: float
    compute_bound: bool


def step_cost(
    m: ModelShape,
    replica: Replica,
    kv_bytes_per_token_per_layer: int,
    *,
    prefill_tokens: int = 0,
    prefill_context: int = 0,
    prefill_seqs: int = 1,
    decode_seqs: int = 0,
    decode_context: int = 0,
    weight_bytes: int = BF16_BYTES,
    act_bytes: int = BF16_BYTES,
    layers: int | None = None,
    lm_head: bool = True,
) -> StepCost:
    """One step: ``prefill_tokens`` new prompt tokens, split evenly over ``prefill_seqs``
    prompts (each after ``prefill_context`` cached tokens), plus ``decode_seqs`` decodes at
    ``decode_context`` tokens each, over ``layers`` layers (default all), then the LM head for
    every sampled token (one per decode, one per prompt)."""
    layer = mean_layer(m)
    n_layers = m.num_layers if layers is None else layers
    tokens = prefill_tokens + decode_seqs
    flops = 2.0 * tokens * layer.active_weight_elems
    if prefill_tokens:
        per_seq = prefill_tokens / prefill_seqs
        flops += prefill_seqs * attention_flops(m, per_seq, prefill_context)
    flops += decode_seqs * attention_flops(m, 1, decode_context)
    nbytes = weight_bytes * layer.weight_elems_touched(tokens)
    nbytes += act_bytes * tokens * layer.input_elems_per_token
    kv_read = decode_seqs * decode_context + (
        prefill_seqs * prefill_context if prefill_tokens else 0
    )
    nbytes += kv_bytes_per_token_per_layer * (kv_read + tokens)  # read context, write new
    flops, nbytes = flops * n_layers, nbytes * n_layers
    if lm_head and tokens:
        sampled = decode_seqs + (prefill_seqs if prefill_tokens else 0)
        flops += 2.0 * sampled * m.hidden_size * m.vocab_size
        nbytes += weight_bytes * m.hidden_size * m.vocab_size
    t_compute, t_memory = flops / replica.flops, nbytes / replica.mem_bytes_per_s
    return StepCost(flops, nbytes, max(t_compute, t_memory), t_compute >= t_memory)


def prefill_layer_seconds(
    m: ModelShape,
    replica: Replica,
    kv_bytes_per_token_per_layer: int,
    tokens: int,
    context: int = 0,
    weight_bytes: int = BF16_BYTES,
) -> float:
    """Roofline time of one layer's prefill of ``tokens`` tokens."""
    return step_cost(
        m,
        replica,
        kv_bytes_per_token_per_layer,
        prefill_tokens=tokens,
        prefill_context=context,
        weight_bytes=weight_bytes,
        layers=1,
        lm_head=False,
    ).seconds


def largest_chunk_under(
    m: ModelShape,
    replica: Replica,
    kv_bytes_per_token_per_layer: int,
    step_budget_s: float,
    decode_seqs: int,
    decode_context: int,
    weight_bytes: int = BF16_BYTES,
    max_chunk: int = 1 << 20,
    prefill_context: int = 0,
) -> int | None:
    """Largest prefill chunk (after ``prefill_context`` prompt tokens already computed) that
    keeps a step with ``decode_seqs`` decodes under ``step_budget_s``; 0 if only the decodes
    fit, None if the decodes alone exceed it."""

    def fits(chunk: int) -> bool:
        return (
            step_cost(
                m,
                replica,
                kv_bytes_per_token_per_layer,
                prefill_tokens=chunk,
                prefill_context=prefill_context,
                decode_seqs=decode_seqs,
                decode_context=decode_context,
                weight_bytes=weight_bytes,
            ).seconds
            <= step_budget_s
        )

    if not fits(0):
        return None
    lo, hi = 0, 1
    while hi <= max_chunk and fits(hi):
        lo, hi = hi, hi * 2
    if hi > max_chunk:
        return max_chunk
    while hi - lo > 1:  # fits(lo), not fits(hi); step time grows with the chunk
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
