"""The default ``threshold_tokens`` of the proxy's per-request decision for a model on given
hardware (docs/proxy.md, "Per-request disaggregation"): what ``splitserve plan`` prints.

Pure; runs in the caller's process. The rule itself is ``splitserve.proxy.decide`` (pure, no
I/O), so the planner prints the value the proxy would use with it:

``threshold = max(break_even, one_step_chunk)`` where
- ``break_even = handoff_s / prefill_s_per_token``: the prompt whose whole prefill on D costs no
  more than moving it would cost the request (the streamed handoff's exposed part plus one more
  hop through the proxy, ``HOP_S``);
- ``one_step_chunk``: the largest prefill chunk that fits in one step of D's decodes (a batch of
  ``min(TYPICAL_DECODES, the decode pool's batch)``) under the ITL target: a prompt that short
  is prefilled on D in one step without breaking its decodes' inter-token target.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.planner.pools import PoolContext
from splitserve.planner.roofline import largest_chunk_under, step_cost
from splitserve.proxy.decide import local_prefill_threshold

# One more request through the proxy and D's wait on P's answer (seconds): measured 2.9-4.5 ms
# beyond P's answer on our CPU machines (docs/benchmarks.md), the proxy itself 0.14-0.22 ms.
HOP_S = 2e-3
TYPICAL_DECODES = 32


@dataclass(frozen=True)
class DecideThreshold:
    tokens: int
    break_even_tokens: int
    one_step_chunk: int | None
    decodes: int
    handoff_s: float
    prefill_s_per_token: float


def decide_threshold(
    ctx: PoolContext, exposed_handoff_s: float, decode_batch: int | None = None
) -> DecideThreshold:
    prompt = max(1, ctx.workload.prompt_tokens)
    per_token = (
        step_cost(
            ctx.model,
            ctx.replica,
            ctx.kv_bytes_per_token_per_layer,
            prefill_tokens=prompt,
            weight_bytes=ctx.weight_bytes,
        ).seconds
        / prompt
    )
    decodes = min(TYPICAL_DECODES, decode_batch) if decode_batch else TYPICAL_DECODES
    chunk = largest_chunk_under(
        ctx.model,
        ctx.replica,
        ctx.kv_bytes_per_token_per_layer,
        ctx.slo.itl_s,
        decodes,
        ctx.mean_decode_context,
        ctx.weight_bytes,
    )
    handoff_s = exposed_handoff_s + HOP_S
    return DecideThreshold(
        tokens=local_prefill_threshold(handoff_s, per_token, chunk),
        break_even_tokens=local_prefill_threshold(handoff_s, per_token, None),
        one_step_chunk=chunk,
        decodes=decodes,
        handoff_s=handoff_s,
        prefill_s_per_token=per_token,
    )
