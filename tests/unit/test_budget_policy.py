"""Unit tests of the pure adaptive-budget policy and its robust step-time model."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from splitserve.schedulers.policy import (
    BudgetPolicy,
    BudgetPolicySettings,
    PendingPrefill,
    StepState,
    plan_features,
)
from splitserve.schedulers.step_model import (
    RobustStepModel,
    StepFeatures,
    StepModelPrior,
    StepModelSettings,
)

ALIGN = 128
ENGINE_MAX = 4096

# The "machine" of the synthetic tests: a step costs this (ms per feature unit, see step_model).
TRUE_MS = (4.0, 60.0, 3.0, 8.0)


def true_step_s(features: StepFeatures) -> float:
    return sum(c * v for c, v in zip(TRUE_MS, features.vector(), strict=True)) / 1e3


def make_policy(**overrides) -> BudgetPolicy:
    settings = BudgetPolicySettings(**{"target_itl_ms": 40.0, **overrides})
    return BudgetPolicy.create(settings, engine_block_size=ALIGN, engine_max_tokens=ENGINE_MAX)


def random_state(rng: random.Random, max_decodes: int = 64) -> StepState:
    decodes = [rng.randint(16, 3000) for _ in range(rng.randint(0, max_decodes))]
    prefills = [
        PendingPrefill(rng.randint(1, 4000), rng.choice([0, 0, 512, 1024]))
        for _ in range(rng.randint(0, 3))
    ]
    return StepState(decode_context_lens=decodes, prefills=prefills)


def train(policy: BudgetPolicy, rng: random.Random, steps: int, noise: float = 0.03) -> None:
    """Run the decide/execute/observe loop against the synthetic machine."""
    for _ in range(steps):
        state = random_state(rng)
        # Explore: sometimes execute a random budget, as a real engine does when prompts end.
        budget = policy.decide(state).prefill_budget
        if rng.random() < 0.3:
            budget = rng.choice(range(ALIGN, ENGINE_MAX + 1, ALIGN))
        executed = policy.step_features(state, budget)
        measured = true_step_s(executed) * (1 + rng.uniform(-noise, noise))
        policy.observe(executed, measured)


def oracle_budget(policy: BudgetPolicy, state: StepState) -> int:
    """The largest aligned budget that keeps the true step, with the policy's margin, in target."""
    margin = 1 + policy.settings.safety_sigmas * policy.model.relative_scale
    best = policy.bounds.min_chunk
    for budget in range(policy.bounds.min_chunk, policy.bounds.max_chunk + 1, ALIGN):
        step_ms = true_step_s(policy.step_features(state, budget)) * 1e3 * margin
        if step_ms <= policy.settings.target_itl_ms:
            best = budget
    return best


def assert_near_oracle(policy: BudgetPolicy, state: StepState) -> None:
    """The prefill tokens the step would carry are within one alignment unit of the oracle's."""
    waiting = state.waiting_prefill_tokens
    chosen = min(policy.decide(state).prefill_budget, waiting)
    best = min(oracle_budget(policy, state), waiting)
    assert abs(chosen - best) <= ALIGN, (chosen, best, state)


# --- settings -------------------------------------------------------------------------------


def test_settings_defaults_resolve_from_engine() -> None:
    bounds = BudgetPolicySettings().resolve(engine_block_size=16, engine_max_tokens=8192)
    assert (bounds.alignment, bounds.min_chunk, bounds.max_chunk) == (16, 256, 8192)
    bounds = BudgetPolicySettings().resolve(engine_block_size=96, engine_max_tokens=8192)
    assert bounds.min_chunk == 288  # rounded up to the alignment
    bounds = BudgetPolicySettings().resolve(engine_block_size=128, engine_max_tokens=200)
    assert (bounds.min_chunk, bounds.max_chunk) == (128, 200)  # never above the maximum


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target_itl_ms": 0}, "target_itl_ms"),
        ({"min_chunk": 0}, "min_chunk"),
        ({"increase_smoothing": 1.0}, "increase_smoothing"),
        ({"chunk_size": 512}, "chunk_size"),
        ({"step_model": {"forgetting_factor": 2}}, "forgetting_factor"),
        ({"step_model": {"prior": {"intercept_ms": -1}}}, "intercept_ms"),
        ({"min_chunk": 512, "max_chunk": 256}, "min_chunk"),
        ({"min_chunk": 100, "alignment": 64}, "alignment"),
    ],
)
def test_settings_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        BudgetPolicySettings(**kwargs)


