"""The simulator timed by a step model measured on a served engine (a calibration file's
``step_model``, written by ``benchmarks/calibrate_engine.py``), with vLLM's
``long_prefill_token_threshold`` and the adaptive budget's own target as fleet settings.

Pure unit tests of our own logic: the step model's coefficients are chosen here, so every
expected time is arithmetic.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from splitserve.planner.calibration_file import EngineStepModel, load_calibration
from splitserve.planner.catalog import ACCELERATORS, PlannerInputError, get_link, get_model
from splitserve.planner.sim.engine import Simulation
from splitserve.planner.sim.fleet import Fleet, ServerSettings, parse_fleet
from splitserve.planner.sim.steptime import MeasuredStepTimer, StepTimer
from splitserve.planner.sim.workload import Requests, Workload
from splitserve.schedulers.step_model import StepFeatures, chunk_attention_pairs

MODEL = get_model("splitserve-mid")
SM = EngineStepModel(
    model="splitserve-mid",
    intercept_ms=10.0,
    ms_per_1k_tokens=500.0,
    ms_per_100_sequences=20.0,
    ms_per_1m_pairs=100.0,
)
H100 = ACCELERATORS["H100"]
CAL_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "calibrate_engine.py"


def test_measured_timer_is_the_step_model_and_keeps_the_memory_figures() -> None:
    timer = MeasuredStepTimer(MODEL, H100, SM)
    # four decodes at context 100: 4 tokens, 4 sequences, 4 x 101 pairs
    assert timer.seconds(4, 404, 400, 4) == pytest.approx(SM.predict_ms(4, 4, 404) / 1e3)
    # a 1000-token chunk beside them: five sequences, of which four sample
    pairs = 404 + chunk_attention_pairs(0, 1000)
    assert timer.seconds(1004, pairs, 400, 4, 5) == pytest.approx(
        SM.predict_ms(1004, 5, pairs) / 1e3
    )
    roofline = StepTimer(MODEL, H100)
    assert (timer.kv_bytes_per_token, timer.mem_bytes) == (
        roofline.kv_bytes_per_token,
        roofline.mem_bytes,
    )
    assert timer.seconds(0, 0, 0, 0) == 0.0


def test_measured_timer_refuses_another_model() -> None:
    with pytest.raises(PlannerInputError, match="measured with splitserve-mid, not Llama"):
        MeasuredStepTimer(get_model("Llama-3.1-8B"), H100, SM)


def _one_prompt(tokens: int) -> Requests:
    return Requests([0.0], [tokens], [2], [0], [-1], [0])


def _ttft_ms(settings: ServerSettings, tokens: int) -> float:
    base = Fleet(pools=[{"role": "colocated", "count": 1}], server=settings)
    fleet = parse_fleet("1C:H100", base)
    wl = Workload.single(tokens, 2, 60_000, 60_000)
    sim = Simulation(MODEL, fleet, wl, _one_prompt(tokens), ACCELERATORS,
                     get_link("NVLink4"), step_models={"H100": SM})  # fmt: skip
    return sim.run().per_class[0]["ttft_ms"]["p50"]


def test_a_prompt_is_timed_by_the_step_model_in_the_chunks_vllm_would_run() -> None:
    pairs = chunk_attention_pairs(0, 1000)
    one_step = SM.predict_ms(1000, 1, pairs)
    assert _ttft_ms(ServerSettings(), 1000) == pytest.approx(one_step)
    # long_prefill_token_threshold 256: chunks of 256, 256, 256, 232, the same pairs in all
    capped = ServerSettings(long_prefill_token_threshold=256)
    assert _ttft_ms(capped, 1000) == pytest.approx(one_step + 3 * (10.0 + 0.2))
    # a budget below the cap chunks by the budget
    small = ServerSettings(max_num_batched_tokens=200, long_prefill_token_threshold=256)
    assert _ttft_ms(small, 1000) == pytest.approx(one_step + 4 * (10.0 + 0.2))


def test_the_adaptive_target_is_the_fleets_setting_or_the_tightest_class() -> None:
    wl = Workload.single(512, 16, 2000, 100)
    reqs = _one_prompt(512)

    def target(settings: ServerSettings) -> float:
        base = Fleet(pools=[{"role": "colocated", "count": 1}], server=settings)
        sim = Simulation(MODEL, parse_fleet("1C:H100/adaptive", base), wl, reqs, ACCELERATORS,
                         get_link("NVLink4"))  # fmt: skip
        return sim.servers[0].policy.settings.target_itl_ms

    assert target(ServerSettings()) == 100
    assert target(ServerSettings(adaptive_target_itl_ms=60)) == 60


def test_the_adaptive_budget_aligns_to_the_servers_block() -> None:
    """vLLM's CPU block is 128 tokens: the simulated policy aligns to it as the served one does
    (and the per-request rule counts whole blocks of it); a fleet's adaptive_min_chunk is the
    policy's min_chunk (a fixed floor)."""
    wl = Workload.single(512, 16, 2000, 100)
    for block in (16, 128):
        base = Fleet(pools=[{"role": "colocated", "count": 1}],
                     server=ServerSettings(block_size=block))  # fmt: skip
        sim = Simulation(MODEL, parse_fleet("1C:H100/adaptive", base), wl, _one_prompt(512),
                         ACCELERATORS, get_link("NVLink4"))  # fmt: skip
        assert sim.servers[0].policy.bounds.alignment == block
        pd = parse_fleet("1P:H100,1D:H100/adaptive,per-request", base)
        sim = Simulation(MODEL, pd, wl, _one_prompt(512), ACCELERATORS, get_link("NVLink4"))
        assert sim.decider.settings.block_tokens == block
    fixed = Fleet(pools=[{"role": "colocated", "count": 1}],
                  server=ServerSettings(block_size=128, adaptive_min_chunk=256))  # fmt: skip
    sim = Simulation(MODEL, parse_fleet("1C:H100/adaptive", fixed), wl, _one_prompt(512),
                     ACCELERATORS, get_link("NVLink4"))  # fmt: skip
    bounds = sim.servers[0].policy.bounds
    assert (bounds.min_chunk, bounds.floor_from_target) == (256, False)


