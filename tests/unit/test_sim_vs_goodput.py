"""benchmarks/sim_vs_goodput.py on a synthetic goodput report (two contenders, two rates): the
table's structure, the points apart and the capacity-ratio arithmetic, each contender's fleet
read from goodput.py's own flags. The H100 roofline serves the tiny model at 1-2 req/s with
every request in its SLO, so the simulated side is known."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from splitserve.planner.catalog import ACCELERATORS, get_link

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_vs_goodput.py"


@pytest.fixture(scope="module")
def svg():
    spec = importlib.util.spec_from_file_location("bench_sim_vs_goodput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sim_vs_goodput"] = module
    spec.loader.exec_module(module)
    return module


def _row(contender: str, rate: float, attainment: float) -> dict:
    return {"contender": contender, "rate": rate, "attainment": attainment,
            "chat": {"attainment": attainment, "ttft_p90_s": 0.1},
            "doc": {"attainment": attainment, "ttft_p90_s": 0.5}}  # fmt: skip


REPORT = {
    "args": {"preset": "tiny", "duration": 10.0, "seed": 18, "rates": [1.0, 2.0]},
    "rows": [
        _row("colocated", 1.0, 0.95),
        _row("colocated", 2.0, 0.5),
        _row("pd-decide", 1.0, 1.0),
        _row("pd-decide", 2.0, 1.0),
    ],
}


def test_fleets_come_from_goodput_flags(svg) -> None:
    by_name = {c.name: c for c in svg.gp.CONTENDERS}
    assert svg.fleet_spec(by_name["colocated"], "H100")[:2] == ("2C:H100", svg.VLLM_CPU_BUDGET)
    spec, budget, lpt = svg.fleet_spec(by_name["colocated-lpt"], "H100")
    assert (spec, budget, lpt) == ("2C:H100", svg.gp.BUDGET, 256)
    assert svg.fleet_spec(by_name["pd-decide"], "c")[0] == (
        "1P:c,1D:c/adaptive,per-request,first-token-from-prefill"
    )


def test_capacity_ratio_and_points(svg) -> None:
    assert svg.capacity_ratio(2.0, 1.0) == 0.5 and svg.capacity_ratio(0, 0) == 1.0
    assert math.isinf(svg.capacity_ratio(0, 1.0))
    assert svg.points_apart(0.5, 0.62) == pytest.approx(12.0)


def test_comparison_table_and_json(svg, tmp_path: Path) -> None:
    res = svg.compare(REPORT, ACCELERATORS["H100"], get_link("NVLink4"), "H100")
    rows = {(r["contender"], r["rate"]): r for r in res["rows"]}
    assert set(rows) == {(c, r) for c in ("colocated", "pd-decide") for r in (1.0, 2.0)}
    assert all(r["simulated"] == 1.0 for r in rows.values())
    assert rows["colocated", 2.0]["points"] == pytest.approx(50.0)
    assert rows["colocated", 2.0]["miss"] and not rows["colocated", 1.0]["miss"]
    assert set(rows["pd-decide", 1.0]["per_class"]) == {"chat", "doc"}
    caps = {c["contender"]: c for c in res["capacity"]}
    assert (caps["colocated"]["measured"], caps["colocated"]["simulated"]) == (1.0, 2.0)
    assert caps["colocated"]["ratio"] == 2.0 and caps["colocated"]["miss"]
    assert caps["pd-decide"]["ratio"] == 1.0 and not caps["pd-decide"]["miss"]

    table = svg.markdown(res).splitlines()
    attain = [line for line in table if line.startswith("| colocated | `2C:H100`")]
    assert len(attain) == 2 and "| +50 **miss** | 0.10 / " in attain[1]
    assert "| colocated | 1 | 2^ | 2.00 **miss** |" in table
    assert "| pd-decide | 2^ | 2^ | 1.00 |" in table

    report = tmp_path / "goodput.json"
    report.write_text(json.dumps(REPORT))
    out = tmp_path / "cmp.json"
    assert svg.main(["--goodput", str(report), "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["rows"]) == 4


def test_the_simulated_proxy_sees_the_warm_up_prompts(svg) -> None:
    """goodput.py warms each proxy with WARM_PROMPTS; the long one goes through P and starts
    the per-request rule's queue estimate, so the simulated proxy is shown them too."""
    from splitserve.planner.sim.workload import Requests

    model = svg.get_model("splitserve-tiny")
    base = svg.Fleet(pools=[svg.PoolSpec(role="colocated", count=1, gpu="H100")])
    fleet = svg.parse_fleet("1P:H100,1D:H100/per-request", base)
    reqs = Requests([0.0], [100], [4], [0], [-1], [0])
    sim = svg.Simulation(model, fleet, svg.bench_workload(), reqs, ACCELERATORS,
                         get_link("NVLink4"))  # fmt: skip
    assert sim.decider.queue.mean_tokens == 0.0
    svg.warm_decider(sim)
    long_ones = [n for n in svg.gp.WARM_PROMPTS if n > sim.decider.settings.threshold_tokens]
    assert long_ones and sim.decider.queue.mean_tokens == long_ones[-1]
