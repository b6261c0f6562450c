"""The start-ahead schedule of the test harness (tests/integration/starters.py): which servers
start when which tests begin, for the modules a session holds. Our own harness logic, no
server started."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

import sglang_servers  # noqa: E402
import starters  # noqa: E402
from module_order import INTEGRATION_ORDER, LIGHT_MODULES  # noqa: E402

FIRST_THREE = ["test_smoke_vllm.py", "test_adaptive_scheduler.py", "test_proxy_vllm.py"]


def test_unit_tests_first_start_the_first_modules_servers_once_each_in_order():
    plan = starters.plan(FIRST_THREE, unit_first=True)
    assert plan == {
        starters.UNIT: [starters.unified, starters.adaptive_scheduler, starters.stock_nixl_pair]
    }


def test_no_unit_tests_first_means_no_unit_window():
    assert starters.plan(FIRST_THREE, unit_first=False) == {}


def test_only_the_modules_in_the_session_are_started_for():
    plan = starters.plan(["test_adaptive_scheduler.py"], unit_first=True)
    assert plan == {starters.UNIT: [starters.adaptive_scheduler, starters.unified]}


def test_the_sglang_servers_start_when_the_first_light_module_present_begins():
    modules = [name for name in INTEGRATION_ORDER if name != LIGHT_MODULES[0]]
    plan = starters.plan(modules, unit_first=False)
    assert list(plan) == [LIGHT_MODULES[1]]
    assert plan[LIGHT_MODULES[1]] == [
        sglang_servers.start_prefill,
        sglang_servers.start_decode,
        sglang_servers.start_single,
    ]


def test_no_light_module_before_the_sglang_modules_means_no_window():
    assert starters.plan(["test_sglang_pd.py", *LIGHT_MODULES], unit_first=False) == {}


def test_the_light_modules_run_right_before_the_sglang_pair_modules():
    first = INTEGRATION_ORDER.index(LIGHT_MODULES[0])
    assert INTEGRATION_ORDER[first : first + len(LIGHT_MODULES) + 1] == [
        *LIGHT_MODULES,
        "test_sglang_pd.py",
    ]
