"""Layer-wise posting on an SGLang prefill server: each layer's WRITE leaves as soon as the KV pool
stores that layer, while the forward still runs the layers above it.

Runs in the scheduler process of a prefill server with ``--disaggregation-transfer-backend
splitserve``. The plugin registers two hooks with SGLang's ``HookRegistry`` in every SGLang
process; both do nothing unless this process's splitserve manager made itself ``ACTIVE`` (P
with ``SPLITSERVE_SGLANG_LAYERWISE`` on, the default; either side with
``SPLITSERVE_SGLANG_TIMELINE=1``, whose forward and first-decode times the ``run_batch`` hook
also records, ``splitserve.connectors.sglang.timeline``):

- ``Scheduler.run_batch`` (around), for prefill (extend) batches: before the forward, the batch's
  requests whose transfer has started (D registered, ``init`` done) give the sender their page
  table (``req_to_token`` up to ``extend_end``, as page ids) and the tokens complete once this
  forward ends (``KVSender.begin_step``); after it, ``end_step`` (a layer the hook did not see is
  posted then, so nothing is ever skipped).
- ``MHATokenToKVPool.set_kv_buffer`` (after): the narrowest per-layer point, called by the
  attention backend once per layer per forward right after it wrote the layer's K and V into the
  pool. It posts that layer's K and V buffers' newly completed pages (``KVSender.layer_done``).

On a CPU the store is synchronous, so the bytes are in the pool when the hook runs. SGLang then
calls ``send(kv_indices)`` per chunk after the forward as usual: by then the chunk's pages are
posted, and ``send`` only completes what the hooks could not (the last partial page, pages of a
request whose registration came late) and lets DONE go after the last chunk.

Invariants: the hooks never raise into SGLang's forward for a transfer's sake (a transfer
problem fails that transfer, see ``KVSender``); a step opened before a forward is closed after it
even if the forward raises.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
SET_KV_BUFFER = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer"

# This process's manager when it needs the hooks (set by it): P with layer-wise posting or the
# timeline on, D with the timeline on (its first decode steps; see the manager's begin_forward).
ACTIVE: Any = None
_registered = False


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    mgr = ACTIVE
    if mgr is None or batch is None:
        return original(scheduler, batch, *args, **kwargs)
    opened = mgr.begin_forward(scheduler, batch)
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        mgr.end_forward(opened)


def after_set_kv_buffer(result, pool, layer, *args, **kwargs):
    mgr = ACTIVE
    if mgr is not None and mgr.forward_open:
        layer_id = kwargs.get("layer_id_override")
        if layer_id is None and layer is not None:
            layer_id = layer.layer_id
        if layer_id is not None:
            mgr.layer_stored(int(layer_id))
    return None


def register_hooks() -> None:
    """These hooks and the backend's other scheduler hook (``idle``: the nap between polls)."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from splitserve.connectors.sglang import idle

    HookRegistry.register(RUN_BATCH, around_run_batch, HookType.AROUND)
    HookRegistry.register(SET_KV_BUFFER, after_set_kv_buffer, HookType.AFTER)
    idle.register_hooks()
    _registered = True
