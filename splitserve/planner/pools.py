"""Pool sizing: a prefill:decode replica split for a workload, the colocated alternative, and
the verdict between them.

Pure functions over the roofline (``roofline.step_cost``) and handoff figures; runs in the
caller's process. docs/planner.md states the model; in short:
- requests arrive at ``rate`` per second, Poisson, spread evenly over replicas; each replica
  queues like an M/D/1 server: mean wait ``rho S / (2 (1 - rho))`` for service time ``S`` and
  utilisation ``rho < 1``;
- a prefill replica batches whole prompts up to the ridge-point budget; TTFT = wait + one
  prefill iteration + the exposed handoff (layer-wise streaming);
- a decode replica runs the largest batch that keeps a step under the ITL target and whose KV
  fits in memory; it must emit ``rate * output_tokens`` tokens per second;
- a colocated replica (chunked prefill) spends every step's ITL budget on its decodes first and
  the rest on one prompt's chunk; it is feasible when a step carrying its share of both loads
  fits the ITL target.
Invariant: every answer carries the figures it came from, so the report can print them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from splitserve.planner.catalog import ModelShape
from splitserve.planner.roofline import (
    BF16_BYTES,
    Replica,
    largest_chunk_under,
    step_cost,
    weight_bytes_total,
)

MAX_REPLICAS = 100_000
# Share of a replica's memory the planner lets weights + KV use (activations, fragmentation).
MEMORY_UTILISATION = 0.9


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(4096, ge=1)
    output_tokens: int = Field(256, ge=1)
    request_rate: float | None = Field(None, gt=0, description="requests per second")


class Slo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_s: float = Field(2.0, gt=0)
    itl_s: float = Field(0.05, gt=0)


def md1_wait(rho: float, service_s: float) -> float:
    """Mean queueing delay of an M/D/1 server at utilisation ``rho`` (inf at or above 1)."""
    return math.inf if rho >= 1 else rho * service_s / (2 * (1 - rho))


@dataclass(frozen=True)
class PoolContext:
    """What every sizing function needs, computed once."""

    model: ModelShape
    replica: Replica
    kv_bytes_per_token_per_layer: int
    workload: Workload
    slo: Slo
    exposed_handoff_s: float
    min_prefill_budget: int | None
    weight_bytes: int = BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.model.num_layers

    @property
    def mean_decode_context(self) -> int:
        return self.workload.prompt_tokens + self.workload.output_tokens // 2

    @property
    def kv_memory_bytes(self) -> float:
        weights = weight_bytes_total(self.model, self.weight_bytes)
        return self.replica.mem_bytes * MEMORY_UTILISATION - weights

    @property
    def max_resident_seqs(self) -> int:
        """Sequences whose full KV (prompt + output) fits next to the weights."""
        per_seq = (self.workload.prompt_tokens + self.workload.output_tokens) * (
            self.kv_bytes_per_token
        )
        return max(0, int(self.kv_memory_bytes // per_seq))

    @property
    def mean_chunk_context(self) -> int:
        """Prompt tokens computed before a chunk, on average over a prompt's chunks."""
        return self.workload.prompt_tokens // 2

    def decode_step_s(self, seqs: int, chunk: int = 0) -> float:
        return step_cost(
            self.model,
            self.replica,
            self.kv_bytes_per_token_per_layer,
            prefill_tokens=chunk,
            prefill_context=self.mean_chunk_context,
            decode_seqs=seqs,
            decode_context=self.mean_decode_context,
            weight_bytes=self.weight_bytes,
        ).seconds


@dataclass(frozen=True)
class PrefillPool:
    prompts_per_iteration: int
    iteration_s: float
    capacity_rps: float
    replicas: int | None
    ttft_s: float | None
    feasible: bool
    why: str


@dataclass(frozen=True)
class DecodePool:
    batch: int
    batch_limit: str
    step_s: float
    tokens_per_s: float
    replicas: int | None
    feasible: bool
    why: str


@dataclass(frozen=True)
class ColocatedPool:
    replicas: int | None
    decode_seqs: int
    chunk_tokens: int
    step_s: float
    ttft_s: float | None
    feasible: bool
    why: str


@dataclass(frozen=True)
class Verdict:
    choice: str  # "disaggregate" | "colocate" | "neither"
    reasons: list[str] = field(default_factory=list)


