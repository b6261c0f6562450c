"""The start-ahead schedule of the test harness (tests/integration/starters.py): which servers
start when which tests begin, for the modules a session holds. Our own harness logic, no
server started."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

import fault_fleet  # noqa: E402
import lmcache_fleet  # noqa: E402
import sglang_servers  # noqa: E402
import splitserve_servers  # noqa: E402
import starters  # noqa: E402
from module_order import INTEGRATION_ORDER, LIGHT_MODULES  # noqa: E402

FIRST_THREE = ["test_smoke_vllm.py", "test_adaptive_scheduler.py", "test_proxy_vllm.py"]
SGLANG_PD = [
    sglang_servers.start_prefill,
    sglang_servers.start_decode,
    sglang_servers.start_single,
]


def test_unit_tests_first_start_the_first_modules_servers_once_each_in_order():
    plan = starters.plan(FIRST_THREE, unit_first=True)
    assert plan.triggers == {
        starters.UNIT: [
            ("test_smoke_vllm.py", [starters.unified]),
            ("test_adaptive_scheduler.py", [starters.adaptive_scheduler]),
            ("test_proxy_vllm.py", [starters.stock_nixl_pair]),
        ]
    }
    assert plan.targets == set(FIRST_THREE)


def test_no_unit_tests_first_means_no_unit_window():
    plan = starters.plan(FIRST_THREE, unit_first=False)
    assert plan.triggers == {} and plan.targets == set()


def test_only_the_modules_in_the_session_are_started_for():
    plan = starters.plan(["test_adaptive_scheduler.py"], unit_first=True)
    assert plan.triggers == {
        starters.UNIT: [
            ("test_adaptive_scheduler.py", [starters.adaptive_scheduler, starters.unified])
        ]
    }


def test_the_sglang_servers_start_when_the_first_window_module_present_begins():
    plan = starters.plan(INTEGRATION_ORDER, unit_first=False)
    assert plan.triggers["test_control_plane.py"] == [("test_sglang_pd.py", SGLANG_PD)]
    without = [name for name in INTEGRATION_ORDER if name != "test_control_plane.py"]
    plan = starters.plan(without, unit_first=False)
    assert plan.triggers[LIGHT_MODULES[0]] == [("test_sglang_pd.py", SGLANG_PD)]
    assert "test_control_plane.py" not in plan.triggers


def test_no_window_module_before_the_sglang_modules_means_no_window():
    plan = starters.plan(["test_sglang_pd.py", *LIGHT_MODULES], unit_first=False)
    assert plan.triggers == {} and plan.targets == set()


def test_the_whole_suite_opens_a_window_for_each_module_that_waited_for_its_servers():
    plan = starters.plan(INTEGRATION_ORDER, unit_first=True)
    assert plan.triggers["test_connector_vllm.py"] == [
        ("test_proxy_decide.py", [splitserve_servers.start_third])
    ]
    assert plan.triggers["test_sglang_failures.py"] == [
        ("test_sglang_server.py", [sglang_servers.start_adaptive])
    ]
    assert plan.triggers["test_up.py"] == [("test_fault_matrix.py", [fault_fleet.start])]
    assert plan.triggers["test_fault_matrix.py"] == [
        ("test_lmcache.py", [lmcache_fleet.start_tier, lmcache_fleet.start_servers])
    ]
    assert plan.targets == {ahead.module for ahead in starters.AHEAD}


def test_every_window_runs_before_the_module_it_starts_for():
    for ahead in starters.AHEAD:
        for during in ahead.during:
            if during != starters.UNIT:
                assert INTEGRATION_ORDER.index(during) < INTEGRATION_ORDER.index(ahead.module)


def test_the_light_modules_run_right_before_the_sglang_pair_modules():
    first = INTEGRATION_ORDER.index(LIGHT_MODULES[0])
    assert INTEGRATION_ORDER[first : first + len(LIGHT_MODULES) + 1] == [
        *LIGHT_MODULES,
        "test_sglang_pd.py",
    ]
