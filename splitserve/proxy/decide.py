"""Per-request disaggregation: send a request straight to a decode server (D) or through a
prefill server (P)? Pure: settings, a prefix index and the decision, with no I/O, no engine
import and no clock, so the planner and a simulator can run the very rule the proxy runs.

Runs wherever it is imported. The proxy's runtime half (tokenizer, thread offload, metrics,
logs) is ``splitserve.proxy.decider``; the rule and its arithmetic are in docs/proxy.md,
"Per-request disaggregation".

A request goes straight to D (D prefills it itself, as a colocated server would) when
disaggregating does not pay, checked in this order:

1. ``prefix_on_decode``: D already holds at least ``prefix_share`` of the prompt (by the
   proxy's own record of the prompts it sent to each D), so only a short tail is left to
   compute there;
2. ``short``: the uncached prompt tokens are at most ``threshold_tokens``: the prefill fits in
   one ITL-safe step of D's running decodes, or costs less than the handoff would;
3. ``prefill_busy``: the prefill work queued on P (its in-flight requests times the mean
   uncached size of what was sent to P) would delay the request at least as long as D's own
   prefill of its uncached tokens costs (``decode_prefill_cost_ratio``: D's cost per token
   over P's), for prompts of at most ``busy_max_tokens`` uncached tokens (default four times
   ``threshold_tokens``): D prefills the prompts it is given in order, so a long prompt taken
   from a busy P would hold every short prompt that reaches D after it, whose low TTFT on D is
   the reason they go there.

Otherwise ``long``: disaggregate. The decision only chooses the server; the tokens are the
same either way (a D serves a request sent straight to it exactly as a colocated server).

Invariants: ``decide`` is a function of its inputs; the prefix index is bounded
(``prefix_blocks`` blocks per D, least recently used dropped first) and only ever
under-reports (a block it drops may still be cached on D, never the reverse beyond what D
itself evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Route = Literal["decode", "disaggregate"]
REASONS = ("prefix_on_decode", "short", "prefill_busy", "long")
# prefill_busy takes prompts up to this many thresholds (DecisionSettings.busy_max_tokens).
BUSY_MAX_THRESHOLDS = 4


class DecisionSettings(BaseModel):
    """``decide:`` in the proxy's settings (vLLM flows only: an SGLang decode server cannot
    prefill). Defaults: docs/proxy.md, "Per-request disaggregation"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokenizer: str | None = Field(
        None, description="The model directory (its tokenizer.json and tokenizer_config.json) "
        "or a tokenizer.json file; `splitserve up` fills in its model.",
    )  # fmt: skip
    threshold_tokens: int = Field(
        256, ge=0, description="Prompts with at most this many uncached tokens go straight to "
        "D (splitserve plan prints the value for a model and hardware).",
    )  # fmt: skip
    prefix_share: float = Field(
        0.75, gt=0.0, le=1.0, description="Send to D when it holds at least this share of "
        "the prompt's tokens (as the proxy recorded them).",
    )  # fmt: skip
    block_tokens: int = Field(
        16, ge=1, le=4096, description="Prefix index granularity: D's KV block size (vLLM: 16 "
        "on GPU, 128 on CPU); only whole blocks count as held.",
    )  # fmt: skip
    prefix_blocks: int = Field(
        200_000, ge=0, description="Blocks remembered per decode server (least recently used "
        "dropped first); 0 turns the prefix rule off.",
    )  # fmt: skip
    use_prefill_queue: bool = Field(
        True, description="Send to D when P's queued prefill work would delay the request "
        "beyond D's own prefill of it.",
    )  # fmt: skip
    decode_prefill_cost_ratio: float = Field(
        1.0, gt=0.0, description="D's prefill cost per token over P's (1: same hardware)."
    )
    busy_max_tokens: int | None = Field(
        None, ge=0, description="Largest uncached prompt the prefill_busy rule may send to D "
        "(unset: four times threshold_tokens): D prefills in order, and a long prompt there "
        "holds the short ones behind it.",
    )  # fmt: skip
    thread_chars: int = Field(
        4096, ge=0, description="Prompts longer than this many characters are tokenized on a "
        "thread, off the event loop.",
    )  # fmt: skip

    def busy_limit(self) -> int:
        """``busy_max_tokens``, or its default: four times ``threshold_tokens``."""
        if self.busy_max_tokens is not None:
            return self.busy_max_tokens
        return BUSY_MAX_THRESHOLDS * self.threshold_tokens


