"""Servers started ahead, while tests that leave CPU idle run: how the first integration
modules start theirs (each module's fixture calls its starter here; the others are in
sglang_servers.py, splitserve_servers.py, fault_fleet.py and lmcache_fleet.py), and ``AHEAD``,
the schedule that the pool's start-ahead (``ServerPool.start_ahead``, tests/server_pool.py)
follows. Both must start a key the same way: the pool hands whoever asks second the server the
first one started.

A starter adds its servers to the pool without waiting (``wait=False``) and returns their keys;
whoever needs them waits (``servers.wait_all``). A server started ahead is never evicted before
its module claims it, so a window's servers run beside the running module's for a while
(docs/environment.md, "Test harness", has the memory this takes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fault_fleet
import lmcache_fleet
import sglang_servers
import splitserve_servers
from module_order import LIGHT_MODULES

from splitserve.netutil import free_ports

UNIFIED = "unified"  # the plain server: test_smoke_vllm, test_adaptive_scheduler's reference
ADAPTIVE = "adaptive-scheduler"
NIXL_P, NIXL_D = "vllm-nixl-p", "vllm-nixl-d"

SCHEDULER_CLS = "splitserve.schedulers.vllm.AdaptiveChunkScheduler"
# test_adaptive_scheduler.py's settings (its docstring says why each is so).
ADAPTIVE_SETTINGS = {
    "splitserve_scheduler": {
        "target_itl_ms": 0.001,
        "log_interval_s": 5,
        "share_prefill": True,
        "share_always": True,  # the two long prompts are alike: shared in either order
    }
}
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
# NixlConnector's NIXL progress thread holds a core even while idle: lower priority, so that the
# pair does not starve the servers starting beside it (docs/environment.md).
NIXL_SPINNER_NICE = 10


def unified(servers: Any, model: Path, tmp_path_factory: Any) -> list[str]:
    """The plain server (no connector, vLLM's default scheduler)."""
    servers.vllm(UNIFIED, model, wait=False)
    return [UNIFIED]


def adaptive_scheduler(servers: Any, model: Path, tmp_path_factory: Any) -> list[str]:
    """``AdaptiveChunkScheduler`` with ``PROMETHEUS_MULTIPROC_DIR`` set, so that the metrics it
    writes in the engine-core process appear on the API server's ``/metrics``."""
    servers.vllm(
        ADAPTIVE,
        model,
        extra_args=[
            "--scheduler-cls",
            SCHEDULER_CLS,
            "--additional-config",
            json.dumps(ADAPTIVE_SETTINGS),
            "--no-enable-prefix-caching",
        ],
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path_factory.mktemp("prometheus-multiproc"))},
        wait=False,
    )
    return [ADAPTIVE]


def stock_nixl_pair(servers: Any, model: Path, tmp_path_factory: Any) -> list[str]:
    """(P, D): stock vLLM with ``NixlConnector`` on host memory, one core each, niced."""
    side_ports = free_ports(2)
    for key, core, side in ((NIXL_P, 0, side_ports[0]), (NIXL_D, 1, side_ports[1])):
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
        }
        servers.vllm(
            key,
            model,
            kv_transfer_config=NIXL,
            env=env,
            cpu_core=core,
            wait=False,
            nice=NIXL_SPINNER_NICE,
        )
    return [NIXL_P, NIXL_D]


Starter = Callable[[Any, Path, Any], list[str]]

UNIT = "unit"  # the unit tests (tests/unit): one core busy, no server


@dataclass(frozen=True)
class Ahead:
    """Start ``start`` (one starter at a time) for ``module`` while ``during`` runs: the unit
    tests (``UNIT``) or earlier modules (the first of them in the session that runs before
    ``module`` is when it begins)."""

    module: str
    during: tuple[str, ...]
    start: tuple[Starter, ...]


# Each window is a stretch of the suite that leaves CPU idle (measured with a /proc/stat
# sampler beside a whole run: docs/environment.md, "Suite time"); the servers started in it
# are those its next modules would otherwise wait for. Servers start ahead at the lowest
# priority (tests/server_pool.py, ``AHEAD_NICE``), so a window may be any module, timed faults
# included.
AHEAD = (
    Ahead("test_smoke_vllm.py", (UNIT,), (unified,)),
    Ahead("test_adaptive_scheduler.py", (UNIT,), (adaptive_scheduler, unified)),
    # test_proxy_vllm's kill victim is ``unified``, started above.
    Ahead("test_proxy_vllm.py", (UNIT,), (stock_nixl_pair,)),
    # Not the splitserve pair: no window before test_connector_vllm leaves it a core. Queued
    # after these, it started during test_proxy_vllm, whose stock pair keeps both cores busy
    # at nice 10, against which a session at 19 still gets a share (scheduler weights 15
    # against 110): that module took 23 s longer, test_connector_vllm 24 s less.
    Ahead("test_proxy_decide.py", ("test_connector_vllm.py",), (splitserve_servers.start_third,)),
    Ahead(
        "test_sglang_pd.py",
        ("test_control_plane.py", *LIGHT_MODULES),
        (sglang_servers.start_prefill, sglang_servers.start_decode, sglang_servers.start_single),
    ),
    # The failure tests wait out leases and timeouts on the SGLang pair.
    Ahead("test_sglang_server.py", ("test_sglang_failures.py",), (sglang_servers.start_adaptive,)),
    # test_up's deployment is its own (``splitserve up``), started and stopped by the test.
    Ahead("test_fault_matrix.py", ("test_up.py",), (fault_fleet.start,)),
    # The fault matrix waits out leases, freezes and restarts.
    Ahead(
        "test_lmcache.py",
        ("test_fault_matrix.py",),
        (lmcache_fleet.start_tier, lmcache_fleet.start_servers),
    ),
)


@dataclass
class Plan:
    """``triggers``: per module that opens a window (``UNIT`` for the unit tests), the
    (module, starters) to start ahead when it begins, in order, each starter once.
    ``targets``: the modules whose servers start ahead (each claims them when it begins)."""

    triggers: dict[str, list[tuple[str, list[Starter]]]] = field(default_factory=dict)
    targets: set[str] = field(default_factory=set)


def plan(modules_in_order: list[str], unit_first: bool) -> Plan:
    """The start-ahead plan for a session: for every ``Ahead`` whose module is in the session
    and one of whose ``during`` runs before it (``modules_in_order``: the session's
    integration modules, in their order)."""
    result = Plan()
    for ahead in AHEAD:
        if ahead.module not in modules_in_order:
            continue
        before = modules_in_order[: modules_in_order.index(ahead.module)]
        if UNIT in ahead.during and unit_first:
            trigger = UNIT
        else:
            trigger = next((m for m in before if m in ahead.during), "")
        if not trigger:
            continue
        queued = result.triggers.setdefault(trigger, [])
        seen = {starter for _, starters in queued for starter in starters}
        starters = [starter for starter in ahead.start if starter not in seen]
        if starters:
            queued.append((ahead.module, starters))
            result.targets.add(ahead.module)
    return result