def size_prefill(ctx: PoolContext) -> PrefillPool:
    prompt = ctx.workload.prompt_tokens
    k = 1 if not ctx.min_prefill_budget else max(1, math.ceil(ctx.min_prefill_budget / prompt))
    k = max(1, min(k, ctx.max_resident_seqs or 1))
    it = step_cost(
        ctx.model,
        ctx.replica,
        ctx.kv_bytes_per_token_per_layer,
        prefill_tokens=k * prompt,
        prefill_seqs=k,
        weight_bytes=ctx.weight_bytes,
    ).seconds
    capacity = k / it
    best = it + ctx.exposed_handoff_s
    if best > ctx.slo.ttft_s:
        return PrefillPool(
            k,
            it,
            capacity,
            None,
            best,
            False,
            f"one prefill ({it * 1e3:.1f} ms) plus the exposed handoff "
            f"({ctx.exposed_handoff_s * 1e3:.1f} ms) exceeds the TTFT target",
        )
    rate = ctx.workload.request_rate
    if rate is None:
        return PrefillPool(k, it, capacity, None, best, True, "no request rate given")
    for n in range(max(1, math.ceil(rate / capacity)), MAX_REPLICAS):
        rho = rate / (n * capacity)
        ttft = md1_wait(rho, 1 / capacity) + it + ctx.exposed_handoff_s
        if ttft <= ctx.slo.ttft_s:
            return PrefillPool(
                k,
                it,
                capacity,
                n,
                ttft,
                True,
                f"{n} replica{'s' if n > 1 else ''} at {rho:.0%} load "
                f"meet{'' if n > 1 else 's'} the TTFT target",
            )
    return PrefillPool(k, it, capacity, None, None, False, "no replica count up to the cap fits")


def _largest_batch_under_itl(ctx: PoolContext, limit: int) -> int:
    lo, hi = 0, max(1, limit)
    if ctx.decode_step_s(hi) <= ctx.slo.itl_s:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ctx.decode_step_s(mid) <= ctx.slo.itl_s else (lo, mid)
    return lo


def size_decode(ctx: PoolContext) -> DecodePool:
    memory_limit = ctx.max_resident_seqs
    if memory_limit < 1:
        return DecodePool(
            0,
            "memory",
            math.inf,
            0.0,
            None,
            False,
            "the weights leave no room for one sequence's KV: add GPUs per replica",
        )
    batch = _largest_batch_under_itl(ctx, memory_limit)
    if batch < 1:
        step1 = ctx.decode_step_s(1)
        return DecodePool(
            0,
            "ITL",
            step1,
            0.0,
            None,
            False,
            f"one decode step takes {step1 * 1e3:.1f} ms, over the ITL target",
        )
    step = ctx.decode_step_s(batch)
    tokens_per_s = batch / step
    limit = "memory" if batch == memory_limit else "ITL"
    rate = ctx.workload.request_rate
    if rate is None:
        return DecodePool(batch, limit, step, tokens_per_s, None, True, "no request rate given")
    n = max(1, math.ceil(rate * ctx.workload.output_tokens / tokens_per_s - 1e-9))
    return DecodePool(
        batch,
        limit,
        step,
        tokens_per_s,
        n,
        True,
        f"batch {batch} (bound by {limit}) at {step * 1e3:.1f} ms per step",
    )


def _colocated_at(ctx: PoolContext, n: int) -> ColocatedPool | None:
    """Replica count ``n`` if it meets both SLOs with chunked prefill, else None."""
    rate = ctx.workload.request_rate or 0.0
    per_replica = rate / n
    itl, prompt, out = ctx.slo.itl_s, ctx.workload.prompt_tokens, ctx.workload.output_tokens
    seqs = math.ceil(per_replica * out * itl)  # Little's law at one step per ITL
    if seqs > ctx.max_resident_seqs:
        return None
    chunk = largest_chunk_under(
        ctx.model,
        ctx.replica,
        ctx.kv_bytes_per_token_per_layer,
        itl,
        seqs,
        ctx.mean_decode_context,
        ctx.weight_bytes,
        prefill_context=ctx.mean_chunk_context,
    )
    if not chunk:
        return None
    steps_per_prompt = math.ceil(prompt / chunk)
    service = steps_per_prompt * itl
    rho = per_replica * service
    if rho >= 1:
        return None
    ttft = md1_wait(rho, service) + service
    if ttft > ctx.slo.ttft_s:
        return None
    return ColocatedPool(
        n,
        seqs,
        chunk,
        ctx.decode_step_s(seqs, chunk),
        ttft,
        True,
        f"{seqs} decodes leave a {chunk}-token chunk per step; "
        f"a prompt takes {steps_per_prompt} steps",
    )