def test_a_calibration_file_carries_its_step_model(tmp_path: Path) -> None:
    acc = {"name": "calibrated", "bf16_flops": 1.4e11, "mem_bytes_per_s": 2.6e10,
           "mem_bytes": 2.4e10}  # fmt: skip
    cal = {
        "accelerator": acc,
        "layer": {"dtype": "float32"},
        "step_model": {**SM.model_dump(), "notes": ["n"], "points": [{"kind": "decode"}]},
    }
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"calibration": cal}))
    assert load_calibration(path).step_model == SM

    del cal["step_model"]["intercept_ms"]
    path.write_text(json.dumps(cal))
    with pytest.raises(PlannerInputError, match="intercept_ms"):
        load_calibration(path)
    cal["step_model"] = {**SM.model_dump(), "ms_per_1k_tokens": -1}
    path.write_text(json.dumps(cal))
    with pytest.raises(PlannerInputError, match="ms_per_1k_tokens"):
        load_calibration(path)


@pytest.fixture(scope="module")
def calibrate_engine():
    spec = importlib.util.spec_from_file_location("bench_calibrate_engine", CAL_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_calibrate_engine"] = module
    spec.loader.exec_module(module)
    return module


def test_the_calibration_fit_recovers_a_known_step_model(calibrate_engine) -> None:
    """The script's fit, fed steps of the three kinds it times with 2% noise."""
    rng = random.Random(3)
    points = []
    for kind, tokens, seqs, pairs in (
        [("prefill", n, 1, chunk_attention_pairs(0, n)) for n in (32, 512, 2048, 4000)]
        + [("decode", k, k, k * 97) for k in (1, 4, 16, 32)]
        + [("mixed", k + n, k + 1, k * 150 + chunk_attention_pairs(0, n))
           for k, n in ((2, 256), (8, 1024), (16, 4000))]
    ):  # fmt: skip
        measured = SM.predict_ms(tokens, seqs, pairs) * (1 + rng.uniform(-0.02, 0.02)) / 1e3
        points.append(calibrate_engine.Point(kind, StepFeatures(tokens, seqs, pairs), measured))
    coef, rows = calibrate_engine.fit(points)
    for got, want in zip(coef, SM.coefficients(), strict=True):
        assert got == pytest.approx(want, rel=0.1, abs=1.0)
    assert all(abs(r["error"]) < 0.05 for r in rows) and len(rows) == len(points)


def test_the_slo_scale_is_the_reference_prefill_here_over_there(calibrate_engine) -> None:
    """goodput.py's SLO was set where its reference prompt prefilled in a stated time; the
    scale printed for --slo-scale is this machine's fitted time for it over that time."""
    tokens, seconds = calibrate_engine.gp.SLO_REFERENCE_PREFILL
    alone = StepFeatures(tokens, 1, chunk_attention_pairs(0, tokens))
    # one coefficient only (per 1k tokens), chosen so the reference takes twice its time
    coef = [0.0, 2 * seconds * 1e3 / alone.vector()[1], 0.0, 0.0]
    assert calibrate_engine.slo_scale(coef) == pytest.approx(2.0)


def test_p99_allowance_is_the_nearest_rank_rule() -> None:
    """Checked against goodput.py's own percentile on gaps with k slow ones."""
    from splitserve.planner.sim.metrics import p99_slow_allowed

    def goodput_p99(values: list[float]) -> float:
        s = sorted(values)
        return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]

    for n in (1, 2, 15, 63, 64, 100, 101, 150, 151, 255, 400):
        allowed = p99_slow_allowed(n)
        for slow in range(0, min(n, 6) + 1):
            gaps = [0.01] * (n - slow) + [1.0] * slow
            assert (goodput_p99(gaps) <= 0.1) == (slow <= allowed), (n, slow)


