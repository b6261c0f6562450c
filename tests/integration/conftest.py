"""Fixtures shared by several integration modules, so that a server pair is started once per
session (through the ``servers`` pool, by key) and not once per module.

Module order: ``tests/conftest.py`` runs modules that share servers next to each other, so a
shared pair is still running when the second module asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import sglang_servers
import splitserve_servers
from splitserve_servers import (
    THIRD_MAX_MODEL_LEN,
    THIRD_MIN_CHUNK,
    SplitservePair,
)

SGLANG_PD_CHUNK = sglang_servers.CHUNK
SGLANG_START_TIMEOUT = 600.0
SGLANG_PD_START_ATTEMPTS = 3  # a pair that fails to start is started again on fresh ports


@pytest.fixture(scope="module")
def ss_pair(servers, tiny_model) -> SplitservePair:
    """The pair (``splitserve_servers.start_pair``), started once per session (the connector
    and proxy modules share it)."""
    keys = splitserve_servers.start_pair(servers, tiny_model)
    servers.wait_all(*keys)
    pair = SplitservePair()
    for key in keys:
        pair.servers[key] = (servers.group.servers[key].url, servers.side_port(key))
    return pair


@dataclass(frozen=True)
class ThirdServer:
    """``ss-c``: where it listens and the settings its tests depend on."""

    url: str
    side_port: int
    min_chunk: int = THIRD_MIN_CHUNK
    max_model_len: int = THIRD_MAX_MODEL_LEN


@pytest.fixture(scope="module")
def ss_third(ss_pair, servers, tiny_model, tmp_path_factory) -> ThirdServer:
    """``ss-c`` (``splitserve_servers.start_third``), a third server of the pair, deployed as
    ``splitserve up`` deploys D. One start for three modules that follow each other:
    test_proxy_decide's adaptive D, test_discovery's second D and test_prefill_allowlist's
    guarded D."""
    (key,) = splitserve_servers.start_third(servers, tiny_model, tmp_path_factory)
    servers.wait_all(*splitserve_servers.PAIR, key)
    return ThirdServer(servers.group.servers[key].url, servers.side_port(key))


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
