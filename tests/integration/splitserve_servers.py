"""How the session's shared vLLM servers with ``SplitserveConnector`` start, in one place: the
pair ``ss-a`` / ``ss-b`` (the connector and proxy modules) and ``ss-c``, a third server deployed
as ``splitserve up`` deploys D. Used by the fixtures in tests/integration/conftest.py and by the
pool's start-ahead (tests/integration/starters.py), which must start a key the same way.

A starter adds its servers to the session's pool without waiting and returns their keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpu_placement import UNPINNED
from session_keys import TEST_KEY, test_key_file

from splitserve.launch.engines import SPLITSERVE_GUARD
from splitserve.netutil import free_ports

PAIR = ("ss-a", "ss-b")
THIRD = "ss-c"


@dataclass(frozen=True)
class SplitservePair:
    """Two vLLM servers with ``SplitserveConnector`` (``kv_both``), keys ``ss-a`` / ``ss-b``, each
    on its own core; either can prefill for the other. ``pair[key]`` is ``(url, side_port)``."""

    servers: dict[str, tuple[str, int]] = field(default_factory=dict)
    auth_key: str = TEST_KEY
    budget: int = 512  # --max-num-batched-tokens

    def __getitem__(self, key: str) -> tuple[str, int]:
        return self.servers[key]

    @property
    def extra_args(self) -> list[str]:
        return ["--max-model-len", "2048", "--max-num-batched-tokens", str(self.budget)]

    @property
    def key_file(self) -> str:
        """The shared key as the connector reads it: a 0600 file (never the command line)."""
        return test_key_file(self.auth_key)

    def kv_config(self, side_port: int) -> dict:
        """The pair's ``--kv-transfer-config`` (also for a third server that joins it)."""
        return {
            "kv_connector": "SplitserveConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "side_channel_port": side_port,
                "auth_key_file": self.key_file,
                "lease_s": 20,
                "done_timeout_s": 300,  # generous: other work shares these 2 cores
            },
        }


def start_pair(servers: Any, model: Path, tmp_path_factory: Any = None) -> list[str]:
    """``ss-a`` and ``ss-b``, those not running yet, one core each. Whoever starts them chooses
    the side ports, so they are read back from the servers' command lines
    (``servers.side_port``)."""
    pair = SplitservePair()
    for core, (key, side_port) in enumerate(zip(PAIR, free_ports(2), strict=True)):
        if key not in servers.group.servers:
            servers.vllm(
                key,
                model,
                kv_transfer_config=pair.kv_config(side_port),
                extra_args=pair.extra_args,
                cpu_core=core,
                wait=False,
            )
    return list(PAIR)


# ss-c's adaptive budget (test_proxy_decide reads it on ss-c's /metrics): a 1 us ITL target is
# unreachable (1 ms was not, on a CI run), so the budget is exactly the pair's
# --max-num-batched-tokens on a step without decodes and THIRD_MIN_CHUNK on a step with
# decodes, a fact of the workload and not of timing (test_adaptive_scheduler.py).
THIRD_MIN_CHUNK = 128
THIRD_SCHEDULER = {"splitserve_scheduler": {"target_itl_ms": 0.001, "min_chunk": THIRD_MIN_CHUNK}}
THIRD_MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings: D holds long streams


def start_third(servers: Any, model: Path, tmp_path_factory: Any) -> list[str]:
    """``ss-c``: ``AdaptiveChunkScheduler`` (``THIRD_SCHEDULER``), prefill side channels on
    127.0.0.1 only, the request guard (``--middleware``). ``PROMETHEUS_MULTIPROC_DIR`` puts the
    scheduler's metrics (EngineCore) on the server's own ``/metrics``. Unpinned with one OpenMP
    thread (cpu_placement.py): pinned beside ss-a, the two engines share a core and P's side
    channel misses its handshake bounds."""
    if THIRD in servers.group.servers:
        servers.group.touch(THIRD)
        return [THIRD]
    pair = SplitservePair()
    kv = pair.kv_config(free_ports(1)[0])
    kv["kv_connector_extra_config"]["allowed_prefill_hosts"] = ["127.0.0.1"]
    extra_args = [
        *pair.extra_args,
        "--max-model-len",  # the later flag wins
        str(THIRD_MAX_MODEL_LEN),
        "--scheduler-cls",
        "splitserve.schedulers.vllm.AdaptiveChunkScheduler",
        "--additional-config",
        json.dumps(THIRD_SCHEDULER),
        "--middleware",
        SPLITSERVE_GUARD,
    ]
    prometheus_dir = tmp_path_factory.mktemp("ss-c-prometheus")
    servers.vllm(
        THIRD,
        model,
        kv_transfer_config=kv,
        extra_args=extra_args,
        cpu_core=None,
        env={**UNPINNED, "PROMETHEUS_MULTIPROC_DIR": str(prometheus_dir)},
        wait=False,
    )
    return [THIRD]
