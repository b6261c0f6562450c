"""How fast the fleet simulator runs: 1,000 servers and 1,000,000 requests on one core.

The target (issue #24): under a minute of wall time on one core for 1,000 servers serving
1,000,000 requests. The fleet is Llama-3.1-8B on H100s, half prefill and half decode servers
(power-of-two-choices routing on both pools, the proxy's own policy), Poisson arrivals of
1,024-token prompts and 256-token outputs at 30 requests/s per server (about 85% of what the
fleet can carry, where batches are large and the simulation does the most work per request).
The proxy's default routing, least-outstanding, scans every server per request (O(servers));
``--policies power_of_two,least_outstanding`` runs both side by side to show what that costs.

Prints, per contender: wall seconds (building the requests, building the fleet, simulating),
events, events per second, requests per wall second, its ratio to the 60 s target, and the
run's attainment; writes the same as JSON with ``--out``. ``--profile`` prints the top of a
cProfile of the simulation instead. Run it alone on a quiet machine (it is a timing):

    flock /tmp/splitserve-integration.lock python benchmarks/sim_scale.py --out runs/sim_scale.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import time
from pathlib import Path
from typing import Any

from splitserve.planner.catalog import ACCELERATORS, get_link, get_model
from splitserve.planner.sim.engine import Simulation
from splitserve.planner.sim.fleet import Fleet, PoolSpec, RoutingSpec
from splitserve.planner.sim.workload import Workload, generate

TARGET_S = 60.0


def run_scale(
    servers: int = 1000,
    requests: int = 1_000_000,
    rate_per_server: float = 30.0,
    policy: str = "power_of_two",
    seed: int = 0,
    profile: bool = False,
) -> dict[str, Any]:
    """Build and simulate the benchmark's fleet; the figures of one contender."""
    model = get_model("Llama-3.1-8B")
    workload = Workload.single(1024, 256, 2000, 50)
    half = servers // 2
    fleet = Fleet(
        pools=[PoolSpec(role="prefill", count=half), PoolSpec(role="decode", count=servers - half)],
        routing=RoutingSpec(prefill=policy, decode=policy),
    )
    t0 = time.perf_counter()
    reqs = generate(workload, rate_per_server * servers, requests, seed)
    t1 = time.perf_counter()
    sim = Simulation(model, fleet, workload, reqs, ACCELERATORS, get_link("NVLink4"), seed=seed)
    t2 = time.perf_counter()
    gc.disable()  # the loop allocates only short-lived tuples; a collection scans every Req
    try:
        if profile:
            prof = cProfile.Profile()
            result = prof.runcall(sim.run)
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        else:
            result = sim.run()
    finally:
        gc.enable()
    t3 = time.perf_counter()
    total = t3 - t0
    return {
        "servers": servers,
        "requests": requests,
        "policy": policy,
        "rate": rate_per_server * servers,
        "generate_s": t1 - t0,
        "build_s": t2 - t1,
        "simulate_s": t3 - t2,
        "total_s": total,
        "events": result.events,
        "events_per_s": result.events / (t3 - t2),
        "requests_per_s": requests / total,
        "vs_target": total / TARGET_S,
        "simulated_s": sim.t_end,
        "attainment": result.attainment,
        "finished": sim.finished,
        "ttft_p90_ms": result.per_class[0]["ttft_ms"]["p90"],
        "gap_p99_ms": result.gap_ms["p99"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--rate-per-server", type=float, default=30.0)
    ap.add_argument("--policies", default="power_of_two")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for policy in args.policies.split(","):
        row = run_scale(
            args.servers, args.requests, args.rate_per_server, policy, args.seed, args.profile
        )
        rows.append(row)
        print(
            f"{policy:<18} {row['servers']} servers, {row['requests']:,} requests: "
            f"{row['total_s']:.1f} s wall (generate {row['generate_s']:.1f}, build "
            f"{row['build_s']:.1f}, simulate {row['simulate_s']:.1f}); "
            f"{row['events']:,} events, {row['events_per_s']:,.0f} events/s, "
            f"{row['requests_per_s']:,.0f} requests/s; {row['vs_target']:.2f}x the 60 s target; "
            f"{row['simulated_s']:.0f} s simulated, attainment {row['attainment']:.1%}",
            flush=True,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