def test_resolve_rejects_chunks_beyond_the_engine() -> None:
    with pytest.raises(ValueError, match=r"max_chunk \(8192\).*max_num_batched_tokens \(4096\)"):
        BudgetPolicySettings(max_chunk=8192).resolve(engine_block_size=16, engine_max_tokens=4096)
    with pytest.raises(ValueError, match=r"min_chunk \(100\) must be a multiple of alignment"):
        BudgetPolicySettings(min_chunk=100).resolve(engine_block_size=16, engine_max_tokens=4096)


# --- decisions ------------------------------------------------------------------------------


def test_no_decodes_gives_the_maximum_chunk() -> None:
    policy = make_policy(target_itl_ms=0.001)  # nothing would fit the target
    state = StepState(decode_context_lens=[], prefills=[PendingPrefill(100_000)])
    decision = policy.decide(state)
    assert (decision.prefill_budget, decision.reason) == (ENGINE_MAX, "no_decodes")


def test_unaligned_maximum_is_used_whole_when_nothing_decodes() -> None:
    policy = BudgetPolicy.create(
        BudgetPolicySettings(), engine_block_size=128, engine_max_tokens=1000
    )
    assert policy.decide(StepState(decode_context_lens=[])).prefill_budget == 1000
    decision = policy.decide(StepState(decode_context_lens=[10], prefills=[PendingPrefill(50)]))
    assert decision.prefill_budget % 128 == 0 and decision.prefill_budget <= 1000


def test_minimum_chunk_when_nothing_fits() -> None:
    policy = make_policy(target_itl_ms=0.001, min_chunk=256)
    decision = policy.decide(StepState([500] * 8, [PendingPrefill(10_000)]))
    assert (decision.prefill_budget, decision.reason) == (256, "min_chunk")


def cpu_like_policy(**overrides) -> BudgetPolicy:
    """A policy that already knows a CPU-like machine: 19 ms a step plus 0.9 ms a token (a
    128-token block; 256 tokens alone cost 250 ms)."""
    prior = StepModelPrior(
        intercept_ms=19.0, ms_per_1k_tokens=900.0, ms_per_100_sequences=1e-6, ms_per_1m_pairs=1e-6
    )
    settings = {"target_itl_ms": 150.0, "safety_sigmas": 0.0, "step_model": {"prior": prior}}
    return make_policy(**{**settings, **overrides})


def test_default_floor_is_what_fits_the_target_alone() -> None:
    """min_chunk left to its default: a step beside decodes carries one 128-token block (about
    134 ms) rather than the 256-token default floor (about 250 ms, over the 150 ms target)."""
    policy = cpu_like_policy()
    assert policy.bounds.floor_from_target and policy.bounds.min_chunk == 256
    decision = policy.decide(StepState([300] * 4, [PendingPrefill(3000)]))
    assert (decision.prefill_budget, decision.reason) == (128, "fits")
    assert decision.predicted_step_s * 1e3 <= 150.0
    # A target that not even one block meets alone, with floor_below_block off: one block,
    # the least harm (and progress).
    state = StepState([300], [PendingPrefill(3000)])
    tight = cpu_like_policy(target_itl_ms=50.0, floor_below_block=False).decide(state)
    assert (tight.prefill_budget, tight.reason) == (128, "min_chunk")
    # floor_below_block (the default): below the block, in steps of 16 tokens, the largest that
    # fits alone (19 ms + 0.9 ms x 32 = 47.8 ms within 50; 48 tokens: 62 ms).
    below = cpu_like_policy(target_itl_ms=50.0).decide(state)
    assert (below.prefill_budget, below.reason) == (32, "fits")  # with its one decode: 48.7 ms
    # Not even the smallest step fits: 16 tokens.
    hopeless = cpu_like_policy(target_itl_ms=20.0, floor_below_block=True).decide(state)
    assert (hopeless.prefill_budget, hopeless.reason) == (16, "min_chunk")
    # Where tokens are cheap the floor stays at the default 256.
    cheap = cpu_like_policy(target_itl_ms=1000.0)
    one = StepState([300], [PendingPrefill(3000)])
    assert cheap._floor_tokens(one, 1.0, cheap._shared(one)) == 256


