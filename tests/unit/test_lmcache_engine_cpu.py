"""Real LMCache engines over the CPU shim (no engine server): what vLLM's paged cache held at
some slots comes back, byte for byte, at other slots of another cache, from the engine's local
CPU tier and, for a second engine, from LMCache's own cache server as the shared remote tier.

LMCache changes this process's environment (its metrics logger sets
``PROMETHEUS_MULTIPROC_DIR``): the module puts it back when it ends
(``restore_process_environment``), or every in-process proxy of a later test serves its
metrics from files.
"""

from __future__ import annotations

import subprocess
import sys
import time

import lmcache  # noqa: F401
import pytest
import torch
import vllm  # noqa: F401

pytestmark = pytest.mark.usefixtures("restore_process_environment")

LAYERS, HEADS, HEAD_SIZE, BLOCK, BLOCKS, CHUNK = 3, 2, 64, 32, 40, 256


def _engine(name: str, **settings):
    """An LMCache engine as LMCache's vLLM adapter builds one on a worker, with the shim."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from splitserve.connectors.lmcache.cpu_paged import VLLMCpuPagedConnector

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.25, **settings
    )
    metadata = LMCacheMetadata(
        model_name="unit",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
    )
    connector = VLLMCpuPagedConnector.from_metadata(metadata)
    engine = LMCacheEngineBuilder.get_or_create(
        name, config, metadata, connector, lambda t, s: t, lambda o, s: o
    )
    engine.post_init()
    return engine


def _lmcache_server(port: int) -> subprocess.Popen:
    from splitserve.netutil import port_in_use

    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    end = time.monotonic() + 120
    while not port_in_use(port):
        assert proc.poll() is None and time.monotonic() < end, "LMCache server did not start"
        time.sleep(0.2)
    return proc


def test_store_then_retrieve_round_trips_through_lmcache() -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from splitserve.connectors.lmcache.cpu_paged import CpuPagedKV

    engine = _engine("splitserve-unit")
    try:
        n = 600  # two full chunks and a partial one (LMCache keeps full chunks by default)
        tokens = torch.randint(0, 1000, (n,))
        source = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) for _ in range(LAYERS)]
        source_slots = torch.arange(n) + 3 * BLOCK
        engine.store(tokens, kvcaches=source, slot_mapping=source_slots)
        assert engine.lookup(tokens) == 2 * CHUNK

        target = [torch.zeros_like(t) for t in source]
        target_slots = torch.arange(n) + 10 * BLOCK
        got = int(engine.retrieve(tokens, kvcaches=target, slot_mapping=target_slots).sum())
        assert got == 2 * CHUNK
        kv = CpuPagedKV(LAYERS, HEADS, HEAD_SIZE)
        assert torch.equal(
            kv.gather(target, target_slots[:got]), kv.gather(source, source_slots[:got])
        )
        assert torch.count_nonzero(kv.gather(target, target_slots[got:])) == 0
    finally:
        LMCacheEngineBuilder.destroy("splitserve-unit")


def test_second_engine_loads_from_the_shared_lmcache_server() -> None:
    """Two engines (two prefill servers' workers) share LMCache's server: B never computed the
    prefix, its local tier is empty, and it still loads A's KV byte for byte. Once the server
    is gone B's lookups answer 0 (recompute), they do not hang."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from splitserve.connectors.lmcache.cpu_paged import CpuPagedKV
    from splitserve.netutil import free_ports

    port = free_ports(1)[0]
    server = _lmcache_server(port)
    remote = {"remote_url": f"lm://127.0.0.1:{port}", "remote_serde": "naive"}
    try:
        a, b = _engine("splitserve-a", **remote), _engine("splitserve-b", **remote)
        n = 600
        tokens = torch.randint(0, 1000, (n,))
        source = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) for _ in range(LAYERS)]
        source_slots = torch.arange(n) + 3 * BLOCK
        a.store(tokens, kvcaches=source, slot_mapping=source_slots)
        end = time.monotonic() + 60  # A's remote put is asynchronous
        while b.lookup(tokens) == 0 and time.monotonic() < end:
            time.sleep(0.1)
        target = [torch.zeros_like(t) for t in source]
        target_slots = torch.arange(n) + 10 * BLOCK
        got = int(b.retrieve(tokens, kvcaches=target, slot_mapping=target_slots).sum())
        assert got == 2 * CHUNK
        kv = CpuPagedKV(LAYERS, HEADS, HEAD_SIZE)
        assert torch.equal(
            kv.gather(target, target_slots[:got]), kv.gather(source, source_slots[:got])
        )

        server.terminate()
        server.wait(30)
        assert b.lookup(torch.randint(0, 1000, (n,))) == 0
    finally:
        server.kill()
        server.wait(30)
        LMCacheEngineBuilder.destroy("splitserve-a")
        LMCacheEngineBuilder.destroy("splitserve-b")