@dataclass(frozen=True)
class DecisionInputs:
    """What one decision looks at, in tokens."""

    prompt_tokens: int
    cached_on_decode: int  # leading tokens the chosen D holds (whole blocks)
    prefill_queue_tokens: float  # uncached tokens ahead of this request on the chosen P


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str
    uncached_tokens: int


def decide(settings: DecisionSettings, x: DecisionInputs) -> Decision:
    """The rule of the module docstring, in its order."""
    uncached = max(0, x.prompt_tokens - x.cached_on_decode)
    if x.prompt_tokens > 0 and x.cached_on_decode >= settings.prefix_share * x.prompt_tokens:
        return Decision("decode", "prefix_on_decode", uncached)
    if uncached <= settings.threshold_tokens:
        return Decision("decode", "short", uncached)
    if (
        settings.use_prefill_queue
        and uncached <= settings.busy_limit()
        and x.prefill_queue_tokens >= uncached * settings.decode_prefill_cost_ratio
    ):
        return Decision("decode", "prefill_busy", uncached)
    return Decision("disaggregate", "long", uncached)


def local_prefill_threshold(
    handoff_s: float, prefill_s_per_token: float, one_step_chunk: int | None
) -> int:
    """The default ``threshold_tokens`` for a model on given hardware (docs/proxy.md):
    the larger of the break-even (a prompt whose whole prefill costs D less than the handoff
    would cost the request: ``handoff_s / prefill_s_per_token``) and the largest chunk that
    fits in one step of D's decodes under the ITL target (``one_step_chunk``, from the
    planner's roofline; None or 0 when the decodes alone fill the step)."""
    if prefill_s_per_token <= 0:
        raise ValueError("prefill_s_per_token must be positive")
    break_even = int(round(handoff_s / prefill_s_per_token, 6))  # no 249.999... -> 249
    return max(break_even, one_step_chunk or 0)


class PrefixIndex:
    """Which prompt prefixes each decode server holds, as chained hashes of whole blocks of
    token ids, the way vLLM's prefix cache keys its blocks (a block's key covers every token
    before it). An estimate: D may have evicted a block the index still lists (then D
    recomputes it, which costs time, never tokens) and holds prompts other proxies sent."""

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}

    def _keys(self, ids: Sequence[int]) -> list[int]:
        b = self.block_tokens
        keys, prev = [], 0
        for start in range(0, len(ids) - b + 1, b):
            prev = hash((prev, tuple(ids[start : start + b])))
            keys.append(prev)
        return keys

    def cached_tokens(self, server: str, ids: Sequence[int]) -> int:
        """Leading tokens of ``ids`` held on ``server`` (whole blocks; at most all but one
        token: an engine always computes the last prompt token)."""
        held = self._held.get(server)
        if not held or self.max_blocks == 0:
            return 0
        n = 0
        for key in self._keys(ids):
            if key not in held:
                break
            held.move_to_end(key)
            n += 1
        return min(n * self.block_tokens, max(0, len(ids) - 1))

    def record(self, server: str, ids: Sequence[int]) -> None:
        """``server`` now holds ``ids``' KV (it served the prompt, prefilled or received)."""
        if self.max_blocks == 0:
            return
        held = self._held.setdefault(server, OrderedDict())
        for key in self._keys(ids):
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, server: str) -> None:
        """``server`` restarted or left its pool: it holds nothing any more."""
        self._held.pop(server, None)


class QueueEstimate:
    """Uncached prompt tokens ahead of a request on a prefill server: its requests in flight
    times the mean (exponentially weighted) uncached size of the prompts sent to P."""

    def __init__(self, weight: float = 0.1, initial_tokens: float = 0.0) -> None:
        self.weight = weight
        self.mean_tokens = initial_tokens

    def observe(self, uncached_tokens: int) -> None:
        if self.mean_tokens == 0.0:
            self.mean_tokens = float(uncached_tokens)
        else:
            self.mean_tokens += self.weight * (uncached_tokens - self.mean_tokens)

    def tokens_ahead(self, in_flight: int) -> float:
        return in_flight * self.mean_tokens
