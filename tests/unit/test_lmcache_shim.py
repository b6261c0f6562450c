"""Where the CPU shim answers and where it must not: LMCache's own factory has no CPU branch for
vLLM (the failure the shim exists for), the shim answers for vLLM on the CPU platform only, and
on any other platform it installs nothing.

LMCache changes this process's environment (its metrics logger sets
``PROMETHEUS_MULTIPROC_DIR``): the module puts it back when it ends
(``restore_process_environment``), or every in-process proxy of a later test serves its
metrics from files.
"""

from __future__ import annotations

import lmcache
import pytest
import torch
import vllm  # noqa: F401

pytestmark = pytest.mark.usefixtures("restore_process_environment")


@pytest.fixture
def factory(monkeypatch):
    """LMCache's factory module, restored after the test; the shim's install flag reset."""
    from lmcache.v1 import gpu_connector

    from splitserve.connectors.lmcache import shim

    monkeypatch.setattr(gpu_connector, "CreateGPUConnector", gpu_connector.CreateGPUConnector)
    monkeypatch.setattr(shim, "_installed", False)
    return gpu_connector


def _args(**settings):
    from lmcache.utils import EngineType
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_defaults(chunk_size=256, **settings)
    metadata = LMCacheMetadata(
        model_name="unit",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(4, 2, 256, 2, 64),
    )
    return config, metadata, EngineType.VLLM


def test_lmcache_alone_has_no_cpu_connector_for_vllm(factory) -> None:
    assert lmcache.torch_device_type == "cpu"
    with pytest.raises(RuntimeError, match="No supported cpu connector"):
        factory.CreateGPUConnector(*_args())


def test_shim_answers_for_vllm_on_cpu(factory) -> None:
    from splitserve.connectors.lmcache.cpu_paged import VLLMCpuPagedConnector
    from splitserve.connectors.lmcache.shim import install_cpu_shim

    assert install_cpu_shim() is True
    assert install_cpu_shim() is True  # idempotent: wrapped once
    connector = factory.CreateGPUConnector(*_args())
    assert isinstance(connector, VLLMCpuPagedConnector)
    assert connector.get_shape(10) == torch.Size([2, 4, 10, 128])


def test_shim_leaves_layerwise_to_lmcache(factory) -> None:
    from splitserve.connectors.lmcache.shim import install_cpu_shim

    install_cpu_shim()
    with pytest.raises(RuntimeError, match="No supported cpu connector"):
        factory.CreateGPUConnector(*_args(use_layerwise=True))


def test_shim_installs_nothing_off_cpu(factory, monkeypatch) -> None:
    from splitserve.connectors.lmcache.shim import install_cpu_shim

    original = factory.CreateGPUConnector
    monkeypatch.setattr(lmcache, "torch_device_type", "cuda")
    assert install_cpu_shim() is False
    assert factory.CreateGPUConnector is original


# Builds the worker half of the connector the way vLLM's worker does (after the engine core
# resolved the KV layout), in its own process: vLLM's distributed state is process-global.
_WORKER_PROBE = """
import os, sys
from vllm.config import KVTransferConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from splitserve.connectors.lmcache.settings import CONNECTOR_MODULE, CONNECTOR_NAME
from splitserve.connectors.lmcache.vllm_connector import SplitserveLMCacheConnector
from splitserve.netutil import free_ports

kv = KVTransferConfig(
    kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both"
)
args = EngineArgs(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=1024,
                  kv_transfer_config=kv)
config = args.create_engine_config()
record_kv_cache_layout(config.cache_config, "LBHNC")
with set_current_vllm_config(config):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_ports(1)[0]}", 0, "gloo")
    ensure_model_parallel_initialized(1, 1)
    connector = SplitserveLMCacheConnector(config, KVConnectorRole.WORKER, None)
    engine = connector._lmcache_engine.lmcache_engine
    print("COPIER", type(engine.gpu_connector).__name__ if engine else None, flush=True)
os._exit(0)
"""


def test_vllm_worker_builds_lmcache_engine_with_the_shim(tmp_path) -> None:
    """Through vLLM's own LMCache adapter: without the shim LMCache logs 'System will operate
    in degraded mode (recompute)' and has no engine; with it the worker's engine copies KV
    through ``VLLMCpuPagedConnector``."""
    import os
    import subprocess
    import sys

    from splitserve.models import build_model, resolve_spec

    model = build_model(resolve_spec("tiny"), tmp_path / "tiny")
    env = dict(
        os.environ,
        LMCACHE_CHUNK_SIZE="256",
        LMCACHE_LOCAL_CPU="True",
        LMCACHE_MAX_LOCAL_CPU_SIZE="0.25",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        PYTHONHASHSEED="0",
    )
    out = subprocess.run(
        [sys.executable, "-c", _WORKER_PROBE, str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert "COPIER VLLMCpuPagedConnector" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    assert "degraded mode" not in out.stderr