def test_the_floor_is_predicted_for_the_step_as_it_runs_shared() -> None:
    """A deep document first and a chat behind it: shared, half of each step is the chat's
    cheap chunk, so more tokens fit the target than in the document's own step (attention at
    depth 3,000: 0.88 ms per 1k pairs, as fitted on the mid model)."""
    prior = StepModelPrior(
        intercept_ms=19.0, ms_per_1k_tokens=900.0, ms_per_100_sequences=1e-6, ms_per_1m_pairs=880.0
    )
    settings = {"target_itl_ms": 150.0, "safety_sigmas": 0.0, "step_model": {"prior": prior}}
    state = StepState([300], [PendingPrefill(1000, 3000), PendingPrefill(100)])
    in_order = make_policy(**settings, share_prefill=False)
    shared = make_policy(**settings)
    assert in_order._shared(state) is None
    assert in_order._floor_tokens(state, 0.150, None) == 32
    assert shared._floor_tokens(state, 0.150, shared._shared(state)) == 48


def test_a_min_chunk_that_was_set_is_kept() -> None:
    policy = cpu_like_policy(min_chunk=256)
    assert not policy.bounds.floor_from_target
    decision = policy.decide(StepState([300] * 4, [PendingPrefill(3000)]))
    assert (decision.prefill_budget, decision.reason) == (256, "min_chunk")


def test_budgets_respect_bounds_and_alignment() -> None:
    rng = random.Random(1)
    for target in (5.0, 40.0, 400.0):
        policy = make_policy(target_itl_ms=target, min_chunk=256, max_chunk=3000)
        train(policy, rng, 50)
        for _ in range(300):
            state = random_state(rng, max_decodes=200)
            budget = policy.decide(state).prefill_budget
            assert 256 <= budget <= 3000
            if state.num_decodes:
                assert budget % ALIGN == 0


def test_budget_is_non_increasing_as_decode_load_grows() -> None:
    rng = random.Random(2)
    policy = make_policy(increase_smoothing=0.0)
    train(policy, rng, 300)
    prefills = [PendingPrefill(8000, 0)]
    for context in (64, 1024, 4096):
        budgets = [
            policy.decide(StepState([context] * n, prefills)).prefill_budget
            for n in range(1, 200, 3)
        ]
        assert budgets == sorted(budgets, reverse=True), budgets
        assert budgets[0] > budgets[-1]  # the load really mattered
    # Longer contexts (more attention work) for the same count: no larger budget either.
    by_context = [
        policy.decide(StepState([c] * 16, prefills)).prefill_budget for c in (16, 512, 2048, 8000)
    ]
    assert by_context == sorted(by_context, reverse=True)


def test_increases_are_smoothed_and_decreases_immediate() -> None:
    policy = make_policy(increase_smoothing=0.5, target_itl_ms=60.0)
    rng = random.Random(3)
    train(policy, rng, 300)
    heavy = StepState([8000] * 250, [PendingPrefill(10_000)])
    light = StepState([100] * 2, [PendingPrefill(10_000)])
    low = policy.decide(heavy).prefill_budget
    unsmoothed = make_policy(increase_smoothing=0.0, target_itl_ms=60.0)
    unsmoothed.model = policy.model
    target = unsmoothed.decide(light).prefill_budget
    assert target > low + 2 * ALIGN
    climb = [policy.decide(light).prefill_budget for _ in range(12)]
    assert low < climb[0] < target
    assert climb == sorted(climb) and climb[-1] == target
    assert policy.decide(heavy).prefill_budget == low


