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
  per-block run lengths (after head slicing, below): then block ``b`` of layer ``l`` copies run
  by run.
- Layers may hold different numbers of blocks; a block id is checked against its own layer.
  The last ``aux_layers`` layers are not KV: they hold one row per request slot (engine metadata
  such as the first output token, SGLang's ``aux`` buffers) and travel once per transfer, with
  DONE. ``num_kv_layers`` and ``num_blocks`` speak of the KV layers only.
- Tensor parallel: a layout describes one rank's shard (its KV heads). Shards of one TP size
  exchange blocks only rank r with rank r. Shards of different sizes exchange when one's heads
  lie inside the other's (``tp.exchange_slices``): the wider shard's side then addresses only
  that head range, one contiguous sub-run of each of its runs. That needs the heads described:
  ``kv_heads`` / ``total_kv_heads`` and each KV layer's ``head_bytes``, derived from the
  tensors' strides (heads outermost inside every run; a layout whose heads are not is left
  undescribed, ``head_bytes`` 0, and serves equal sizes only). The TP check comes first, so
  different sizes are refused with both named, not with a run-length mismatch. A layout of an
  engine without TP says 1 and 0.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.transfer.tp import HeadSlice, exchange_slices, sliced_runs, tp_mismatch

__all__ = ["KVLayout", "LayerLayout", "kv_layout_from_tensors", "tp_mismatch"]

MemoryKind = Literal["DRAM", "VRAM"]
# A peer's cache may be larger than ours (a decode server with more memory), up to this factor.
PEER_BLOCKS_FACTOR = 16


class LayerLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    base_addr: int = Field(ge=0)
    block_stride: int = Field(gt=0)
    num_blocks: int = Field(gt=0)
    runs: tuple[tuple[int, int], ...]  # (offset from the block's address, length) in bytes
    # Bytes of one KV head inside each run, heads outermost in it (0: not described, or heads
    # not contiguous inside a run): what lets a shard of another TP size address a head range.
    head_bytes: int = Field(0, ge=0)

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
    kv_heads: int = Field(0, ge=0, le=1 << 16, description="KV heads in this shard (0: unknown)")
    total_kv_heads: int = Field(
        0, ge=0, le=1 << 16, description="the model's KV heads over all ranks (0: unknown)"
    )

    @model_validator(mode="after")
    def _some_kv_layers(self) -> KVLayout:
        if self.aux_layers >= len(self.layers):
            raise ValueError(f"{self.aux_layers} aux layers leave no KV layer")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tensor parallel size {self.tp_size}")
        if self.kv_heads and self.total_kv_heads and self.kv_heads > self.total_kv_heads:
            raise ValueError(f"{self.kv_heads} KV heads of {self.total_kv_heads} in all")
        for index, layer in enumerate(self.layers[: self.num_kv_layers]):
            if layer.head_bytes and any(
                n != self.kv_heads * layer.head_bytes for _, n in layer.runs
            ):
                raise ValueError(
                    f"layer {index}: runs {layer.runs} are not {self.kv_heads} heads of "
                    f"{layer.head_bytes} bytes"
                )
        return self

    def wire(self) -> dict:
        """The layout as HELLO and HELLO_ACK carry it (JSON types); without the tensor parallel
        fields when there is no TP and without the head fields when unknown, so a peer that
        predates them still accepts such a layout."""
        out = self.model_dump(mode="json")
        if self.tp_size == 1:
            del out["tp_size"], out["tp_rank"]
        for key in ("kv_heads", "total_kv_heads"):
            if not out[key]:
                del out[key]
        for layer in out["layers"]:
            if not layer["head_bytes"]:
                del layer["head_bytes"]
        return out

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
        try:
            mine, theirs = self.head_slices(other)
        except ValueError as exc:
            return str(exc)
        if self.block_size != other.block_size:
            return f"block size {self.block_size} != peer's {other.block_size}"
        if len(self.layers) != len(other.layers):
            return f"{len(self.layers)} layers != peer's {len(other.layers)}"
        if self.aux_layers != other.aux_layers:
            return f"{self.aux_layers} aux layers != peer's {other.aux_layers}"
        for index, (ours, peers) in enumerate(zip(self.layers, other.layers, strict=True)):
            kv = index < self.num_kv_layers  # aux rows are whole rows on both sides
            try:
                our_runs = sliced_runs(ours, self.kv_heads, mine if kv else None)
                peer_runs = sliced_runs(peers, other.kv_heads, theirs if kv else None)
            except ValueError as exc:
                return f"layer {index}: {exc}"
            if [n for _, n in our_runs] != [n for _, n in peer_runs]:
                return f"layer {index}: block runs {our_runs} != peer's {peer_runs}"
            # The peer's numbers size what we allocate for it (a descriptor per block and run):
            # bounded by our own cache, so a peer cannot make us allocate by its word alone.
            if peers.num_blocks > PEER_BLOCKS_FACTOR * ours.num_blocks:
                return (
                    f"layer {index}: peer declares {peers.num_blocks} blocks, more than "
                    f"{PEER_BLOCKS_FACTOR}x our {ours.num_blocks}"
                )
        return None

    def head_slices(self, other: KVLayout) -> tuple[HeadSlice | None, HeadSlice | None]:
        """The heads (of ours, of the peer's) that blocks exchanged with ``other`` carry; None:
        all. ``ValueError`` when the shards cannot exchange (``tp.exchange_slices``)."""
        return exchange_slices(self, other)

    def block_runs(self, layer: int, heads: HeadSlice | None) -> tuple[tuple[int, int], ...]:
        """Layer ``layer``'s runs per block restricted to ``heads`` (aux layers: whole rows)."""
        if layer >= self.num_kv_layers:
            heads = None
        return sliced_runs(self.layers[layer], self.kv_heads, heads)

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


