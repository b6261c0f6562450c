"""Engine entry points: the one place that ties splitserve's parts to an engine at start-up.

``register_vllm`` is vLLM's ``vllm.general_plugins`` entry point (see pyproject.toml). vLLM
calls it in every process it starts (API server, engine core, workers), sometimes more than
once per process, before it reads ``--kv-transfer-config``; it registers the connector name
``SplitserveConnector`` lazily (the module is imported only when a server selects it).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

VLLM_CONNECTOR_NAME = "SplitserveConnector"
VLLM_CONNECTOR_MODULE = "splitserve.connectors.vllm.connector"


def register_vllm() -> None:
    """Register ``SplitserveConnector`` with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if VLLM_CONNECTOR_NAME in KVConnectorFactory._registry:  # noqa: SLF001 (no public query)
        return
    KVConnectorFactory.register_connector(
        VLLM_CONNECTOR_NAME, VLLM_CONNECTOR_MODULE, VLLM_CONNECTOR_NAME
    )
    logger.debug("registered vLLM KV connector %s", VLLM_CONNECTOR_NAME)
