"""Installs ``VLLMCpuPagedConnector`` where LMCache has no CPU connector, and only there.

``install_cpu_shim`` wraps ``lmcache.v1.gpu_connector.CreateGPUConnector`` (LMCache's vLLM
service factory imports it from that module at call time, so the wrapper is what it calls). The
wrapper answers only for vLLM on LMCache's ``cpu`` platform without layer-wise mode; anything
else (CUDA, XPU, SGLang, layer-wise) goes to LMCache's own factory unchanged, and on a non-CPU
platform the wrapper is not installed at all.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_installed = False


def install_cpu_shim() -> bool:
    """Install the wrapper when LMCache's platform is the CPU (idempotent); True if installed."""
    global _installed
    import lmcache
    from lmcache.v1 import gpu_connector

    if lmcache.torch_device_type != "cpu":
        return False
    if _installed:
        return True
    original = gpu_connector.CreateGPUConnector

    def create(config, metadata, engine, layout_hints=None):
        from lmcache.utils import EngineType

        if engine == EngineType.VLLM and not config.use_layerwise:
            from splitserve.connectors.lmcache.cpu_paged import VLLMCpuPagedConnector

            logger.info("LMCache on CPU: KV copies through splitserve's CPU paged connector")
            return VLLMCpuPagedConnector.from_metadata(metadata)
        return original(config, metadata, engine, layout_hints=layout_hints)

    gpu_connector.CreateGPUConnector = create
    _installed = True
    return True
