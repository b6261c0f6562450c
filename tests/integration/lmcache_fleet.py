"""How test_lmcache.py's servers start (its docstring says what each is for), in a module of
their own so that the pool's start-ahead (tests/integration/starters.py) starts them the same
way while the module before it runs: LMCache's own cache server (the remote tier), then P1 and
P2 (``MultiConnector``: LMCache, then ours) and D (ours alone). Each starter adds its servers
to the session's group without waiting and returns their keys; the servers need the tier's
port, so the tier is started, and waited for, first."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cpu_placement import UNPINNED
from session_keys import key_env
from session_keys import test_key_file as key_file

from splitserve.connectors.lmcache.settings import LMCacheSettings, composed_kv_config
from splitserve.netutil import free_port, free_ports

TIER = "lmc-tier"
P1, P2, D = "lmc-p1", "lmc-p2", "lmc-d"
CHUNK = 256  # LMCache's chunk: it stores and loads whole chunks of this many tokens
ARGS = ["--max-model-len", "2048", "--max-num-batched-tokens", "512"]


def lmcache_env(remote_port: int) -> dict[str, str]:
    """LMCache's settings for a P: local CPU tier and the shared LMCache server."""
    settings = LMCacheSettings(chunk_size=CHUNK, remote={"port": remote_port, "start": False})
    return settings.env()


def splitserve_config(side_port: int) -> dict:
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "side_channel_port": side_port,
            "auth_key_file": key_file(),
            "lease_s": 20,
            "done_timeout_s": 300,
        },
    }


def multi_config(side_port: int) -> dict:
    return composed_kv_config(splitserve_config(side_port))


def start_tier(servers: Any, model: Path, tmp_path_factory: Any = None) -> list[str]:
    """LMCache's cache server (plain TCP: ready once its port listens), at LMCache's debug
    log level, whose log counts the chunks put into it (test_lmcache's ``PUT_MARK``)."""
    if TIER not in servers.group.servers:
        port = free_port()
        argv = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]
        env = {"LMCACHE_LOG_LEVEL": "DEBUG"}
        servers.group.add(TIER, argv, port=port, env=env, ready_path=None)
    return [TIER]


def start_servers(servers: Any, model: Path, tmp_path_factory: Any = None) -> list[str]:
    """P1 and P2, one core each, and D, not pinned: pinned beside P1, the two engines' OpenMP
    threads shared one core and a handoff outlived P1's 20 s lease (docs/connector-protocol.md).
    The tier (``start_tier``) must be in the group."""
    remote_port = servers.group.servers[TIER].port
    p1_side, p2_side, d_side = free_ports(3)
    env = {**key_env(), **lmcache_env(remote_port)}
    for key, core, side in ((P1, 0, p1_side), (P2, 1, p2_side)):
        servers.vllm(
            key,
            model,
            kv_transfer_config=multi_config(side),
            extra_args=ARGS,
            cpu_core=core,
            env=env,
            wait=False,
        )
    servers.vllm(
        D,
        model,
        kv_transfer_config=splitserve_config(d_side),
        # Without its own prefix cache D cannot serve the shared document from the first
        # request's blocks: all of P2's KV, LMCache's prefix included, must reach it.
        extra_args=[*ARGS, "--no-enable-prefix-caching"],
        cpu_core=None,
        env={**key_env(), **UNPINNED},
        wait=False,
    )
    return [P1, P2, D]
