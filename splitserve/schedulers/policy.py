"""The adaptive token budget: how many prefill tokens the next step may carry.

Pure and engine-agnostic (no vLLM / SGLang import): the engine adapters
(``splitserve.schedulers.vllm``, ...) describe the next step as a :class:`StepState`, call
:meth:`BudgetPolicy.decide`, apply the answer, and report each executed step back through
:meth:`BudgetPolicy.observe`. It runs in the engine's scheduling process (vLLM: EngineCore),
once per step, and costs a few microseconds (a binary search over at most ``max/alignment``
aligned candidates, each a 4-term dot product).

How it decides (see docs/scheduler.md):

- nothing decoding: the maximum chunk (there is no inter-token latency to protect);
- otherwise: the largest multiple of ``alignment`` in ``[floor, max_chunk]`` whose predicted
  step time, enlarged by ``safety_sigmas`` robust relative residual scales, stays under
  ``target_itl_ms``; the floor when even that one does not fit (prefill must always progress);
- the floor is ``min_chunk`` when it is set; by default, the largest aligned chunk up to
  ``DEFAULT_MIN_CHUNK_TOKENS`` whose step *alone* (no decodes) fits the target: where a block
  is large and tokens are dear (a CPU's 128-token block, a 256-token chunk costing more than the
  target) a fixed floor would break the target in every step that carries a prefill. With
  ``floor_below_block`` (the default; off: at least one block), when not even one block fits
  alone (a chunk deep in a long prompt pays attention over its whole context), the floor goes below
  the block in steps of ``SUB_BLOCK_TOKENS``, at least one such step: the decodes beside it keep
  their target, at the price of every prompt's prefill rate under decode load (TTFT);
- increases are smoothed (``increase_smoothing``), decreases apply at once;
- with ``share_prefill`` (the default) the budget is shared max-min fairly among the pending
  prompts when that beats first come, first served on their mean time to finish
  (:func:`sharing_pays`: a short prompt behind a much longer one): the step's per-prompt cap
  (:func:`share_cap`) lets every prompt shorter than the fair share finish its prefill in the
  step and splits the rest evenly among the longer ones, so a 40-token chat arriving behind a
  4,000-token document is not held for the document's whole prefill (first come, first served
  gives the document the whole budget, step after step); prompts of like length, or in
  shortest-first order, keep the engine's order. The step's cost is predicted for that
  allocation.

Invariants: ``budget <= max_chunk`` (and ``budget >= min_chunk`` when that was set); with decodes
running the budget is a multiple of ``alignment`` (with ``floor_below_block``, when one block
alone breaks the target, a multiple of ``SUB_BLOCK_TOKENS`` below it, at least
``min(SUB_BLOCK_TOKENS, alignment)``); for the same model state a heavier decode load never
gets a larger budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitserve.schedulers.step_model import (
    Observation,
    RobustStepModel,
    StepFeatures,
    StepModelSettings,
    chunk_attention_pairs,
)

# Pending prefill requests looked at when predicting a step; a budget spanning more prompts than
# this is rare, and ignoring the rest only under-counts sequences.
_MAX_PREFILLS_CONSIDERED = 64


# Default smallest prefill budget (rounded up to the alignment): prompts keep progressing at a
# useful rate even when no larger chunk fits the target.
DEFAULT_MIN_CHUNK_TOKENS = 256
# The default floor's granularity below one block (vLLM's GPU block): chunks need not end on a
# block boundary, but a handful of tokens per step would make a prompt crawl.
SUB_BLOCK_TOKENS = 16


class BudgetPolicySettings(BaseModel):
    """Settings of the adaptive chunk-size scheduler (all engines).

    ``None`` for ``alignment``, ``min_chunk`` or ``max_chunk`` means "from the engine": its KV
    block size, the smallest multiple of it that is at least ``DEFAULT_MIN_CHUNK_TOKENS`` (but not
    above ``max_chunk``), and its start-up ``max_num_batched_tokens``. A ``min_chunk`` left to
    the default is a ceiling on the floor, not the floor: each step lowers it to what fits the
    target in a step of its own (module docstring).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_itl_ms: float = Field(
        50.0, gt=0, description="inter-token latency target: the predicted step time limit"
    )
    min_chunk: int | None = Field(
        None, ge=1, description="smallest prefill budget (tokens); unset: the largest chunk up "
        "to 256 whose step alone fits the target",
    )  # fmt: skip
    max_chunk: int | None = Field(None, ge=1, description="largest prefill budget (tokens)")
    alignment: int | None = Field(None, ge=1, description="budgets are multiples of this")
    safety_sigmas: float = Field(
        2.0, ge=0, description="margin: predictions are enlarged by this many relative scales"
    )
    increase_smoothing: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="0 jumps up at once; s moves a fraction (1-s) of the way up per step",
    )
    step_model: StepModelSettings = Field(default_factory=StepModelSettings)
    log_interval_s: float = Field(
        10.0, gt=0, description="adapter: seconds between info-level budget summaries"
    )
    floor_below_block: bool = Field(
        True,
        description="with min_chunk unset: let the floor go below one block (16-token steps) "
        "when not even a block fits the target alone; protects inter-token gaps beside long "
        "prompts, slows every prompt's prefill under decode load; false: at least one block",
    )
    share_prefill: bool = Field(
        True,
        description="split the prefill budget max-min fairly among pending prompts (short "
        "ones finish, long ones share the rest) where that beats first come, first served; "
        "false: always first come, first served",
    )
    share_always: bool = Field(
        False,
        description="with share_prefill: share on every step with several prompts, also where "
        "first come, first served finishes them sooner on average (prompts of like length, "
        "shortest first); default: only where sharing pays",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="adapter: serve Prometheus metrics from the scheduling process on this port",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> BudgetPolicySettings:
        if (
            self.min_chunk is not None
            and self.max_chunk is not None
            and self.min_chunk > self.max_chunk
        ):
            raise ValueError(
                f"min_chunk ({self.min_chunk}) must not exceed max_chunk ({self.max_chunk})"
            )
        if (
            self.min_chunk is not None
            and self.alignment is not None
            and self.min_chunk % self.alignment
        ):
            raise ValueError(
                f"min_chunk ({self.min_chunk}) must be a multiple of alignment ({self.alignment})"
            )
        return self

    def resolve(self, *, engine_block_size: int, engine_max_tokens: int) -> ResolvedBounds:
        """Fill the engine-derived defaults; ValueError (naming the field) when they clash."""
        alignment = self.alignment or engine_block_size
        max_chunk = self.max_chunk if self.max_chunk is not None else engine_max_tokens
        if max_chunk > engine_max_tokens:
            raise ValueError(
                f"max_chunk ({max_chunk}) exceeds the engine's start-up "
                f"max_num_batched_tokens ({engine_max_tokens})"
            )
        if self.min_chunk is not None:
            min_chunk = self.min_chunk
        else:
            # A one-block chunk (16 tokens on a GPU) would make prompts crawl under decode load,
            # each step paying the fixed step cost for a handful of tokens.
            min_chunk = -(-DEFAULT_MIN_CHUNK_TOKENS // alignment) * alignment
            min_chunk = max(alignment, min(min_chunk, max_chunk - max_chunk % alignment))
        if min_chunk % alignment:
            raise ValueError(
                f"min_chunk ({min_chunk}) must be a multiple of alignment ({alignment})"
            )
        if min_chunk > max_chunk:
            raise ValueError(
                f"min_chunk ({min_chunk}) must not exceed max_chunk ({max_chunk}); "
                f"alignment is {alignment}"
            )
        return ResolvedBounds(
            alignment=alignment,
            min_chunk=min_chunk,
            max_chunk=max_chunk,
            floor_from_target=self.min_chunk is None,
        )


@dataclass(frozen=True)
class ResolvedBounds:
    alignment: int
    min_chunk: int
    max_chunk: int
    # min_chunk was left to the default: it caps the floor, which each step lowers to the
    # largest aligned chunk whose step alone fits the target (at least one alignment unit).
    floor_from_target: bool = False


@dataclass(frozen=True)
class PendingPrefill:
    """A request with prompt tokens still to compute, in the order the engine will take them."""

    remaining_tokens: int
    computed_tokens: int = 0


@dataclass(frozen=True)
class StepState:
    """What the next step holds before the budget is chosen."""

    decode_context_lens: Sequence[int]
    prefills: Sequence[PendingPrefill] = ()

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)

    @property
    def waiting_prefill_tokens(self) -> int:
        return sum(p.remaining_tokens for p in self.prefills)


@dataclass(frozen=True)
class BudgetDecision:
    """The prefill allowance for one step and why."""

    prefill_budget: int
    predicted_step_s: float
    reason: str  # "no_decodes" | "fits" | "min_chunk"
    # Most prefill tokens one prompt may take this step (vLLM: the step's
    # long_prefill_token_threshold); 0: no cap (every prompt fits, or sharing is off).
    prompt_cap: int = 0


class BudgetPolicy:
    """Chooses each step's prefill budget and learns step times (one instance per engine)."""

    def __init__(
        self, settings: BudgetPolicySettings, bounds: ResolvedBounds, model: RobustStepModel
    ) -> None:
        self.settings = settings
        self.bounds = bounds
        self.model = model
        self._previous_budget: int | None = None

    @classmethod
    def create(
        cls, settings: BudgetPolicySettings, *, engine_block_size: int, engine_max_tokens: int
    ) -> BudgetPolicy:
        bounds = settings.resolve(
            engine_block_size=engine_block_size, engine_max_tokens=engine_max_tokens
        )
        return cls(settings, bounds, RobustStepModel(settings.step_model))

    def decide(self, state: StepState) -> BudgetDecision:
        """The prefill budget for the next step (tokens on top of one per decode)."""
        if state.num_decodes == 0:
            budget = self.bounds.max_chunk
            self._previous_budget = budget
            cap = self._cap(self._shared(state), budget)
            predicted = self.model.predict_s(plan_features(state, budget, 0, 0, cap))
            return BudgetDecision(budget, predicted, "no_decodes", cap)

        align = self.bounds.alignment
        # The margin is relative, like the noise: predicted * (1 + k * scale) <= target.
        limit_s = (self.settings.target_itl_ms / 1e3) / (
            1.0 + self.settings.safety_sigmas * self.model.relative_scale
        )
        shared = self._shared(state)  # the same prompts share every candidate budget
        floor = self._floor_tokens(state, limit_s, shared)
        decode_tokens = state.num_decodes
        decode_pairs = sum(c + 1 for c in state.decode_context_lens)

        def fits_tokens(budget: int) -> bool:
            cap = self._cap(shared, budget)
            features = plan_features(state, budget, decode_tokens, decode_pairs, cap)
            return self.model.predict_s(features) <= limit_s

        def fits(units: int) -> bool:
            return fits_tokens(units * align)

        if not fits_tokens(floor):
            raw, reason = floor, "min_chunk"
        elif floor < align:  # one block alone breaks the target: nothing larger fits
            raw, reason = floor, "fits"
        else:
            units = _largest(fits, floor // align, self.bounds.max_chunk // align)
            raw, reason = units * align, "fits"

        budget = self._smooth(raw, floor)
        cap = self._cap(shared, budget)
        features = plan_features(state, budget, decode_tokens, decode_pairs, cap)
        return BudgetDecision(budget, self.model.predict_s(features), reason, cap)

    def predict_s(self, state: StepState, prefill_budget: int) -> float:
        """Predicted duration of the next step if it gets ``prefill_budget`` prefill tokens
        (shared as :meth:`decide` would share them)."""
        return self.model.predict_s(self.step_features(state, prefill_budget))

    def step_features(self, state: StepState, prefill_budget: int) -> StepFeatures:
        """What the engine's step computes with this budget, shared as :meth:`decide` shares
        it."""
        cap = self._cap(self._shared(state), prefill_budget)
        return plan_features(state, prefill_budget, prompt_cap=cap)

    def _shared(self, state: StepState) -> list[int] | None:
        """The pending prompts' remaining tokens when this step's budget is to be shared among
        them; None when the step runs in the engine's order. Independent of the budget, so
        :meth:`decide` asks once per step, not once per candidate."""
        if not self.settings.share_prefill or len(state.prefills) < 2:
            return None
        remaining = [p.remaining_tokens for p in state.prefills[:_MAX_PREFILLS_CONSIDERED]]
        if not self.settings.share_always and not sharing_pays(remaining):
            return None
        return remaining

    def _cap(self, shared: list[int] | None, budget: int) -> int:
        """The step's per-prompt cap for ``budget`` (0: none)."""
        return 0 if shared is None else share_cap(shared, budget, self.bounds.alignment)

    def observe(self, executed: StepFeatures, measured_s: float) -> Observation:
        """Learn from a step that ran (what it computed and how long it took)."""
        return self.model.observe(executed, measured_s)

    def _floor_tokens(self, state: StepState, limit_s: float, shared: list[int] | None) -> int:
        """The smallest budget of this step: ``min_chunk`` when it was set; else the largest
        aligned chunk up to it whose step alone (no decodes) is predicted within ``limit_s``,
        at least one block; with ``floor_below_block``, when not even one block fits alone, the
        largest multiple of ``SUB_BLOCK_TOKENS`` below the block that does, at least one. The
        step is predicted as it would run (shared among ``shared``, from :meth:`_shared`: a
        chat's chunk beside a deep document costs less than the document's own). It does not
        depend on the decodes, so a heavier decode load still never gets a larger budget."""
        align = self.bounds.alignment
        top = self.bounds.min_chunk // align
        if not self.bounds.floor_from_target:
            return top * align

        def alone_fits(tokens: int) -> bool:  # the step as it would run: shared, if it is
            cap = self._cap(shared, tokens)
            return self.model.predict_s(plan_features(state, tokens, 0, 0, cap)) <= limit_s

        if alone_fits(align):
            return _largest(lambda u: alone_fits(u * align), 1, top) * align
        if not self.settings.floor_below_block:
            return align
        step = min(SUB_BLOCK_TOKENS, align)
        below = (align - 1) // step  # multiples of step strictly below one block
        if below < 1 or not alone_fits(step):
            return step
        return _largest(lambda u: alone_fits(u * step), 1, below) * step

    def _smooth(self, raw: int, floor: int) -> int:
        previous = self._previous_budget
        if previous is None or raw <= previous:
            budget = raw
        else:
            align = self.bounds.alignment
            step = (raw - previous) * (1.0 - self.settings.increase_smoothing)
            # At least one alignment unit up, at most to the raw answer, always aligned.
            budget = min(raw, previous - previous % align + max(align, int(step) // align * align))
            budget = max(budget, floor)
        self._previous_budget = budget
        return budget


def sharing_pays(remaining: Sequence[int]) -> bool:
    """Whether sharing the budget beats first come, first served for prompts with ``remaining``
    tokens to prefill, in the engine's order: their mean time to finish, fluid (every step's
    budget spent in full; the budget cancels out), is lower under processor sharing (each step
    split max-min fairly) than in order.

    Sharing pays when a short prompt waits behind a much longer one (two prompts: when the first
    is over twice as long as the second). Among prompts of like length, or shortest first, it
    only delays them: two equal prompts finish at 2T each shared, at T and 2T in order."""
    pending = [r for r in remaining if r > 0]
    if len(pending) < 2:
        return False
    in_order = sum(itertools.accumulate(pending))
    shared = finish = previous = 0
    for i, r in enumerate(sorted(pending)):
        finish += (r - previous) * (len(pending) - i)  # the rest share the budget until r
        previous = r
        shared += finish
    return shared < in_order


def share_cap(remaining: Sequence[int], budget: int, alignment: int = 1) -> int:
    """The per-prompt cap that shares ``budget`` max-min fairly among prompts with
    ``remaining`` tokens to prefill: the largest cap ``c`` with ``sum(min(r, c)) <= budget``
    (water-filling), rounded down to a multiple of ``alignment`` where one fits (chunks that end
    on a block boundary), and at least 1. 0 (no cap) when every prompt fits whole.

    With the cap, every prompt of at most ``c`` tokens completes its prefill in the step; the
    longer ones take ``c`` each. Rounding down never overspends the budget; it may leave part of
    it unused, which is the price of aligned chunks."""
    pending = sorted(r for r in remaining if r > 0)
    left = budget
    for i, r in enumerate(pending):
        share = left // (len(pending) - i)
        if r > share:
            if share >= alignment:
                share -= share % alignment
            return max(1, share)
        left -= r
    return 0


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest ``u`` in ``[lo, hi]`` with ``fits(u)``, given ``fits(lo)`` and that ``fits``
    only turns false as ``u`` grows (predictions never decrease with the budget: the step
    model's coefficients are non-negative): a bisection."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_features(
    state: StepState,
    prefill_budget: int,
    decode_tokens: int | None = None,
    decode_pairs: int | None = None,
    prompt_cap: int = 0,
) -> StepFeatures:
    """Features of the step the engine would run with this prefill budget: prefills taken in
    the engine's (FCFS) order, each at most ``prompt_cap`` tokens when that is set.

    ``decode_tokens`` / ``decode_pairs`` may be passed precomputed (the bisection does).
    """
    if decode_tokens is None:
        decode_tokens = state.num_decodes
    if decode_pairs is None:
        decode_pairs = sum(c + 1 for c in state.decode_context_lens)
    left = prefill_budget
    tokens, sequences, pairs = decode_tokens, decode_tokens, decode_pairs
    for prefill in state.prefills[:_MAX_PREFILLS_CONSIDERED]:
        if left <= 0:
            break
        take = min(left, prefill.remaining_tokens)
        if prompt_cap > 0:
            take = min(take, prompt_cap)
        if take <= 0:
            continue
        tokens += take
        sequences += 1
        pairs += chunk_attention_pairs(prefill.computed_tokens, take)
        left -= take
    return StepFeatures(tokens=tokens, sequences=sequences, attention_pairs=pairs)


# --- where the settings come from -------------------------------------------------------------

ADDITIONAL_CONFIG_KEY = "splitserve_scheduler"
SETTINGS_FILE_ENV = "SPLITSERVE_SCHEDULER_CONFIG"


class SchedulerSettingsError(ValueError):
    """The scheduler's settings are missing, unreadable or invalid (raised at engine start-up)."""


def load_budget_settings(
    inline: Mapping[str, Any] | None, environ: Mapping[str, str]
) -> BudgetPolicySettings:
    """Settings from an inline mapping (vLLM: ``--additional-config '{"splitserve_scheduler":
    {...}}'``) or from the YAML/JSON file named by ``$SPLITSERVE_SCHEDULER_CONFIG``; defaults when
    neither is given. Both at once is an error (which one wins would be a guess).
    """
    path = environ.get(SETTINGS_FILE_ENV)
    if inline is not None and path:
        raise SchedulerSettingsError(
            f"scheduler settings given twice: additional_config[{ADDITIONAL_CONFIG_KEY!r}] and "
            f"${SETTINGS_FILE_ENV}={path}; keep one"
        )
    if path:
        source = f"${SETTINGS_FILE_ENV}={path}"
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise SchedulerSettingsError(f"cannot read scheduler settings {source}: {exc}") from exc
        data = {} if data is None else data
    else:
        source = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
        data = {} if inline is None else inline
    if not isinstance(data, Mapping):
        raise SchedulerSettingsError(
            f"scheduler settings ({source}) must be a mapping, got {type(data).__name__}"
        )
    try:
        return BudgetPolicySettings.model_validate(dict(data))
    except ValidationError as exc:
        raise SchedulerSettingsError(f"invalid scheduler settings ({source}): {exc}") from exc
