"""Engine entry points: the one place that ties splitserve's parts to an engine at start-up.

Both entry points that pyproject.toml declares name a function here, and each only wires the
adapters in (connectors and schedulers); the work stays in the adapters.

``register_vllm`` is vLLM's ``vllm.general_plugins`` entry point. vLLM calls it in every process
it starts (API server, engine core, workers), sometimes more than once per process, before it
reads ``--kv-transfer-config``; it registers the connector name ``SplitserveConnector`` lazily
(the module is imported only when a server selects it). When ``$SPLITSERVE_VLLM_SHM_SPIN_S`` is
set it also sets how long vLLM's shared-memory ring readers spin after a read
(``splitserve.connectors.vllm.shm_spin``), in each process before its rings exist.

``register_sglang`` is SGLang's ``sglang.srt.plugins`` entry point. SGLang calls it once in each
of its processes (launcher, scheduler, detokenizer, DP controller) through
``sglang.srt.plugins.load_plugins``, before it parses server arguments and before it applies the
hooks registered with its ``HookRegistry``. SGLang only logs a plugin's exception, so nothing here
raises for a user's setting: checks that must stop start-up run in the scheduler's constructor
(see ``splitserve.schedulers.sglang``). What it registers:

- the ``splitserve`` transfer backend (``--disaggregation-transfer-backend splitserve``; enum
  member, CLI choice and class lookup through ``splitserve.connectors.sglang.registry``; the
  classes, ``splitserve.connectors.sglang.conn``, are imported on the first lookup only), and its
  layer-wise hooks on the prefill side (``splitserve.connectors.sglang.layerwise``, inert unless
  a splitserve prefill manager exists in the process);
- the adaptive chunk budget hooks (``splitserve.schedulers.sglang``), only when
  ``$SPLITSERVE_ADAPTIVE_BUDGET`` is set.

Invariant: both are idempotent per process (a second call registers nothing twice), and importing
this module imports no engine.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

VLLM_CONNECTOR_NAME = "SplitserveConnector"
VLLM_CONNECTOR_MODULE = "splitserve.connectors.vllm.connector"
SGLANG_TRANSFER_BACKEND = "splitserve"

_sglang_registered = False


def register_vllm() -> None:
    """Register ``SplitserveConnector`` with vLLM's connector factory, and apply
    ``SPLITSERVE_VLLM_SHM_SPIN_S`` when set (both idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from splitserve.connectors.vllm import shm_spin

    shm_spin.apply_from_env()

    if VLLM_CONNECTOR_NAME in KVConnectorFactory._registry:  # noqa: SLF001 (no public query)
        return
    KVConnectorFactory.register_connector(
        VLLM_CONNECTOR_NAME, VLLM_CONNECTOR_MODULE, VLLM_CONNECTOR_NAME
    )
    logger.debug("registered vLLM KV connector %s", VLLM_CONNECTOR_NAME)


def register_sglang() -> None:
    """Register the ``splitserve`` transfer backend, its layer hooks and, when asked for, the
    adaptive budget hooks with SGLang (idempotent per process)."""
    global _sglang_registered
    if _sglang_registered:
        return
    _sglang_registered = True
    from splitserve.connectors.sglang import layerwise, registry
    from splitserve.schedulers import sglang as budget

    registry.register_transfer_backend(SGLANG_TRANSFER_BACKEND, _sglang_backend_classes)
    layerwise.register_hooks()

    if budget.hooks_wanted(os.environ):
        budget.register_hooks()
        logger.info("splitserve: adaptive chunk budget hooks registered (pid %d)", os.getpid())


def _sglang_backend_classes() -> dict[str, type]:
    from splitserve.connectors.sglang import conn

    return conn.classes()