# --- the step-time model --------------------------------------------------------------------


def test_converges_on_synthetic_step_times() -> None:
    rng = random.Random(4)
    policy = make_policy(increase_smoothing=0.0)
    train(policy, rng, 400)
    errors = []
    for _ in range(200):
        state = random_state(rng)
        features = plan_features(state, rng.choice(range(ALIGN, ENGINE_MAX + 1, ALIGN)))
        errors.append(abs(policy.model.predict_s(features) / true_step_s(features) - 1))
    assert max(errors) < 0.05, max(errors)
    # The decisions match the true machine's best answer, within one alignment unit (the safety
    # margin of a few percent noise).
    for _ in range(100):
        state = random_state(rng)
        if state.num_decodes:
            assert_near_oracle(policy, state)


def test_a_single_outlier_is_ignored() -> None:
    rng = random.Random(5)
    policy = make_policy(increase_smoothing=0.0)
    train(policy, rng, 300)
    probes = [random_state(rng) for _ in range(50)]
    before = [policy.decide(s).prefill_budget for s in probes]
    coefficients = policy.model.coefficients
    executed = plan_features(StepState([300] * 8, [PendingPrefill(512)]), 512)
    observation = policy.observe(executed, true_step_s(executed) * 40)  # a GC pause
    assert not observation.accepted
    assert observation.error_s > 0
    assert policy.model.coefficients == coefficients
    assert [policy.decide(s).prefill_budget for s in probes] == before


def test_a_cold_start_does_not_collapse_the_budget() -> None:
    rng = random.Random(6)
    policy = make_policy(increase_smoothing=0.0)
    first = plan_features(StepState([], [PendingPrefill(4000)]), 4000)
    policy.observe(first, 30.0)  # the first step compiles kernels, warms caches: 30 s
    train(policy, rng, 300)
    for _ in range(100):
        state = random_state(rng)
        if state.num_decodes:
            assert_near_oracle(policy, state)


def test_a_lasting_slowdown_is_learned() -> None:
    rng = random.Random(7)
    policy = make_policy(increase_smoothing=0.0)
    train(policy, rng, 300)
    state = StepState([800] * 24, [PendingPrefill(10_000)])
    before = policy.decide(state).prefill_budget
    for _ in range(60):  # the machine becomes 2x slower (another tenant arrived)
        features = plan_features(random_state(rng), rng.choice(range(ALIGN, 4097, ALIGN)))
        policy.observe(features, 2 * true_step_s(features))
    after = policy.decide(state).prefill_budget
    assert after < before
    features = plan_features(state, 1024)
    assert policy.model.predict_s(features) == pytest.approx(2 * true_step_s(features), rel=0.15)


def test_coefficients_stay_non_negative() -> None:
    model = RobustStepModel(StepModelSettings(prior=StepModelPrior(ms_per_1m_pairs=50.0)))
    rng = random.Random(8)
    for _ in range(200):  # steps whose cost does not grow with attention at all
        features = StepFeatures(rng.randint(1, 4000), rng.randint(1, 100), rng.randint(1, 10**7))
        model.observe(features, (1 + features.tokens / 100) / 1e3)
    assert all(value >= 0 for value in model.coefficients.values())
    assert model.coefficients["ms_per_1m_pairs"] < 1.0


