"""SGLang plugin (test environment only): lets SGLang's own transfer backends run on a CPU.

Loaded by SGLang in each of its processes through the ``sglang.srt.plugins`` entry point; does
nothing unless switched on by an env var, so it never changes a run that did not ask for it:

- ``SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM=1``: SGLang's ``nixl`` backend registers its KV buffers as
  "VRAM" even when they are host tensors, and UCX refuses host memory labelled as GPU memory.
  Every NIXL agent created afterwards maps the "VRAM"/"cuda" labels to DRAM.
- ``SGLANG_CPU_SHIM_MOONCAKE_HOST_INDICES_OFF=1``: the ``mooncake`` sender advertises
  ``supports_host_tensor_indices``, which makes the prefill side use pinned memory and CUDA
  events; turned off so the generic index path runs.

splitserve's own backend registers memory with its real device type and needs neither.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def _nixl_vram_as_dram() -> None:
    import nixl._api as api

    cls = api.nixl_agent
    if getattr(cls, "_splitserve_vram_as_dram", False):
        return
    original_init = cls.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.nixl_mems["VRAM"] = self.nixl_mems["DRAM"]
        self.nixl_mems["cuda"] = self.nixl_mems["DRAM"]

    cls.__init__ = __init__
    cls._splitserve_vram_as_dram = True
    logger.info("cpu shim: NIXL 'VRAM' labels registered as DRAM (pid %d)", os.getpid())


def _mooncake_host_indices_off() -> None:
    from sglang.srt.disaggregation.mooncake import conn

    for name in dir(conn):
        obj = getattr(conn, name)
        if isinstance(obj, type) and obj.__dict__.get("supports_host_tensor_indices"):
            obj.supports_host_tensor_indices = False
            logger.info("cpu shim: %s.supports_host_tensor_indices = False", name)


def register() -> None:
    if os.environ.get("SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM") == "1":
        _nixl_vram_as_dram()
    if os.environ.get("SGLANG_CPU_SHIM_MOONCAKE_HOST_INDICES_OFF") == "1":
        _mooncake_host_indices_off()
