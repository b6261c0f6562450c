"""Assemble a plan: every figure ``splitserve plan`` reports, from validated inputs.

Pure: takes a ``ModelShape``, an ``Accelerator`` (catalog or measured), a ``Link`` (catalog,
custom or measured), a ``Workload`` and ``Slo``, and returns a ``Plan`` of plain dataclasses
(``Plan.to_dict()`` is the ``--json`` output). Runs in the caller's process; no I/O.
Invariant: every assumption the numbers depend on is listed in ``Plan.assumptions``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.planner.catalog import LINKS, Accelerator, Link, ModelShape, PlannerInputError
from splitserve.planner.decide_threshold import DecideThreshold, decide_threshold
from splitserve.planner.handoff import Handoff, handoff
from splitserve.planner.kv import KvSizes, dtype_bytes, kv_sizes
from splitserve.planner.phases import PhaseHardware, phase_pools
from splitserve.planner.pools import (
    MEMORY_UTILISATION,
    ColocatedPool,
    DecodePool,
    PoolContext,
    PrefillPool,
    Slo,
    Verdict,
    Workload,
    size_colocated,
    size_decode,
    size_prefill,
    verdict,
)
from splitserve.planner.roofline import (
    BF16_BYTES,
    Replica,
    gemm_intensity,
    largest_chunk_under,
    layer_intensity,
    make_replica,
    mean_layer,
    min_tokens_above_ridge,
    min_tokens_for_gemm,
    prefill_layer_seconds,
    step_cost,
    weight_bytes_total,
)

DECODE_BATCHES = (1, 8, 32, 128, 256)
# Weights may take at most this share of a replica's memory when the planner picks the GPU count.
AUTO_TP_WEIGHT_SHARE = 0.7


@dataclass(frozen=True)
class Intensity:
    prompt_tokens: int
    layer_flop_per_byte: float
    ridge_flop_per_byte: float
    min_budget_tokens: int | None
    gemm_d_out: int
    gemm_flop_per_byte: float
    gemm_min_tokens: int | None


@dataclass(frozen=True)
class ChunkAdvice:
    decode_seqs: int
    decode_context: int
    decode_step_s: float
    largest_chunk: int | None


@dataclass(frozen=True)
class Pools:
    prefill: PrefillPool
    decode: DecodePool
    colocated: ColocatedPool
    verdict: Verdict


@dataclass
class Plan:
    model: dict[str, Any]
    hardware: dict[str, Any]
    kv: KvSizes
    handoff: Handoff
    handoff_by_link: list[Handoff]
    intensity: Intensity
    chunks: list[ChunkAdvice]
    workload: dict[str, Any]
    slo: dict[str, Any]
    pools: Pools | None
    assumptions: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None
    decide: DecideThreshold | None = None  # the proxy's decide.threshold_tokens for this setup

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["handoff"]["streaming_hides"] = self.handoff.streaming_hides
        for row, h in zip(out["handoff_by_link"], self.handoff_by_link, strict=True):
            row["streaming_hides"] = h.streaming_hides
        return _finite(out)


def _finite(value: Any) -> Any:
    """JSON has no infinity: write None instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def auto_gpus_per_replica(
    model: ModelShape, acc: Accelerator, weight_bytes: int = BF16_BYTES
) -> int:
    """Smallest power of two of GPUs whose memory holds the weights within
    ``AUTO_TP_WEIGHT_SHARE`` of it (the rest for KV)."""
    weights = weight_bytes_total(model, weight_bytes)
    gpus = 1
    while weights > AUTO_TP_WEIGHT_SHARE * acc.mem_bytes * gpus:
        gpus *= 2
        if gpus > 1024:
            raise PlannerInputError(f"{model.name} does not fit in 1024 x {acc.name}")
    return gpus


