"""How the first integration modules start their servers, in one place: each module's fixture
calls its starter here, and so does the pool's start-ahead (``ServerPool.start_ahead`` in
tests/conftest.py), which starts them while the unit tests run. Both must start a key the same
way: the pool hands whoever asks second the server the first one started.

A starter asks the pool for its servers without waiting (``wait=False``) and returns their keys;
the caller waits (``servers.wait_all``). ``AHEAD`` lists, per module in the session's order,
the starters worth running ahead: every server of those modules but the ones that module kills
first. They fill the pool (``MAX_RUNNING_SERVERS``, 4) and no more, so that none is evicted
before its module runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

# Per module, the starters run ahead of it. test_proxy_vllm's kill victim is ``unified``,
# already among them.
AHEAD: dict[str, list[Starter]] = {
    "test_smoke_vllm.py": [unified],
    "test_adaptive_scheduler.py": [adaptive_scheduler, unified],
    "test_proxy_vllm.py": [stock_nixl_pair],
}