def size_colocated(ctx: PoolContext) -> ColocatedPool:
    if ctx.max_resident_seqs < 1:
        return ColocatedPool(
            None,
            0,
            0,
            math.inf,
            None,
            False,
            "the weights leave no room for KV: add GPUs per replica",
        )
    alone = _colocated_at(ctx, MAX_REPLICAS) if ctx.workload.request_rate else None
    if ctx.workload.request_rate is None:
        chunk = largest_chunk_under(
            ctx.model,
            ctx.replica,
            ctx.kv_bytes_per_token_per_layer,
            ctx.slo.itl_s,
            0,
            ctx.mean_decode_context,
            ctx.weight_bytes,
            prefill_context=ctx.mean_chunk_context,
        )
        if not chunk:
            return ColocatedPool(
                None, 0, 0, math.inf, None, False, "not even an empty step fits the ITL target"
            )
        ttft = math.ceil(ctx.workload.prompt_tokens / chunk) * ctx.slo.itl_s
        ok = ttft <= ctx.slo.ttft_s
        return ColocatedPool(
            None,
            0,
            chunk,
            ctx.slo.itl_s,
            ttft,
            ok,
            "no request rate given; an idle replica's chunked prefill"
            + ("" if ok else " already misses the TTFT target"),
        )
    if alone is None:
        return ColocatedPool(
            None,
            0,
            0,
            math.inf,
            None,
            False,
            "even a nearly idle replica cannot fit a prompt's chunks into the "
            "ITL budget within the TTFT target",
        )
    lo, hi = 0, MAX_REPLICAS  # feasibility is monotone in n: more replicas, less load each
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _colocated_at(ctx, mid) else (mid, hi)
    found = _colocated_at(ctx, hi)
    assert found is not None
    return found


def verdict(
    ctx: PoolContext,
    prefill: PrefillPool,
    decode: DecodePool,
    colocated: ColocatedPool,
    streaming_hides: bool,
) -> Verdict:
    gpus = ctx.replica.gpus
    reasons: list[str] = []
    disagg_ok = prefill.feasible and decode.feasible
    if not streaming_hides:
        reasons.append(
            "per-layer KV transfer is slower than per-layer prefill: streaming "
            "cannot hide the handoff on this link"
        )
    if not disagg_ok:
        reasons.append("disaggregated: " + (prefill.why if not prefill.feasible else decode.why))
    if not colocated.feasible:
        reasons.append("colocated: " + colocated.why)
    if disagg_ok and not colocated.feasible:
        if prefill.replicas is not None and decode.replicas is not None:
            reasons.append(
                f"disaggregated meets both SLOs with {prefill.replicas} P + "
                f"{decode.replicas} D replicas "
                f"({(prefill.replicas + decode.replicas) * gpus} GPUs)"
            )
        return Verdict("disaggregate", reasons)
    if colocated.feasible and not disagg_ok:
        return Verdict("colocate", reasons)
    if not disagg_ok:
        return Verdict("neither", reasons)
    if prefill.replicas is None or decode.replicas is None or colocated.replicas is None:
        reasons.append(
            "both layouts meet the SLOs for one request; give a request rate to compare GPU counts"
        )
        return Verdict("colocate", reasons + ["colocated is simpler when both fit"])
    disagg_gpus = (prefill.replicas + decode.replicas) * gpus
    colo_gpus = colocated.replicas * gpus
    reasons.append(
        f"disaggregated needs {disagg_gpus} GPUs ({prefill.replicas} P + "
        f"{decode.replicas} D), colocated {colo_gpus}"
    )
    if disagg_gpus < colo_gpus:
        return Verdict("disaggregate", reasons)
    reasons.append("colocated with chunked prefill needs no more GPUs and no KV transfer")
    return Verdict("colocate", reasons)