# --- sharing the budget among prompts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining", "budget", "alignment", "cap"),
    [
        ([40, 4000], 512, 1, 472),  # the chat finishes, the document takes the rest
        ([40, 4000], 512, 128, 384),  # ... rounded down to a block
        ([100, 200], 512, 1, 0),  # everything fits: no cap
        ([4000, 4000], 512, 128, 256),  # two long prompts: half each
        ([10, 20, 30, 4000, 4000], 300, 1, 120),  # (300 - 60) / 2
        ([4000] * 8, 256, 128, 32),  # a share below one block is kept, not rounded to 0
        ([4000] * 300, 256, 1, 1),  # at least one token
        ([], 256, 1, 0),
    ],
)
def test_share_cap_is_max_min_fair(remaining, budget, alignment, cap) -> None:
    from splitserve.schedulers.policy import share_cap

    got = share_cap(remaining, budget, alignment)
    assert got == cap
    if got:
        assert sum(min(r, got) for r in remaining) <= max(budget, len(remaining))


def test_a_chat_behind_a_document_gets_its_prefill_in_the_same_step() -> None:
    """First come, first served would give the running document the whole budget; shared, the
    chat's 40 tokens run in this step and the predicted cost is that of the shared step."""
    for decodes in ([], [1000] * 4):
        state = StepState(decodes, [PendingPrefill(4080, 1000), PendingPrefill(40)])
        shared = make_policy(target_itl_ms=500.0)
        fcfs = make_policy(target_itl_ms=500.0, share_prefill=False)
        decision = shared.decide(state)
        assert 0 < decision.prompt_cap <= decision.prefill_budget - 40
        features = shared.step_features(state, decision.prefill_budget)
        assert features.sequences == len(decodes) + 2
        assert fcfs.decide(state).prompt_cap == 0


def test_one_prompt_or_sharing_off_means_no_cap() -> None:
    state = StepState([500] * 4, [PendingPrefill(4000)])
    assert make_policy(share_prefill=True).decide(state).prompt_cap == 0
    two = StepState([500] * 4, [PendingPrefill(4000), PendingPrefill(400)])
    assert make_policy(share_prefill=False).decide(two).prompt_cap == 0
    assert make_policy().decide(two).prompt_cap > 0  # on by default


@pytest.mark.parametrize(
    ("remaining", "pays"),
    [
        ([4000, 40], True),  # a chat behind a document
        ([40, 4000], False),  # shortest first already
        ([4000, 4000], False),  # equal: shared, both finish at 2T; in order, at T and 2T
        ([500, 300], False),  # the first is less than twice the second
        ([500, 240], True),  # ... more than twice
        ([3000, 200, 3000, 200], True),
        ([200, 200, 3000, 3000], False),
        ([4000, 0], False),  # one prompt left
        ([4000], False),
    ],
)
def test_sharing_only_where_it_beats_the_engines_order(remaining, pays) -> None:
    from splitserve.schedulers.policy import sharing_pays

    assert sharing_pays(remaining) is pays
    state = StepState([500] * 4, [PendingPrefill(r) for r in remaining if r > 0])
    decision = make_policy(share_prefill=True, target_itl_ms=500.0).decide(state)
    assert (decision.prompt_cap > 0) is (pays and sum(remaining) > decision.prefill_budget)
    always = make_policy(share_prefill=True, share_always=True, target_itl_ms=500.0)
    decision = always.decide(state)
    several = len([r for r in remaining if r > 0]) >= 2
    assert (decision.prompt_cap > 0) is (several and sum(remaining) > decision.prefill_budget)


def test_sharing_pays_matches_a_step_by_step_simulation() -> None:
    """The fluid formula against a simulation of the two orders, one token per step."""
    import itertools
    import random

    from splitserve.schedulers.policy import sharing_pays

    rng = random.Random(3)
    for _ in range(200):
        remaining = [rng.randint(1, 60) for _ in range(rng.randint(2, 5))]
        in_order = sum(itertools.accumulate(remaining))
        left, t, shared = sorted(remaining), 0.0, 0.0
        while left:  # processor sharing: the smallest finishes first, all progress together
            step = left[0]
            t += step * len(left)
            left = [r - step for r in left[1:]]
            shared += t * (1 + sum(1 for r in left if r == 0))
            left = [r for r in left if r > 0]
        assert sharing_pays(remaining) is (shared < in_order)