def _chat_beside_a_document(metric: str, budget: int) -> float:
    """A 101-token chat decoding (100 gaps, one may be slow under p99) when a 2000-token
    document arrives: one stall with a 4096 budget, two with 1024."""
    from splitserve.planner.sim.workload import RequestClass

    wl = Workload(
        classes=[
            RequestClass(name="chat", share=1, prompt_min=32, prompt_max=32, output_min=101,
                         output_max=101, ttft_ms=60_000, itl_ms=100),
            RequestClass(name="doc", share=1, prompt_min=2000, prompt_max=2000, output_min=2,
                         output_max=2, ttft_ms=60_000, itl_ms=100),
        ],
        itl_metric=metric,
    )  # fmt: skip
    reqs = Requests([0.0, 0.3], [32, 2000], [101, 2], [0, 1], [-1, -1], [0, 0])
    settings = ServerSettings(max_num_batched_tokens=budget)
    base = Fleet(pools=[{"role": "colocated", "count": 1}], server=settings)
    sim = Simulation(MODEL, parse_fleet("1C:H100", base), wl, reqs, ACCELERATORS,
                     get_link("NVLink4"), step_models={"H100": SM})  # fmt: skip
    return sim.run().per_class[0]["attainment"]


@pytest.mark.parametrize(
    "metric,budget,chat_meets",
    [("p99", 4096, 1.0), ("p99", 1024, 0.0), ("max", 4096, 0.0), ("mean", 4096, 1.0)],
)
def test_p99_metric_forgives_the_slow_gaps_the_percentile_does(metric, budget, chat_meets):
    assert _chat_beside_a_document(metric, budget) == chat_meets
