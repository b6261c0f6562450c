"""Fixtures shared by several integration modules, so that a server pair is started once per
session (through the ``servers`` pool, by key) and not once per module.

Module order: ``tests/conftest.py`` runs modules that share servers next to each other, so a
shared pair is still running when the second module asks for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import sglang_servers
from cpu_placement import UNPINNED
from session_keys import TEST_KEY, test_key_file

SGLANG_PD_CHUNK = sglang_servers.CHUNK
SGLANG_START_TIMEOUT = 600.0
SGLANG_PD_START_ATTEMPTS = 3  # a pair that fails to start is started again on fresh ports


@dataclass(frozen=True)
class SplitservePair:
    """Two vLLM servers with ``SplitserveConnector`` (``kv_both``), keys ``ss-a`` / ``ss-b``, each
    on its own core; either can prefill for the other. ``pair[key]`` is ``(url, side_port)``."""

    servers: dict[str, tuple[str, int]]
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


@pytest.fixture(scope="module")
def ss_pair(servers, tiny_model) -> SplitservePair:
    """The pair, started once per session (the connector and proxy modules share it). Whoever
    starts it chooses the side ports, so they are read back from the servers' command lines."""
    from splitserve.netutil import free_ports

    pair = SplitservePair({})
    keys = ("ss-a", "ss-b")
    for core, (key, side_port) in enumerate(zip(keys, free_ports(2), strict=True)):
        if key not in servers.group.servers:
            servers.vllm(
                key,
                tiny_model,
                kv_transfer_config=pair.kv_config(side_port),
                extra_args=pair.extra_args,
                cpu_core=core,
                wait=False,
            )
    servers.wait_all(*keys)
    for key in keys:
        pair.servers[key] = (servers.group.servers[key].url, servers.side_port(key))
    return pair


# ss-c's adaptive budget (test_proxy_decide reads it on ss-c's /metrics): a 1 us ITL target is
# unreachable (1 ms was not, on a CI run), so the budget is exactly the pair's
# --max-num-batched-tokens on a step without decodes and THIRD_MIN_CHUNK on a step with
# decodes, a fact of the workload and not of timing (test_adaptive_scheduler.py).
THIRD_MIN_CHUNK = 128
THIRD_SCHEDULER = {"splitserve_scheduler": {"target_itl_ms": 0.001, "min_chunk": THIRD_MIN_CHUNK}}
THIRD_MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings: D holds long streams


@dataclass(frozen=True)
class ThirdServer:
    """``ss-c``: where it listens and the settings its tests depend on."""

    url: str
    side_port: int
    min_chunk: int = THIRD_MIN_CHUNK
    max_model_len: int = THIRD_MAX_MODEL_LEN


@pytest.fixture(scope="module")
def ss_third(ss_pair, servers, tiny_model, tmp_path_factory) -> ThirdServer:
    """``ss-c``, a third server of the pair, deployed as ``splitserve up`` deploys D: it runs
    ``AdaptiveChunkScheduler`` (``THIRD_SCHEDULER``), may contact prefill side channels on
    127.0.0.1 only, and runs the request guard (``--middleware``). One start for three modules
    that follow each other: test_proxy_decide's adaptive D, test_discovery's second D and
    test_prefill_allowlist's guarded D. ``PROMETHEUS_MULTIPROC_DIR`` puts the scheduler's
    metrics (EngineCore) on the server's own ``/metrics``. Unpinned with one OpenMP thread
    (cpu_placement.py): pinned beside ss-a, the two engines share a core and P's side channel
    misses its handshake bounds."""
    from splitserve.launch.engines import SPLITSERVE_GUARD
    from splitserve.netutil import free_ports

    kv = ss_pair.kv_config(free_ports(1)[0])
    kv["kv_connector_extra_config"]["allowed_prefill_hosts"] = ["127.0.0.1"]
    extra_args = [
        *ss_pair.extra_args,
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
    server = servers.vllm(
        "ss-c",
        tiny_model,
        kv_transfer_config=kv,
        extra_args=extra_args,
        cpu_core=None,
        env={**UNPINNED, "PROMETHEUS_MULTIPROC_DIR": str(prometheus_dir)},
        wait=False,
    )
    servers.wait_all("ss-a", "ss-b", "ss-c")
    return ThirdServer(server.url, servers.side_port("ss-c"))


@dataclass(frozen=True)
class SglangPair:
    """A real SGLang PD pair (splitserve's transfer backend on host memory)."""

    prefill_url: str
    decode_url: str
    bootstrap_port: int
    chunk: int = SGLANG_PD_CHUNK


@dataclass(frozen=True)
class SglangPD(SglangPair):
    """The pair and SGLang's router in front of it."""

    router_url: str = ""


@pytest.fixture(scope="module")
def sglang_pair(servers, tiny_model) -> SglangPair:
    """Keys ``sglang-pd-prefill`` / ``sglang-pd-decode``, started as
    tests/integration/sglang_servers.py says (``start_pair``: splitserve's transfer backend,
    prefill chunked by ``SGLANG_PD_CHUNK`` tokens, metrics and the per-request timeline on).
    Our backend registers host memory as host memory and runs no NIXL progress thread, so no
    CPU shim and no nice level. Shared by test_sglang_pd, test_proxy_sglang and
    test_sglang_failures (which kills, restarts and freezes them)."""
    pytest.importorskip("sglang")
    from splitserve.launch.process import ProcessStartError

    group = servers.group
    names = list(sglang_servers.SGLANG_PD_KEYS)
    for attempt in range(1, SGLANG_PD_START_ATTEMPTS + 1):
        if any(name not in group.servers for name in names):
            sglang_servers.start_pair(servers, tiny_model)
        try:
            group.wait(SGLANG_START_TIMEOUT, names=names, stop_group_on_failure=False)
            break
        except ProcessStartError:
            # A port picked free can be taken before the server binds it (CI: "address
            # already in use" on P's HTTP port): start the pair again on fresh ports.
            if attempt == SGLANG_PD_START_ATTEMPTS:
                raise
    bootstrap = sglang_servers.bootstrap_port(servers, names[0])
    return SglangPair(group.servers[names[0]].url, group.servers[names[1]].url, bootstrap)


@pytest.fixture(scope="module")
def sglang_pd(servers, sglang_pair) -> SglangPD:
    """``sglang_pair`` and SGLang's router in front of it (key ``sglang-router``)."""
    pytest.importorskip("sglang_router")
    from splitserve.launch.engines import sglang_router
    from splitserve.netutil import free_ports

    group = servers.group
    router = group.servers.get("sglang-router")
    if router is not None and sglang_pair.prefill_url not in router.process.argv:
        servers.release("sglang-router")  # in front of a pair that was started again since
    if "sglang-router" not in group.servers:
        router_port, metrics_port = free_ports(2)
        router = sglang_router(
            router_port,
            [(sglang_pair.prefill_url, sglang_pair.bootstrap_port)],
            [sglang_pair.decode_url],
            prometheus_port=metrics_port,
        )
        group.add("sglang-router", router.argv, port=router_port, env=router.env)
    group.wait(SGLANG_START_TIMEOUT, names=["sglang-router"], stop_group_on_failure=False)
    return SglangPD(
        sglang_pair.prefill_url,
        sglang_pair.decode_url,
        sglang_pair.bootstrap_port,
        router_url=group.servers["sglang-router"].url,
    )
