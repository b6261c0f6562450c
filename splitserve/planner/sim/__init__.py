"""A fleet simulator behind ``splitserve simulate``: the planner's arithmetic, event by event.

Pure Python on one core, no engine import (importing it never imports vLLM, SGLang or torch).
Its parts are the project's own code where the project has it: step times from the planner's
roofline (or a calibration file), the handoff from the planner's formulas, routing from the
proxy's policies and hash ring, the prefill budget from the scheduler's ``BudgetPolicy``.
Modules, one job each:

- ``workload``: request classes, SLOs, arrivals (Poisson, bursty) and trace files;
- ``fleet``: pools (their roles), hardware per pool, engine settings, routing, link, prices;
- ``steptime``: the roofline step time, reduced to a few coefficients;
- ``request``: one request's record (``Req``), shared by the servers and the event loop;
- ``server``: one engine's scheduler (continuous batching, chunked prefill, KV, preemption);
- ``engine``: the event loop, routing, handoffs;
- ``decider``: the per-request disaggregation rule's interface;
- ``metrics``: attainment, percentiles, costs; ``search``: goodput and the cheapest fleet;
- ``plots`` / ``cli``: figures and the click command.

docs/planner.md ("Simulating a fleet") states the model and its simplifications.
"""

from splitserve.planner.sim.engine import Simulation
from splitserve.planner.sim.fleet import Fleet, PoolSpec, parse_fleet
from splitserve.planner.sim.metrics import RunResult
from splitserve.planner.sim.search import Context, cheapest, goodput
from splitserve.planner.sim.workload import RequestClass, Requests, Workload, generate

__all__ = [
    "Context",
    "Fleet",
    "PoolSpec",
    "RequestClass",
    "Requests",
    "RunResult",
    "Simulation",
    "Workload",
    "cheapest",
    "generate",
    "goodput",
    "parse_fleet",
]
