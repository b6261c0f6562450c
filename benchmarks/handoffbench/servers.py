"""A P/D pair of vLLM servers per connector, and a splitserve proxy in front of a pair.

Each server's whole process tree is pinned to its own core, as if P and D were separate hosts
(``start_pair`` says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitserve.launch.group import ServerGroup
from splitserve.netutil import free_port_run, free_ports
from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

START_TIMEOUT = 900.0
# P with tensor parallelism on its one core: one OpenMP thread per rank, unbound (the tree is
# pinned to the core instead), and no lazy inductor compile of vLLM's TP embedding helper at
# the first forward (60-70 s holding the GIL: docs/connector-protocol.md, "Ranks").
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
# Two ranks and their gloo threads time-sharing one core stall for seconds (ibid.): the side
# channel's silent-peer bound is raised for TP pairs so that a stall is slow, not a failure.
TP_PEER_LIVENESS_S = 60


def splitserve_kv(
    side_channel_port: int, direction: str = "auto", tp_settings: dict | None = None
) -> dict:
    """``SplitserveConnector``'s config on a server whose side channel is on that port (rank r
    of a TP server on port + r); ``tp_settings``: the other side's size (``decode_tp_size`` on
    P, ``prefill_tp_size`` on D) and a side-channel liveness bound for TP on one core."""
    extra: dict[str, Any] = {
        "side_channel_port": side_channel_port,
        # Generous deadlines: a loaded machine must show up as slow, not as failed loads.
        "lease_s": 600,
        "done_timeout_s": 900,
        **(tp_settings or {}),
    }
    if direction != "auto":
        extra["direction"] = direction
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def nixl_kv(connector: str, role: str) -> dict:
    """Stock connector config. ``NixlPushConnector`` is one-way (P a producer, D a consumer),
    holds P's blocks for ``kv_lease_duration`` (prefill here takes up to a minute) and fails a
    D that no push reached within ``push_registration_timeout``."""
    if connector != "NixlPushConnector":
        return {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": connector,
        "kv_role": "kv_producer" if role == "p" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 600, "push_registration_timeout": 300},
    }


def nixl_push_available() -> bool:
    """Whether the installed vLLM has ``NixlPushConnector``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.get_connector_class_by_name("NixlPushConnector")
        return True
    except (ImportError, ValueError):
        return False


def start_pair(
    group: ServerGroup,
    name: str,
    model: Path,
    kind: str,
    env: dict,
    max_len: int = 8192,
    kv_gib: int = 4,
    direction: str = "auto",
    prefill_tp: int = 1,
) -> dict:
    """P on core 0, D on core 1; returns urls and P's side channel port.

    Each server's whole process tree is pinned to its core (not only its OpenMP threads), as
    if P and D were separate hosts: a D whose requests wait for KV steps vLLM's engine loop
    and its shared-memory queues busy-poll for a second after every message, which on a
    shared core would slow P's prefill (measured: docs/benchmarks.md, "Handoff"). The colocated
    row uses the same P server, so it gets the same one core. ``prefill_tp`` > 1: P runs that
    many tensor-parallel ranks (vLLM's multiprocessing executor), all on core 0, so that P has
    the compute of the TP 1 pairs it is compared with; D stays TP 1."""
    http = free_ports(2)
    # P's ranks bind our side channel on consecutive ports (stock NIXL: one port per server)
    side = [free_port_run(prefill_tp), free_ports(1)[0]]
    extra = ["--max-model-len", str(max_len), "--max-num-batched-tokens", "2048"]
    servers = {}
    for role, core in (("p", 0), ("d", 1)):
        server_env = dict(env, VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
        tp = prefill_tp if role == "p" else 1
        args = list(extra)
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
            server_env.update(TP_ENV)
        if prefill_tp > 1:  # both sides of a TP pair name the other's size
            other = {"decode_tp_size": 1} if role == "p" else {"prefill_tp_size": prefill_tp}
            tp_settings = {"peer_liveness_s": TP_PEER_LIVENESS_S, **other}
        else:
            tp_settings = None
        if kind == "splitserve":
            kv = splitserve_kv(side[core], direction, tp_settings)
        else:
            kv = nixl_kv(kind, role)
            server_env.update(
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(side[core]),
            )
        servers[role] = group.add_vllm(
            f"{name}-{role}",
            str(model),
            port=http[core],
            served_model_name="bench",
            kv_transfer_config=kv,
            extra_args=args,
            cpu_core=core if tp == 1 else None,
            cpus=[core],
            env=server_env,
        )
    group.wait(START_TIMEOUT, names=[f"{name}-p", f"{name}-d"])
    return {"p": servers["p"].url, "d": servers["d"].url, "p_side": side[0]}


def start_proxy(pair: dict, first_token: bool, started: list) -> str:
    """A splitserve proxy (concurrent flow) in this process, in front of the pair."""
    config = build_config(
        {
            "port": 0,
            "flow": "concurrent",
            "first_token_from_prefill": first_token,
            "prefill": [{"url": pair["p"], "side_channel_port": pair["p_side"]}],
            "decode": [{"url": pair["d"]}],
        }
    )
    proxy = BackgroundProxy(config).start()
    started.append(proxy)
    return proxy.url
