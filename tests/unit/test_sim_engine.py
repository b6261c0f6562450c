"""The simulator's event engine: every request ends, KV stays within capacity, Little's law
holds, a seed fixes the run, and the project's own routing, budget and decider are called.

Pure unit tests of our own logic (no engine exists in a simulation); each run is a few thousand
requests on a handful of simulated servers.
"""

from __future__ import annotations

import pytest

from splitserve.planner.catalog import ACCELERATORS, Accelerator, custom_link, get_link, get_model
from splitserve.planner.roofline import weight_bytes_total
from splitserve.planner.sim import engine as sim_engine
from splitserve.planner.sim.engine import Simulation
from splitserve.planner.sim.fleet import Fleet, LinkSpec, parse_fleet
from splitserve.planner.sim.server import Server
from splitserve.planner.sim.workload import RequestClass, Workload, generate
from splitserve.proxy.decide import REASONS

MODEL = get_model("Llama-3.1-8B")
NVLINK = get_link("NVLink4")
BASE = Fleet(pools=[{"role": "colocated", "count": 1}])


def fleet(spec: str, **routing: object) -> Fleet:
    f = parse_fleet(spec, BASE)
    if routing:
        f = f.model_copy(update={"routing": f.routing.model_copy(update=routing)})
    return f


def small_memory_gpu() -> dict[str, Accelerator]:
    """An H100 with memory for the weights and about 15k tokens of KV: forces preemptions."""
    weights = weight_bytes_total(MODEL, 2)
    kv = 15_000 * 131072
    acc = ACCELERATORS["H100"].model_copy(
        update={"name": "small", "mem_bytes": (weights + kv) / 0.9}
    )
    return {**ACCELERATORS, "small": acc}


def run(f: Fleet, wl: Workload, rate: float, n: int, seed: int = 0, accs=None, link=NVLINK):
    sim = Simulation(
        MODEL, f, wl, generate(wl, rate, n, seed), accs or ACCELERATORS, link, seed=seed
    )
    return sim, sim.run()


def checked_end_step(monkeypatch) -> list[int]:
    """Wrap Server.end_step: after every step, KV within capacity and fully accounted for."""
    original = Server.end_step
    steps = [0]

    def end_step(self, now):
        original(self, now)
        steps[0] += 1
        if not self.busy:  # between steps: nothing reserved for a step in flight
            accounted = self.sum_ctx + sum(r.computed for r in self.prefilling) + self.held_tokens
            assert self.kv_used == accounted
        assert 0 <= self.kv_used <= self.kv_cap

    monkeypatch.setattr(Server, "end_step", end_step)
    return steps


WL = Workload.single(1024, 128, 2000, 100)
MIXED = Workload(
    classes=[
        RequestClass(name="chat", share=3, prompt_min=32, prompt_max=512, output_min=16,
                     output_max=256, ttft_ms=500, itl_ms=60),
        RequestClass(name="doc", share=1, prompt_min=1500, prompt_max=6000, output_min=16,
                     output_max=64, ttft_ms=3000, itl_ms=60, prefix_tokens=1000, prefix_groups=5),
    ]
)  # fmt: skip


@pytest.mark.parametrize(
    "spec,routing",
    [
        ("3C:small", {}),
        ("3C:small/adaptive", {}),
        ("3C:small/no-chunked-prefill", {}),
        ("1P:small,2D:small/no-chunked-prefill,per-request", {}),
        ("1P:small,2D:small", {}),
        ("1P:small,2D:small/adaptive,per-request", {}),
        ("1P:small,2D:small/first-token-from-prefill,prefix,bulk", {}),
    ],
)
def test_every_request_ends_and_kv_stays_within_capacity(monkeypatch, spec, routing):
    steps = checked_end_step(monkeypatch)
    sim, res = run(fleet(spec, **routing), MIXED, 60.0, 1500, accs=small_memory_gpu())
    assert steps[0] > 0
    assert sim.finished == 1500 and sim.in_system == 0
    assert sum(c["requests"] for c in res.per_class) == 1500
    assert res.preemptions > 0  # the memory was tight enough to matter
    for s in sim.servers:
        assert not s.busy and s.kv_used == 0 and s.held_tokens == 0
        assert s.peak_kv <= s.kv_cap
        assert s.backend.outstanding == 0


def test_oversized_requests_are_rejected_not_lost():
    wl = Workload.single(60_000, 10, 2000, 100)  # more KV than the small GPU holds
    sim, res = run(fleet("2C:small"), wl, 5.0, 50, accs=small_memory_gpu())
    assert sim.finished == 50
    assert res.per_class[0]["rejected"] == 50 and res.attainment == 0


@pytest.mark.parametrize("spec", ["4C:H100", "2P:H100,3D:H100"])
def test_littles_law_on_a_steady_run(spec):
    _, res = run(fleet(spec), WL, 30.0, 6000)
    assert res.attainment > 0.99  # steady: no queue growing
    assert res.mean_in_system == pytest.approx(res.rate * res.mean_latency_s, rel=0.02)


def test_same_seed_same_run_other_seed_other_run():
    f = fleet("1P:H100,2D:H100/adaptive,per-request", decode="power_of_two")

    def summary(seed):
        d = run(f, MIXED, 40.0, 800, seed=seed)[1].to_dict()
        d.pop("wall_s")
        return d

    assert summary(3) == summary(3)
    assert summary(3) != summary(4)


def test_adaptive_budget_is_the_schedulers_policy():
    sim, _ = run(fleet("2C:H100/adaptive"), MIXED, 40.0, 800)
    for s in sim.servers:
        assert s.policy is not None and s.policy.model.samples_seen > 0


def test_per_request_rule_is_the_proxys_and_sends_short_prompts_to_decode():
    _, res = run(fleet("1P:H100,2D:H100/per-request"), MIXED, 20.0, 800)
    assert set(res.decisions) <= set(REASONS)  # splitserve.proxy.decide's reasons
    assert res.decisions.get("short", 0) > 0
    assert res.decisions.get("long", 0) + res.decisions.get("prefix_on_decode", 0) > 0


def test_prefix_affinity_keeps_a_head_on_one_prefill_server():
    sim, _ = run(fleet("4P:H100,2D:H100/prefix"), MIXED, 20.0, 800)
    holders = {}
    for s in sim.servers:
        if s.role == "prefill":
            for prefix in s.prefix_cache:
                holders.setdefault(prefix, []).append(s.sid)
    assert holders and all(len(v) == 1 for v in holders.values())


def test_layerwise_handoff_hides_what_bulk_exposes():
    # 20 GB/s: a 1024-token prompt's KV (134 MB) takes 6.7 ms in bulk; a layer's slice 0.2 ms,
    # less than a layer's prefill (~0.5 ms), so streaming exposes only the last slice
    slow = custom_link(20.0)
    wl = Workload.single(1024, 16, 2000, 100)
    ttft = {}
    for mode in ("bulk", "layerwise"):
        f = fleet("1P:H100,1D:H100").model_copy(update={"link": LinkSpec(mode=mode)})
        ttft[mode] = run(f, wl, 2.0, 200, link=slow)[1].per_class[0]["ttft_ms"]["p50"]
    assert ttft["bulk"] - ttft["layerwise"] == pytest.approx(6.7 - 0.2, abs=0.5)


def test_unknown_pool_gpu_is_an_actionable_error():
    with pytest.raises(sim_engine.PlannerInputError, match="no accelerator figures"):
        Simulation(MODEL, fleet("1C:TPU"), WL, generate(WL, 1.0, 5), ACCELERATORS, NVLINK)
