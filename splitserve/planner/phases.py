"""Different hardware per phase: prefill on one accelerator, decode on another, priced.

Pure; runs in the caller's process (``splitserve plan --prefill-gpu/--decode-gpu``).
Splitwise's point: prefill is compute-bound and decode bandwidth- and capacity-bound, so the
two pools may be cheapest on different parts. Given the colocated plan's ``PoolContext``, this
re-sizes the prefill pool on the prefill hardware (its replica, its ridge-point budget, the
handoff its layers stream under) and the decode pool on the decode hardware, then compares
the layouts by dollars per hour (``sim.fleet.GPU_PRICES`` or the user's prices) instead of
GPU counts, which no longer compare across parts.

Invariant: with the same hardware for both phases and the colocated pool this gives the
pools ``plan.make_plan`` gives; only the verdict's unit changes (dollars, not GPUs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.planner.catalog import Accelerator, Link
from splitserve.planner.handoff import handoff
from splitserve.planner.pools import (
    ColocatedPool,
    DecodePool,
    PoolContext,
    PrefillPool,
    Verdict,
    size_decode,
    size_prefill,
    verdict,
)
from splitserve.planner.roofline import make_replica, min_tokens_above_ridge, prefill_layer_seconds
from splitserve.planner.sim.fleet import price_of


@dataclass(frozen=True)
class PhaseHardware:
    """Accelerators and GPUs per replica of each pool; ``prices`` in dollars per GPU-hour."""

    prefill: Accelerator
    decode: Accelerator
    prefill_gpus: int
    decode_gpus: int
    colocated_gpus: int
    prices: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PhasePools:
    prefill: PrefillPool
    decode: DecodePool
    verdict: Verdict
    summary: dict[str, Any]


def phase_pools(
    ctx: PoolContext,
    hw: PhaseHardware,
    colocated: ColocatedPool,
    colocated_acc: Accelerator,
    link: Link,
    efficiency: float,
) -> PhasePools:
    """The prefill and decode pools on their own hardware and the verdict by cost."""
    model = ctx.model
    rep_p = make_replica(hw.prefill, hw.prefill_gpus, efficiency)
    rep_d = make_replica(hw.decode, hw.decode_gpus, efficiency)
    kv = ctx.kv_bytes_per_token_per_layer
    prompt = ctx.workload.prompt_tokens
    layer_s = prefill_layer_seconds(model, rep_p, kv, prompt, weight_bytes=ctx.weight_bytes)
    h = handoff(link, model.num_layers, kv * prompt, layer_s, hw.prefill_gpus)
    ctx_p = dataclasses.replace(
        ctx,
        replica=rep_p,
        exposed_handoff_s=h.exposed_streaming_s,
        min_prefill_budget=min_tokens_above_ridge(
            model, rep_p.ridge_flop_per_byte, ctx.weight_bytes
        ),
    )
    ctx_d = dataclasses.replace(ctx, replica=rep_d)
    pre, dec = size_prefill(ctx_p), size_decode(ctx_d)
    price_p = price_of(hw.prefill.name, hw.prices)
    price_d = price_of(hw.decode.name, hw.prices)
    price_c = price_of(colocated_acc.name, hw.prices)
    base = verdict(ctx, pre, dec, colocated, h.streaming_hides)
    reasons = [
        r for r in base.reasons if not r.startswith(("disaggregated needs", "colocated with"))
    ]
    choice = base.choice
    cost_d = cost_c = math.nan
    if pre.replicas is not None and dec.replicas is not None:
        cost_d = pre.replicas * hw.prefill_gpus * price_p + dec.replicas * hw.decode_gpus * price_d
        reasons.append(
            f"disaggregated: {pre.replicas} P x {hw.prefill_gpus} {hw.prefill.name} + "
            f"{dec.replicas} D x {hw.decode_gpus} {hw.decode.name} = ${cost_d:.2f}/h"
        )
    if colocated.replicas is not None:
        cost_c = colocated.replicas * hw.colocated_gpus * price_c
        reasons.append(
            f"colocated: {colocated.replicas} x {hw.colocated_gpus} {colocated_acc.name} = "
            f"${cost_c:.2f}/h"
        )
    if pre.feasible and dec.feasible and colocated.feasible and math.isfinite(cost_d + cost_c):
        choice = "disaggregate" if cost_d < cost_c else "colocate"
        reasons.append(f"cheaper: {choice}d layout")
    summary = {
        "prefill": {
            "accelerator": hw.prefill.name,
            "gpus_per_replica": hw.prefill_gpus,
            "price_per_gpu_hour": price_p,
            "exposed_handoff_s": h.exposed_streaming_s,
        },
        "decode": {
            "accelerator": hw.decode.name,
            "gpus_per_replica": hw.decode_gpus,
            "price_per_gpu_hour": price_d,
        },
        "colocated": {
            "accelerator": colocated_acc.name,
            "gpus_per_replica": hw.colocated_gpus,
            "price_per_gpu_hour": price_c,
        },
        "disaggregated_cost_per_hour": cost_d,
        "colocated_cost_per_hour": cost_c,
    }
    return PhasePools(pre, dec, Verdict(choice, reasons), summary)