def make_plan(
    model: ModelShape,
    acc: Accelerator,
    link: Link,
    *,
    kv_dtype: str = "bf16",
    workload: Workload | None = None,
    slo: Slo | None = None,
    gpus_per_replica: int | None = None,
    efficiency: float = 1.0,
    weight_bytes: int = BF16_BYTES,
    compare_links: bool = True,
    slo_given: bool = False,
    phases: PhaseHardware | None = None,
) -> Plan:
    """Every figure of a plan, step by step: replica, KV sizes, handoff per link, prefill
    intensity, chunk advice, pools; then the assumptions those figures rest on."""
    workload = workload or Workload()
    slo = slo or Slo()
    gpus = gpus_per_replica or auto_gpus_per_replica(model, acc, weight_bytes)
    replica = make_replica(acc, gpus, efficiency)
    kv = kv_sizes(model, kv_dtype, workload.prompt_tokens)
    layer_s = prefill_layer_seconds(
        model,
        replica,
        kv.bytes_per_token_per_layer,
        workload.prompt_tokens,
        weight_bytes=weight_bytes,
    )
    by_link = _handoffs(model, link, kv, layer_s, gpus, compare_links)
    this_handoff = by_link[0]
    intensity = _intensity(model, replica, workload.prompt_tokens, weight_bytes)
    ctx = PoolContext(
        model=model,
        replica=replica,
        kv_bytes_per_token_per_layer=kv.bytes_per_token_per_layer,
        workload=workload,
        slo=slo,
        exposed_handoff_s=this_handoff.exposed_streaming_s,
        min_prefill_budget=intensity.min_budget_tokens,
        weight_bytes=weight_bytes,
    )
    assumptions = [_auto_gpus_assumption(acc, gpus)] if gpus_per_replica is None else []
    assumptions += _assumptions(model, acc, link, replica, gpus, efficiency, weight_bytes, kv_dtype)
    if not slo_given:
        assumptions.append(
            f"no SLO given: TTFT {slo.ttft_s:g} s and ITL {slo.itl_s * 1e3:g} ms assumed"
        )
    pools = _pools(ctx, this_handoff)
    hardware = _hardware_summary(acc, link, replica, gpus, efficiency, kv_dtype)
    if phases is not None:  # prefill and decode pools on their own hardware, compared by cost
        split = phase_pools(ctx, phases, pools.colocated, acc, link, efficiency)
        pools = Pools(split.prefill, split.decode, pools.colocated, split.verdict)
        hardware["phases"] = split.summary
    return Plan(
        model=_model_summary(model, weight_bytes),
        hardware=hardware,
        kv=kv,
        handoff=this_handoff,
        handoff_by_link=by_link,
        intensity=intensity,
        chunks=_chunk_advice(ctx),
        workload=workload.model_dump(),
        slo=slo.model_dump(),
        pools=pools,
        assumptions=assumptions,
        decide=decide_threshold(ctx, this_handoff.exposed_streaming_s, pools.decode.batch),
    )


def _handoffs(
    model: ModelShape, link: Link, kv: KvSizes, layer_s: float, gpus: int, compare_links: bool
) -> list[Handoff]:
    """The handoff over ``link`` first, then (``compare_links``) over every other catalog link."""
    by_link = [handoff(link, model.num_layers, kv.layer_slice_bytes, layer_s, gpus)]
    if compare_links:
        by_link += [
            handoff(other, model.num_layers, kv.layer_slice_bytes, layer_s, gpus)
            for other in LINKS.values()
            if other.name != link.name
        ]
    return by_link


def _intensity(
    model: ModelShape, replica: Replica, prompt_tokens: int, weight_bytes: int
) -> Intensity:
    """Prefill's FLOP per byte beside the replica's ridge, for a mean layer and one GEMM."""
    ridge = replica.ridge_flop_per_byte
    return Intensity(
        prompt_tokens=prompt_tokens,
        layer_flop_per_byte=layer_intensity(model, prompt_tokens, weight_bytes),
        ridge_flop_per_byte=ridge,
        min_budget_tokens=min_tokens_above_ridge(model, ridge, weight_bytes),
        gemm_d_out=model.hidden_size,
        gemm_flop_per_byte=gemm_intensity(
            prompt_tokens, model.hidden_size, model.hidden_size, weight_bytes
        ),
        gemm_min_tokens=min_tokens_for_gemm(model.hidden_size, ridge, weight_bytes),
    )