def _head_bytes(
    sub_shape: list[int], sub_strides: list[int], head_dim: int, itemsize: int, runs: list[tuple]
) -> int:
    """Bytes of one head inside each run when the heads (dim ``head_dim`` of the block's own
    sub-tensor) are outermost in every run, else 0: then a head range is one sub-run of each
    run. Derived from the strides: the runs of a one-head slice must start where the runs do
    and tile them ``heads`` times."""
    heads = sub_shape[head_dim]
    one_head = list(sub_shape)
    one_head[head_dim] = 1
    head_runs = _contiguous_runs(one_head, sub_strides, itemsize)
    if len(head_runs) != len(runs):
        return 0
    head_bytes = head_runs[0][1]
    if heads > 1 and sub_strides[head_dim] * itemsize != head_bytes:
        return 0
    for (head_offset, head_len), (offset, length) in zip(head_runs, runs, strict=True):
        if head_offset != offset or head_len != head_bytes or length != heads * head_bytes:
            return 0
    return head_bytes


def layer_layout_from_tensor(tensor, num_blocks: int, head_dim: int | None = None) -> LayerLayout:
    """Layout of one layer's KV tensor whose block dimension has ``num_blocks`` entries.

    The block dimension is the dim of size ``num_blocks`` with the largest stride (the tensors
    engines use put blocks outermost, possibly after a K/V dim of size 2). ``head_dim`` (the
    tensor's KV-head dimension, when the caller knows it) describes the heads (``head_bytes``).
    """
    shape, strides = list(tensor.shape), list(tensor.stride())
    candidates = [d for d, size in enumerate(shape) if size == num_blocks and d != head_dim]
    if not candidates:
        raise ValueError(f"no dimension of size {num_blocks} (blocks) in KV tensor {shape}")
    block_dim = max(candidates, key=lambda d: strides[d])
    sub_shape = shape[:block_dim] + shape[block_dim + 1 :]
    sub_strides = strides[:block_dim] + strides[block_dim + 1 :]
    itemsize = tensor.element_size()
    runs = _contiguous_runs(sub_shape, sub_strides, itemsize)
    head_bytes = 0
    if head_dim is not None:
        sub_head = head_dim - (head_dim > block_dim)
        head_bytes = _head_bytes(sub_shape, sub_strides, sub_head, itemsize, runs)
    return LayerLayout(
        base_addr=tensor.data_ptr(),
        block_stride=strides[block_dim] * itemsize,
        num_blocks=num_blocks,
        runs=tuple(runs),
        head_bytes=head_bytes,
    )


def kv_layout_from_tensors(
    tensors: Sequence,
    num_blocks: int,
    block_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    *,
    head_dim: int | None = None,
    total_kv_heads: int = 0,
) -> KVLayout:
    """Layout of a KV cache given as one tensor per layer (in layer order); with tensor
    parallelism, of rank ``tp_rank``'s shard. ``head_dim`` (every tensor's KV-head dimension)
    and ``total_kv_heads`` (the model's) describe the heads, which a peer of another TP size
    needs; a layer whose heads are not outermost in its runs leaves them undescribed."""
    if not tensors:
        raise ValueError("no KV tensors to describe")
    device = tensors[0].device
    memory: MemoryKind = "DRAM" if device.type == "cpu" else "VRAM"
    device_id = 0 if device.index is None else int(device.index)
    layers = tuple(layer_layout_from_tensor(t, num_blocks, head_dim) for t in tensors)
    kv_heads = 0
    if head_dim is not None and total_kv_heads and all(layer.head_bytes for layer in layers):
        kv_heads = int(tensors[0].shape[head_dim])
    else:  # undescribed: all or nothing
        layers = tuple(layer.model_copy(update={"head_bytes": 0}) for layer in layers)
        total_kv_heads = 0
    return KVLayout(
        block_size=block_size,
        memory=memory,
        device_id=device_id,
        layers=layers,
        tp_size=tp_size,
        tp_rank=tp_rank,
        kv_heads=kv_heads,
        total_kv_heads=total_kv_heads,
    )
