"""A ``GPUConnectorInterface`` for vLLM's CPU KV cache, the one LMCache 0.5.6 does not ship.

vLLM's CPU attention backend (``CPU_ATTN``, layout ``LBHNC``) keeps one tensor per layer,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; per block and head its kernel
(``cpu_attn_reshape_and_cache``, ISA ``vec`` / ``vec16``; measured with fp32) writes the
block's keys transposed, ``[head_size, block_size]``, then its values, ``[block_size,
head_size]`` (measured with the kernel itself: tests/unit/test_lmcache_cpu_paged.py). Other ISAs
(AMX for bf16) pack differently and are refused, never guessed.
LMCache's memory objects are ``KV_2LTD``: ``[2, num_layers, tokens, num_kv_heads * head_size]``.
A token's cache slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``, so
copying is one gather (store) or scatter (load) per layer and K/V, with torch index ops.

Loads skip the first ``vllm_cached_tokens - start`` tokens, as LMCache's CUDA connector does:
those slots belong to vLLM's own prefix cache and may be shared with a running request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

logger = logging.getLogger(__name__)


SUPPORTED_ISAS = ("vec", "vec16")


def check_isa(layer: torch.Tensor, head_size: int) -> str:
    """The ISA vLLM's CPU attention picks for this cache (its own rule); raises for one whose
    block packing the shim does not know."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(layer.dtype, layer.shape[2], head_size)
    if isa not in SUPPORTED_ISAS:
        raise ValueError(
            f"vLLM's CPU attention packs this KV cache with ISA {isa!r}; splitserve's LMCache "
            f"CPU shim knows only {SUPPORTED_ISAS} (use --dtype float32)"
        )
    return isa


class CpuPagedKV:
    """Gather and scatter of tokens' K and V in vLLM's CPU paged KV cache (no LMCache types)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size

    def _kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``layer``: keys ``[blocks, heads, head_size, block_size]``, values
        ``[blocks, heads, block_size, head_size]``."""
        num_blocks = layer.shape[0]
        if layer.dim() != 4 or layer.shape[1] != self.num_kv_heads:
            raise ValueError(
                f"KV tensor {tuple(layer.shape)}: not vLLM's CPU layout [blocks, "
                f"{self.num_kv_heads} heads, block_size, 2 * {self.head_size}]"
            )
        block_size = layer.shape[2]
        halves = layer.view(num_blocks, self.num_kv_heads, 2, block_size * self.head_size)
        keys = halves[:, :, 0].view(num_blocks, self.num_kv_heads, self.head_size, block_size)
        values = halves[:, :, 1].view(num_blocks, self.num_kv_heads, block_size, self.head_size)
        return keys, values

    def gather(self, kvcaches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """``[2, layers, len(slots), heads * head_size]``: the tokens at ``slots``."""
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"{len(kvcaches)} KV tensors for {self.num_layers} layers")
        slots = slots.to(torch.long)
        out = []
        for layer in kvcaches:
            keys, values = self._kv_views(layer)
            block_size = values.shape[2]
            blocks, offsets = slots // block_size, slots % block_size
            # Advanced indices split by slices: the token dimension comes first, [T, heads, D].
            k = keys[blocks, :, :, offsets]
            v = values[blocks, :, offsets]
            out.append(torch.stack([k, v]).flatten(2))
        return torch.stack(out, dim=1)

    def scatter(
        self, kvcaches: Sequence[torch.Tensor], slots: torch.Tensor, data: torch.Tensor
    ) -> None:
        """Write ``data`` (``[2, layers, len(slots), heads * head_size]``) into ``slots``."""
        if len(kvcaches) != self.num_layers:
            raise ValueError(f"{len(kvcaches)} KV tensors for {self.num_layers} layers")
        slots = slots.to(torch.long)
        tokens = data.view(2, self.num_layers, len(slots), self.num_kv_heads, self.head_size)
        for i, layer in enumerate(kvcaches):
            keys, values = self._kv_views(layer)
            block_size = values.shape[2]
            blocks, offsets = slots // block_size, slots % block_size
            keys[blocks, :, :, offsets] = tokens[0, i].to(keys.dtype)
            values[blocks, :, offsets] = tokens[1, i].to(values.dtype)


class VLLMCpuPagedConnector(GPUConnectorInterface):
    """LMCache's side of vLLM's CPU KV cache: ``KV_2LTD`` memory objects in and out.

    LMCache calls it with ``kvcaches`` (vLLM's per-layer tensors, in layer order) and
    ``slot_mapping`` (the whole sequence's slots) in its keyword arguments.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.kv = CpuPagedKV(num_layers, num_kv_heads, head_size)
        self.num_layers = num_layers
        self.hidden_dim_size = num_kv_heads * head_size
        self.kvcaches: list[torch.Tensor] | None = None

    @classmethod
    def from_metadata(cls, metadata) -> VLLMCpuPagedConnector:
        """From ``LMCacheMetadata``: ``kv_shape`` is (layers, 2, chunk, kv_heads, head_size)."""
        if metadata.use_mla:
            raise ValueError("the CPU shim does not support MLA models")
        num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
        return cls(num_layers, num_kv_heads, head_size)

    def initialize_kvcaches_ptr(self, **kwargs) -> None:
        if "kvcaches" in kwargs:
            if self.kvcaches is None:
                check_isa(kwargs["kvcaches"][0], self.kv.head_size)
            self.kvcaches = list(kwargs["kvcaches"])

    def _caches_and_slots(self, kwargs: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
        self.initialize_kvcaches_ptr(**kwargs)
        if self.kvcaches is None:
            raise ValueError("'kvcaches' must be given once before a copy")
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' must be given")
        return self.kvcaches, kwargs["slot_mapping"]

    @staticmethod
    def _check_format(memory_obj: MemoryObj) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None:
            raise ValueError("memory object without a tensor")
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"memory object format {memory_obj.metadata.fmt}, want KV_2LTD")
        return tensor

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        """Load: memory object -> vLLM's cache, skipping slots vLLM's prefix cache owns."""
        tensor = self._check_format(memory_obj)
        kvcaches, slot_mapping = self._caches_and_slots(kwargs)
        skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        if skip == end - start:
            return
        slots = slot_mapping[start + skip : end]
        self.kv.scatter(kvcaches, slots, tensor[:, :, skip : end - start].contiguous())

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        """Store: vLLM's cache -> memory object."""
        tensor = self._check_format(memory_obj)
        kvcaches, slot_mapping = self._caches_and_slots(kwargs)
        tensor[:, :, : end - start].copy_(self.kv.gather(kvcaches, slot_mapping[start:end]))

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])
