"""Where each KV block of each layer lives in memory, described without any engine.

Runs in the process that owns the KV cache (vLLM worker, SGLang scheduler). A ``KVLayout`` says,
per layer: the address of block 0, the byte stride between consecutive blocks, and the
contiguous byte runs (offset from the block's address, length) that make up one block (e.g. one
run for K and one for V when they sit in separate halves of the layer's tensor). It is derived
from the tensors' strides, so any block-major tensor shape works, and it is exchanged in HELLO so
the sender can address the receiver's blocks.

Invariants:
- ``validate_block_ids`` is the one check that a block id (ours or a peer's) lies inside the
  cache; nothing is posted for an id that fails it.
- Two layouts are compatible only if they have the same layers, block size in tokens and
  per-block run lengths: then block ``b`` of layer ``l`` copies run by run.
- Layers may hold different numbers of blocks; a block id is checked against its own layer.
  The last ``aux_layers`` layers are not KV: they hold one row per request slot (engine metadata
  such as the first output token, SGLang's ``aux`` buffers) and travel once per transfer, with
  DONE. ``num_kv_layers`` and ``num_blocks`` speak of the KV layers only.
- Tensor parallel: a layout describes one rank's shard (its KV heads). Two layouts exchange
  blocks only if they are the same shard: equal ``tp_size`` and ``tp_rank`` (checked first, so a
  prefill and a decode server of different tensor parallel sizes are refused with both sizes
  named, not with a run-length mismatch). A layout of an engine without TP says 1 and 0.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MemoryKind = Literal["DRAM", "VRAM"]
# A peer's cache may be larger than ours (a decode server with more memory), up to this factor.
PEER_BLOCKS_FACTOR = 16


def tp_mismatch(prefill_tp: int, decode_tp: int) -> str | None:
    """Why a prefill server of tensor parallel size ``prefill_tp`` cannot feed a decode server
    of size ``decode_tp`` (None when it can): both sizes named, for start-up checks and refusals."""
    if prefill_tp == decode_tp:
        return None
    return (
        f"prefill tensor parallel size {prefill_tp} != decode tensor parallel size {decode_tp}: "
        "prefill and decode need equal sizes (heterogeneous TP is not supported yet)"
    )


class LayerLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_addr: int = Field(ge=0)
    block_stride: int = Field(gt=0)
    num_blocks: int = Field(gt=0)
    runs: tuple[tuple[int, int], ...]  # (offset from the block's address, length) in bytes

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length in self.runs)

    def span(self) -> tuple[int, int]:
        """(first byte, end byte) of this layer's blocks in memory."""
        last = (self.num_blocks - 1) * self.block_stride
        end = max(offset + length for offset, length in self.runs)
        start = min(offset for offset, _ in self.runs)
        return self.base_addr + start, self.base_addr + last + end


class KVLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(gt=0, description="tokens per block")
    memory: MemoryKind = "DRAM"
    device_id: int = 0
    layers: tuple[LayerLayout, ...]
    aux_layers: int = Field(
        0, ge=0, description="the last this many layers are per-request rows, not KV blocks"
    )
    tp_size: int = Field(1, ge=1, le=1024, description="tensor parallel size of the engine")
    tp_rank: int = Field(0, ge=0, le=1023, description="the rank whose KV heads these are")

    @model_validator(mode="after")
    def _some_kv_layers(self) -> KVLayout:
        if self.aux_layers >= len(self.layers):
            raise ValueError(f"{self.aux_layers} aux layers leave no KV layer")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tensor parallel size {self.tp_size}")
        return self

    def wire(self) -> dict:
        """The layout as HELLO and HELLO_ACK carry it (JSON types); without the tensor parallel
        fields when there is no TP, so a peer that predates them still accepts it."""
        no_tp = self.tp_size == 1
        return self.model_dump(mode="json", exclude={"tp_size", "tp_rank"} if no_tp else None)

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers) - self.aux_layers

    @property
    def num_blocks(self) -> int:
        """KV blocks per layer (the smallest KV layer's count)."""
        return min(layer.num_blocks for layer in self.layers[: self.num_kv_layers])

    @property
    def bytes_per_block_all_layers(self) -> int:
        return sum(layer.block_bytes for layer in self.layers[: self.num_kv_layers])

    def incompatibility(self, other: KVLayout) -> str | None:
        """Why blocks cannot be copied between ``self`` and ``other`` (None when they can)."""
        if self.tp_size != other.tp_size:
            return (
                f"tensor parallel size {self.tp_size} here, {other.tp_size} at the peer: prefill "
                "and decode servers must use the same tensor parallel size (heterogeneous TP is "
                "not supported yet)"
            )
        if self.tp_rank != other.tp_rank:
            return (
                f"tensor parallel rank {self.tp_rank} here, {other.tp_rank} at the peer (of size "
                f"{self.tp_size}): rank r talks only to rank r (side channel port base + r)"
            )
        if self.block_size != other.block_size:
            return f"block size {self.block_size} != peer's {other.block_size}"
        if len(self.layers) != len(other.layers):
            return f"{len(self.layers)} layers != peer's {len(other.layers)}"
        if self.aux_layers != other.aux_layers:
            return f"{self.aux_layers} aux layers != peer's {other.aux_layers}"
        for index, (mine, theirs) in enumerate(zip(self.layers, other.layers, strict=True)):
            if [n for _, n in mine.runs] != [n for _, n in theirs.runs]:
                return f"layer {index}: block runs {mine.runs} != peer's {theirs.runs}"
            # The peer's numbers size what we allocate for it (a descriptor per block and run):
            # bounded by our own cache, so a peer cannot make us allocate by its word alone.
            if theirs.num_blocks > PEER_BLOCKS_FACTOR * mine.num_blocks:
                return (
                    f"layer {index}: peer declares {theirs.num_blocks} blocks, more than "
                    f"{PEER_BLOCKS_FACTOR}x our {mine.num_blocks}"
                )
        return None

    def validate_block_ids(
        self, block_ids: Iterable[int], what: str, layer: int | None = None
    ) -> None:
        """Raise ``ValueError`` naming ``what`` if any id lies outside the cache (outside
        ``layer`` when given, else outside every KV layer)."""
        limit = self.num_blocks if layer is None else self.layers[layer].num_blocks
        for block_id in block_ids:
            try:
                index = operator.index(block_id)
            except TypeError:
                index = -1
            if index < 0 or index >= limit:
                raise ValueError(
                    f"{what}: block id {block_id!r} outside the cache (0..{limit - 1})"
                )

    def memory_ranges(self) -> list[tuple[int, int]]:
        """Merged (start, length) byte ranges covering every layer's blocks, for registration."""
        spans = sorted(layer.span() for layer in self.layers)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(start, end - start) for start, end in merged]


def _contiguous_runs(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> list[tuple]:
    """(offset, length) byte runs covering a strided sub-tensor, splitting outer dims as needed."""
    # Collapse trailing dims that are contiguous into one run.
    inner_elems = 1
    split_at = len(shape)
    for dim in range(len(shape) - 1, -1, -1):
        if shape[dim] == 1 or strides[dim] == inner_elems:
            inner_elems *= shape[dim]
            split_at = dim
        else:
            break
    runs: list[tuple[int, int]] = [(0, inner_elems * itemsize)]
    for dim in range(split_at - 1, -1, -1):
        runs = [
            (offset + i * strides[dim] * itemsize, length)
            for i in range(shape[dim])
            for offset, length in runs
        ]
    return sorted(runs)


def layer_layout_from_tensor(tensor, num_blocks: int) -> LayerLayout:
    """Layout of one layer's KV tensor whose block dimension has ``num_blocks`` entries.

    The block dimension is the dim of size ``num_blocks`` with the largest stride (the tensors
    engines use put blocks outermost, possibly after a K/V dim of size 2).
    """
    shape, strides = list(tensor.shape), list(tensor.stride())
    candidates = [d for d, size in enumerate(shape) if size == num_blocks]
    if not candidates:
        raise ValueError(f"no dimension of size {num_blocks} (blocks) in KV tensor {shape}")
    block_dim = max(candidates, key=lambda d: strides[d])
    sub_shape = shape[:block_dim] + shape[block_dim + 1 :]
    sub_strides = strides[:block_dim] + strides[block_dim + 1 :]
    itemsize = tensor.element_size()
    runs = _contiguous_runs(sub_shape, sub_strides, itemsize)
    return LayerLayout(
        base_addr=tensor.data_ptr(),
        block_stride=strides[block_dim] * itemsize,
        num_blocks=num_blocks,
        runs=tuple(runs),
    )


def kv_layout_from_tensors(
    tensors: Sequence, num_blocks: int, block_size: int, tp_size: int = 1, tp_rank: int = 0
) -> KVLayout:
    """Layout of a KV cache given as one tensor per layer (in layer order); with tensor
    parallelism, of rank ``tp_rank``'s shard."""
    if not tensors:
        raise ValueError("no KV tensors to describe")
    device = tensors[0].device
    memory: MemoryKind = "DRAM" if device.type == "cpu" else "VRAM"
    device_id = 0 if device.index is None else int(device.index)
    return KVLayout(
        block_size=block_size,
        memory=memory,
        device_id=device_id,
        layers=tuple(layer_layout_from_tensor(t, num_blocks) for t in tensors),
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
