"""Tensor parallel head mapping: which KV heads two shards of different TP sizes exchange.

Pure (no engine, no NIXL). vLLM shards a model's ``K`` KV heads over TP size ``t`` this way
(``QKVParallelLinear``): when ``K >= t`` rank ``r`` holds the ``K / t`` heads starting at
``r * K / t``; when ``K < t`` every head is replicated over ``t / K`` ranks and rank ``r`` holds
head ``r // (t / K)``. vLLM itself refuses a ``t`` that neither divides nor is divided by
``K``.

Between a prefill server of size ``p`` and a decode server of size ``d`` (docs/connector-
protocol.md, "Ranks"):
- ``p == d``: rank ``r`` exchanges with rank ``r``, whole blocks (as without TP).
- ``d == k * p`` (D wider): D rank ``j`` holds a subset of P rank ``j // k``'s heads; in each
  per-block byte run of P (heads outermost inside it) they are one contiguous sub-run. P rank
  ``i`` feeds the ``k`` D ranks ``i * k .. i * k + k - 1``; the NIXL descriptors of P's side
  address only the sub-run (``HeadSlice``), D's side its whole runs: no staging copy.
- ``p == k * d`` (P wider): D rank ``j`` holds the heads of P ranks ``j * k .. j * k + k - 1``;
  each of them fills one sub-run of each of D's runs, D's side of the descriptors addressing
  that sub-run. The connector completes D's load once every such share arrived.

Invariants:
- ``exchange_slices`` answers a slice only when one shard's heads lie inside the other's, so a
  copy never mixes heads of different ranks; anything else is refused with both sides named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.transfer.layout import KVLayout, LayerLayout


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``first .. first + count - 1`` of a shard's own heads (not global head ids)."""

    first: int
    count: int


def heads_divisible(total_kv_heads: int, tp_size: int) -> bool:
    """vLLM's own rule: the heads split evenly over the ranks, or each is replicated evenly."""
    if total_kv_heads >= tp_size:
        return total_kv_heads % tp_size == 0
    return tp_size % total_kv_heads == 0


def heads_of_rank(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads rank ``rank`` of TP size ``tp_size`` holds (see module docstring)."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tensor parallel size {tp_size}")
    if not heads_divisible(total_kv_heads, tp_size):
        raise ValueError(
            f"{total_kv_heads} KV heads do not divide over tensor parallel size {tp_size}"
        )
    if total_kv_heads >= tp_size:
        per = total_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


def tp_mismatch(prefill_tp: int, decode_tp: int, total_kv_heads: int | None = None) -> str | None:
    """Why a prefill server of TP size ``prefill_tp`` cannot feed a decode server of size
    ``decode_tp`` (None when it can), both sizes named: for start-up checks, D's scheduler half
    and HELLO. ``total_kv_heads`` (the model's, when known) adds the heads check."""
    sizes = f"prefill tensor parallel size {prefill_tp}, decode tensor parallel size {decode_tp}"
    if total_kv_heads is not None:
        for what, size in (("prefill", prefill_tp), ("decode", decode_tp)):
            if not heads_divisible(total_kv_heads, size):
                return (
                    f"{sizes}: the model's {total_kv_heads} KV heads do not divide over the "
                    f"{what} size {size} (nor does {size} divide by them)"
                )
    if decode_tp % prefill_tp == 0 or prefill_tp % decode_tp == 0:
        return None
    return f"{sizes}: neither size is a multiple of the other"


def exchange_slices(mine: KVLayout, peer: KVLayout) -> tuple[HeadSlice | None, HeadSlice | None]:
    """Which of its own heads each side's descriptors address when ``mine`` and ``peer``
    exchange blocks (``None``: all of them, whole runs). Raises ``ValueError`` naming both
    shards when they cannot exchange (different ranks of one size, heads not described,
    neither shard's heads inside the other's)."""
    if mine.tp_size == peer.tp_size:
        if mine.tp_rank != peer.tp_rank:
            raise ValueError(
                f"tensor parallel rank {mine.tp_rank} here, {peer.tp_rank} at the peer (of size "
                f"{mine.tp_size}): rank r talks only to rank r (side channel port base + r)"
            )
        return None, None
    sizes = f"tensor parallel size {mine.tp_size} here, {peer.tp_size} at the peer"
    if not (mine.total_kv_heads and peer.total_kv_heads and mine.kv_heads and peer.kv_heads):
        raise ValueError(
            f"{sizes}: different sizes need both layouts to describe their KV heads "
            "(kv_heads, total_kv_heads, head_bytes)"
        )
    if mine.total_kv_heads != peer.total_kv_heads:
        raise ValueError(
            f"{sizes}: {mine.total_kv_heads} KV heads here, {peer.total_kv_heads} at the peer"
        )
    total = mine.total_kv_heads
    try:
        here = heads_of_rank(total, mine.tp_size, mine.tp_rank)
        there = heads_of_rank(total, peer.tp_size, peer.tp_rank)
    except ValueError as exc:
        raise ValueError(f"{sizes}: {exc}") from None
    for layout, heads, where in ((mine, here, "here"), (peer, there, "at the peer")):
        if layout.kv_heads != len(heads):
            raise ValueError(
                f"{sizes}: rank {layout.tp_rank} {where} declares {layout.kv_heads} KV heads, "
                f"its share of {total} is {len(heads)}"
            )
    if here == there:  # e.g. replicated heads: whole runs on both sides
        return None, None
    if there.start >= here.start and there.stop <= here.stop:
        return HeadSlice(there.start - here.start, len(there)), None
    if here.start >= there.start and here.stop <= there.stop:
        return None, HeadSlice(here.start - there.start, len(here))
    raise ValueError(
        f"{sizes}: rank {mine.tp_rank} here holds KV heads {here.start}..{here.stop - 1}, rank "
        f"{peer.tp_rank} at the peer {there.start}..{there.stop - 1}: neither inside the other "
        "(a decode rank dials prefill rank decode_rank // (decode size / prefill size))"
    )


def sliced_runs(
    layer: LayerLayout, kv_heads: int, heads: HeadSlice | None
) -> tuple[tuple[int, int], ...]:
    """The byte runs of one block of ``layer`` holding only ``heads`` (all runs when None).

    Each run of a sliceable layer is ``kv_heads`` heads of ``head_bytes`` each, heads
    outermost (``KVLayout`` checks this), so a head range is one sub-run of every run."""
    if heads is None:
        return layer.runs
    if layer.head_bytes <= 0:
        raise ValueError("this layer's heads are not contiguous sub-runs of its block runs")
    if heads.first < 0 or heads.count <= 0 or heads.first + heads.count > kv_heads:
        raise ValueError(f"heads {heads} outside the shard's {kv_heads}")
    hb = layer.head_bytes
    return tuple((offset + heads.first * hb, heads.count * hb) for offset, _ in layer.runs)