def _chunk_advice(ctx: PoolContext) -> list[ChunkAdvice]:
    """Per decode batch in ``DECODE_BATCHES``: its step alone and the largest prefill chunk
    that keeps a step with it under the ITL target."""
    chunks = []
    for seqs in DECODE_BATCHES:
        step = step_cost(
            ctx.model,
            ctx.replica,
            ctx.kv_bytes_per_token_per_layer,
            decode_seqs=seqs,
            decode_context=ctx.mean_decode_context,
            weight_bytes=ctx.weight_bytes,
        )
        chunk = largest_chunk_under(
            ctx.model,
            ctx.replica,
            ctx.kv_bytes_per_token_per_layer,
            ctx.slo.itl_s,
            seqs,
            ctx.mean_decode_context,
            ctx.weight_bytes,
            prefill_context=ctx.mean_chunk_context,
        )
        chunks.append(ChunkAdvice(seqs, ctx.mean_decode_context, step.seconds, chunk))
    return chunks


def _pools(ctx: PoolContext, this_handoff: Handoff) -> Pools:
    pre, dec, colo = size_prefill(ctx), size_decode(ctx), size_colocated(ctx)
    return Pools(pre, dec, colo, verdict(ctx, pre, dec, colo, this_handoff.streaming_hides))


def _auto_gpus_assumption(acc: Accelerator, gpus: int) -> str:
    return (
        f"{gpus} x {acc.name} per replica: the fewest (power of two) whose "
        f"memory holds the weights in {AUTO_TP_WEIGHT_SHARE:.0%} of it"
    )


def _assumptions(
    model: ModelShape,
    acc: Accelerator,
    link: Link,
    replica: Replica,
    gpus: int,
    efficiency: float,
    weight_bytes: int,
    kv_dtype: str,
) -> list[str]:
    """What every plan's figures rest on (the roofline, dtypes, links, memory, arrivals)."""
    assumptions = [
        f"roofline: step time = max(FLOPs / {replica.flops / 1e12:.4g} TFLOP/s, bytes / "
        f"{replica.mem_bytes_per_s / 1e9:.4g} GB/s) for {gpus} x {acc.name} at "
        f"{efficiency:.0%} of peak",
        f"weights {weight_bytes} bytes per parameter; activations {BF16_BYTES}; KV {kv_dtype}",
        f"KV moves over {gpus} link(s) of {link.name} in parallel (one per GPU, each with its "
        "share of the heads)"
        if gpus > 1
        else f"KV moves over one {link.name} link",
        "intensity counts the bytes read (weights and input activations), not the output write",
        "decode context = prompt + half the output tokens; a prefill chunk follows half the "
        "prompt on average; attention FLOPs are causal (n c + n (n + 1) / 2 pairs)",
        f"weights and KV may use {MEMORY_UTILISATION:.0%} of replica memory",
        "arrivals are Poisson; each replica queues as an M/D/1 server",
    ]
    if model.is_moe:
        assumptions.append(
            "MoE: tokens route uniformly; a batch of n tokens reads each expert "
            "with probability 1 - (1 - k/E)^n"
        )
    return assumptions


def _model_summary(model: ModelShape, weight_bytes: int) -> dict[str, Any]:
    layer = mean_layer(model)
    return {
        "name": model.name,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "mla": model.is_mla,
        "moe": model.is_moe,
        "params_total": weight_bytes_total(model, 1),
        "params_active_per_token": layer.active_weight_elems * model.num_layers
        + model.hidden_size * model.vocab_size,
        "weight_bytes": weight_bytes_total(model, weight_bytes),
    }


def _hardware_summary(
    acc: Accelerator, link: Link, replica: Replica, gpus: int, efficiency: float, kv_dtype: str
) -> dict[str, Any]:
    return {
        "accelerator": acc.name,
        "source": acc.source,
        "gpus_per_replica": gpus,
        "efficiency": efficiency,
        "flops": replica.flops,
        "mem_bytes_per_s": replica.mem_bytes_per_s,
        "mem_bytes": replica.mem_bytes,
        "ridge_flop_per_byte": replica.ridge_flop_per_byte,
        "link": link.name,
        "link_bytes_per_s": link.bytes_per_s,
        "link_per_transfer_s": link.per_transfer_s,
        "kv_dtype_bytes": dtype_bytes(kv_dtype),
    }
