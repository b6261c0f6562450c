"""``SplitserveLMCacheConnector``: vLLM's ``LMCacheConnectorV1`` with the CPU shim installed.

Named in ``--kv-transfer-config`` (alone, or as a ``MultiConnector`` child) with
``"kv_connector_module_path": "splitserve.connectors.lmcache.vllm_connector"``. It installs the
shim in whichever process vLLM builds it (scheduler and workers), before LMCache builds its
engine, then is exactly vLLM's class; on a GPU the shim is not installed.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from splitserve.connectors.lmcache.settings import CONNECTOR_MODULE, CONNECTOR_NAME
from splitserve.connectors.lmcache.shim import install_cpu_shim

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "SplitserveLMCacheConnector"]


class SplitserveLMCacheConnector(LMCacheConnectorV1):
    """vLLM's LMCache connector; on CPU, LMCache's KV copies go through the shim."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        install_cpu_shim()
        super().__init__(vllm_config, role, kv_cache_config)
