"""Questions answered by many simulations: capacity under an SLO, and the cheapest fleet.

Pure; runs in the simulating process, one simulation after another.

- **Goodput** (DistServe's): the highest request rate at which a configuration keeps at least
  ``target`` (default 90%) of requests within their SLO. Each rate's run draws at least
  ``requests`` requests and at least ``min_duration_s`` seconds of arrivals (same seed), so an
  overloaded fleet's queue has time to show; the rate is bracketed by doubling, then bisected
  to ``tolerance``.
- **Cheapest fleet**: for each layout (colocated on each GPU type, prefill on one type and
  decode on another), the fewest servers that meet the target at the given rate, priced per
  GPU-hour; colocated counts by doubling then bisection, disaggregated counts by finding the
  decode count with prefill unconstrained, the prefill count with decode unconstrained, then
  the decode count for each prefill count from there up to ``extra_prefill`` more. The answer
  is the cheapest, the runner-up, and why the runner-up lost.

Invariant: attainment is treated as monotone in rate and in server counts; where randomness
breaks that at the margin, the answer is off by at most the bisection's last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.planner.calibration_file import EngineStepModel
from splitserve.planner.catalog import Accelerator, Link, ModelShape
from splitserve.planner.sim.engine import Simulation
from splitserve.planner.sim.fleet import Fleet, PoolSpec
from splitserve.planner.sim.metrics import RunResult
from splitserve.planner.sim.workload import Requests, Workload, generate

MAX_SERVERS = 512
MAX_REQUESTS = 1_000_000


@dataclass
class Context:
    """Everything a simulation needs besides the fleet and the rate."""

    model: ModelShape
    workload: Workload
    accelerators: Mapping[str, Accelerator]
    link: Link
    requests: int = 2000
    seed: int = 0
    trace: Requests | None = None  # replayed (time-scaled) instead of drawing arrivals
    runs: int = 0
    min_duration_s: float = 30.0
    step_models: Mapping[str, EngineStepModel] = field(default_factory=dict)

    def requests_at(self, rate: float) -> Requests:
        """The requests at ``rate``: a trace time-scaled to it, else a fresh draw of at least
        ``requests`` requests lasting at least ``min_duration_s`` (a short run would hide a
        queue that grows without bound behind the SLO's slack)."""
        if self.trace is not None:
            own = (len(self.trace) - 1) / max(self.trace.duration_s, 1e-9)
            return self.trace.scaled(rate / own)
        count = min(MAX_REQUESTS, max(self.requests, math.ceil(rate * self.min_duration_s)))
        return generate(self.workload, rate, count, self.seed)

    def simulate(self, fleet: Fleet, rate: float) -> RunResult:
        self.runs += 1
        reqs = self.requests_at(rate)
        sim = Simulation(
            self.model, fleet, self.workload, reqs, self.accelerators, self.link,
            seed=self.seed, step_models=self.step_models,
        )  # fmt: skip
        return sim.run()


def goodput(
    ctx: Context,
    fleet: Fleet,
    target: float = 0.9,
    tolerance: float = 0.02,
    start_rate: float = 1.0,
) -> tuple[float, list[RunResult]]:
    """Highest rate with attainment >= ``target`` (0 if even ``start_rate / 1024`` misses)."""
    runs: list[RunResult] = []

    def ok(rate: float) -> bool:
        res = ctx.simulate(fleet, rate)
        runs.append(res)
        return res.attainment >= target

    lo, hi = 0.0, start_rate
    if ok(hi):
        lo = hi
        hi *= 2
        while ok(hi):
            lo, hi = hi, hi * 2
    else:
        while hi > start_rate / 1024:
            hi /= 2
            if ok(hi):
                lo, hi = hi, hi * 2
                break
        else:
            return 0.0, runs
    while hi - lo > tolerance * lo:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, sorted(runs, key=lambda r: r.rate)


def min_count(pred: Callable[[int], bool], lo: int = 1, cap: int = MAX_SERVERS) -> int | None:
    """Smallest ``n >= lo`` with ``pred(n)`` (monotone), by doubling then bisection."""
    if pred(lo):
        return lo
    good = None
    n = lo
    while n < cap:
        n = min(cap, n * 2)
        if pred(n):
            good = n
            break
        lo = n
    if good is None:
        return None
    while good - lo > 1:
        mid = (lo + good) // 2
        if pred(mid):
            good = mid
        else:
            lo = mid
    return good


@dataclass
class Candidate:
    layout: str
    fleet: Fleet | None
    cost_per_hour: float
    result: RunResult | None
    why: str = ""


@dataclass
class SearchAnswer:
    rate: float
    target: float
    best: Candidate | None
    runner_up: Candidate | None
    why_runner_up: str
    candidates: list[Candidate] = field(default_factory=list)
    simulations: int = 0

    def to_dict(self) -> dict[str, Any]:
        def cand(c: Candidate | None) -> dict[str, Any] | None:
            if c is None:
                return None
            return {
                "layout": c.layout,
                "fleet": c.fleet.label() if c.fleet else None,
                "gpus": c.fleet.gpu_count() if c.fleet else None,
                "cost_per_hour": c.cost_per_hour if math.isfinite(c.cost_per_hour) else None,
                "attainment": c.result.attainment if c.result else None,
                "cost_per_million_tokens": c.result.cost_per_million_tokens if c.result else None,
                "why": c.why,
            }

        return {
            "rate": self.rate,
            "target": self.target,
            "best": cand(self.best),
            "runner_up": cand(self.runner_up),
            "why_runner_up": self.why_runner_up,
            "candidates": [cand(c) for c in self.candidates],
            "simulations": self.simulations,
        }


def cheapest(
    ctx: Context,
    base: Fleet,
    rate: float,
    gpus: list[str],
    target: float = 0.9,
    layouts: tuple[str, ...] = ("colocated", "disaggregated"),
    extra_prefill: int = 3,
) -> SearchAnswer:
    """The cheapest fleet meeting ``target`` attainment at ``rate`` (see module docstring).
    ``base`` gives the engine settings, routing, link and prices; its pools are replaced."""
    start_runs = ctx.runs
    results: dict[tuple[Any, ...], RunResult] = {}

    def fleet_of(pools: list[PoolSpec]) -> Fleet:
        return base.model_copy(update={"pools": pools})

    def meets(pools: list[PoolSpec]) -> bool:
        key = tuple((p.role, p.count, p.gpu) for p in pools)
        if key not in results:
            results[key] = ctx.simulate(fleet_of(pools), rate)
        return results[key].attainment >= target

    template = {p.role: p for p in base.pools}
    candidates: list[Candidate] = []

    def pool(role: str, count: int, gpu: str) -> PoolSpec:
        like = template.get(role) or template.get("colocated") or PoolSpec(role=role, count=1)
        return like.model_copy(update={"role": role, "count": count, "gpu": gpu})

    if "colocated" in layouts:
        for g in gpus:
            n = min_count(lambda k, g=g: meets([pool("colocated", k, g)]))
            if n is None:
                candidates.append(
                    Candidate(
                        f"colocated {g}",
                        None,
                        math.inf,
                        None,
                        f"no count up to {MAX_SERVERS} meets the target",
                    )
                )
                continue
            pools = [pool("colocated", n, g)]
            f = fleet_of(pools)
            candidates.append(
                Candidate(f"colocated {g}", f, f.cost_per_hour(), results[_key(pools)])
            )
    if "disaggregated" in layouts:
        for pg in gpus:
            for dg in gpus:
                candidates.append(
                    _cheapest_split(meets, pool, fleet_of, results, pg, dg, extra_prefill)
                )
    feasible = sorted(
        (c for c in candidates if c.fleet),
        key=lambda c: (c.cost_per_hour, -_attainment(c), c.fleet.gpu_count()),  # type: ignore[union-attr]
    )
    best = feasible[0] if feasible else None
    runner = feasible[1] if len(feasible) > 1 else None
    why = _why(best, runner) if best and runner else ""
    return SearchAnswer(rate, target, best, runner, why, candidates, ctx.runs - start_runs)


def _attainment(c: Candidate) -> float:
    return c.result.attainment if c.result else 0.0


def _why(best: Candidate, runner: Candidate) -> str:
    """Why the runner-up lost: its price, else its attainment, else its GPU count."""
    assert best.fleet is not None and runner.fleet is not None
    head = f"{runner.fleet.label()} also meets the target but"
    if runner.cost_per_hour > best.cost_per_hour:
        extra = runner.cost_per_hour / best.cost_per_hour - 1
        return (
            f"{head} costs ${runner.cost_per_hour:.2f}/h against "
            f"${best.cost_per_hour:.2f}/h ({extra:+.0%})"
        )
    if _attainment(runner) < _attainment(best):
        return (
            f"{head} at the same cost keeps {_attainment(runner):.1%} of requests within the "
            f"SLO against {_attainment(best):.1%}"
        )
    if runner.fleet.gpu_count() > best.fleet.gpu_count():
        return f"{head} at the same cost and attainment needs {runner.fleet.gpu_count()} GPUs"
    simpler = " (colocated: no KV transfer to run)" if best.layout.startswith("colocated") else ""
    return f"{head} ties on cost, attainment and GPUs; the first is preferred{simpler}"


def _key(pools: list[PoolSpec]) -> tuple[Any, ...]:
    return tuple((p.role, p.count, p.gpu) for p in pools)


def _cheapest_split(
    meets: Callable[[list[PoolSpec]], bool],
    pool: Callable[[str, int, str], PoolSpec],
    fleet_of: Callable[[list[PoolSpec]], Fleet],
    results: dict[tuple[Any, ...], RunResult],
    pg: str,
    dg: str,
    extra_prefill: int,
) -> Candidate:
    layout = f"prefill {pg} + decode {dg}"
    big = MAX_SERVERS // 4
    nd0 = min_count(lambda k: meets([pool("prefill", big, pg), pool("decode", k, dg)]))
    if nd0 is None:
        return Candidate(layout, None, math.inf, None, "no decode count meets the ITL target")
    roomy = max(4, 2 * nd0)
    np0 = min_count(lambda k: meets([pool("prefill", k, pg), pool("decode", roomy, dg)]))
    if np0 is None:
        return Candidate(layout, None, math.inf, None, "no prefill count meets the TTFT target")
    best: Candidate | None = None
    for np_ in range(np0, np0 + extra_prefill + 1):
        nd = min_count(
            lambda k, np_=np_: meets([pool("prefill", np_, pg), pool("decode", k, dg)]), lo=nd0
        )
        if nd is None:
            continue
        pools = [pool("prefill", np_, pg), pool("decode", nd, dg)]
        f = fleet_of(pools)
        c = Candidate(layout, f, f.cost_per_hour(), results[_key(pools)])
        if best is None or c.cost_per_hour < best.cost_per_hour:
            best = c
    if best is None:
        return Candidate(layout, None, math.inf, None, "no split meets both targets")
    return best
