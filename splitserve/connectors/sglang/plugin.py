"""splitserve's SGLang plugin: the ``sglang.srt.plugins`` entry point (see pyproject.toml).

SGLang calls ``register`` once in each of its processes (launcher, scheduler, detokenizer, DP
controller) through ``sglang.srt.plugins.load_plugins``, before it parses server arguments and
before it applies the hooks registered with its ``HookRegistry``. SGLang only logs a plugin's
exception, so nothing here raises for a user's setting: checks that must stop start-up run in the
scheduler's constructor (see ``splitserve.schedulers.sglang``).

What it registers:
- the ``splitserve`` transfer backend (``--disaggregation-transfer-backend splitserve``; enum
  member, CLI choice and class lookup through ``splitserve.connectors.sglang.registry``; the
  classes, ``splitserve.connectors.sglang.conn``, are imported on the first lookup only), and
  its layer-wise hooks on the prefill side (``splitserve.connectors.sglang.layerwise``, inert
  unless a splitserve prefill manager exists in the process);
- the adaptive chunk budget hooks (``splitserve.schedulers.sglang``), only when
  ``$SPLITSERVE_ADAPTIVE_BUDGET`` is set.

Invariant: idempotent per process (a second call registers nothing twice).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from splitserve.connectors.sglang import layerwise, registry
    from splitserve.schedulers import sglang as budget

    registry.register_transfer_backend("splitserve", _backend_classes)
    layerwise.register_hooks()

    if budget.hooks_wanted(os.environ):
        budget.register_hooks()
        logger.info("splitserve: adaptive chunk budget hooks registered (pid %d)", os.getpid())


def _backend_classes() -> dict[str, type]:
    from splitserve.connectors.sglang import conn

    return conn.classes()
