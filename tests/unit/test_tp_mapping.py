"""Heterogeneous tensor parallelism, pure logic: which heads each rank holds, which prefill
ranks a decode rank dials, which sizes are refused (both named), and the NIXL descriptors of a
head sub-run: copied descriptor by descriptor (NIXL's job, done here with ctypes on real
tensors), they give each decode rank exactly its heads, from one prefill rank (D wider) or
from several (P wider).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.connectors.vllm.ranks import fed_ranks, share_id, source_ranks
from splitserve.transfer.agent import _DescriptorIndex
from splitserve.transfer.layout import KVLayout, kv_layout_from_tensors
from splitserve.transfer.tp import HeadSlice, exchange_slices, heads_of_rank, tp_mismatch

NUM_BLOCKS, BLOCK, HEAD_SIZE, LAYERS = 6, 4, 8, 2


def _cache(heads: int, fill: range | None = None) -> list[torch.Tensor]:
    """One layer per entry, vLLM's logical [B, H, N, C] view; with ``fill``, every element of
    head h is a value that names (layer, block, global head, position)."""
    tensors = []
    for layer in range(LAYERS):
        t = torch.zeros(NUM_BLOCKS, heads, BLOCK, HEAD_SIZE, dtype=torch.float32)
        if fill is not None:
            for b in range(NUM_BLOCKS):
                for i, h in enumerate(fill):
                    base = layer * 1e6 + b * 1e4 + h * 1e2
                    t[b, i] = base + torch.arange(BLOCK * HEAD_SIZE).reshape(BLOCK, HEAD_SIZE)
        tensors.append(t)
    return tensors


def _shard(total: int, tp: int, rank: int, filled: bool = False):
    heads = heads_of_rank(total, tp, rank)
    cache = _cache(len(heads), heads if filled else None)
    layout = kv_layout_from_tensors(
        cache, NUM_BLOCKS, BLOCK, tp, rank, head_dim=1, total_kv_heads=total
    )
    return cache, layout


# -- heads and ranks ---------------------------------------------------------------------------


def test_heads_of_rank_split_and_replicate_as_vllm_does():
    assert [heads_of_rank(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert heads_of_rank(1, 4, 3) == range(0, 1)
    with pytest.raises(ValueError, match="do not divide"):
        heads_of_rank(6, 4, 0)


@pytest.mark.parametrize(
    ("p", "d", "sources"),
    [
        (1, 1, [[0]]),
        (2, 2, [[0], [1]]),
        (1, 2, [[0], [0]]),
        (2, 4, [[0], [0], [1], [1]]),
        (1, 4, [[0]] * 4),
        (2, 1, [[0, 1]]),
        (4, 2, [[0, 1], [2, 3]]),
        (4, 1, [[0, 1, 2, 3]]),
    ],
)
def test_decode_rank_dials_the_prefill_ranks_holding_its_heads(p, d, sources):
    assert [source_ranks(p, d, j) for j in range(d)] == sources
    for i in range(p):
        assert fed_ranks(p, d, i) == [j for j in range(d) if i in sources[j]]
    for total in (4, 8):  # the sources' heads make up exactly the decode rank's
        for j in range(d):
            mine = heads_of_rank(total, d, j)
            theirs = {h for i in source_ranks(p, d, j, total) for h in heads_of_rank(total, p, i)}
            if p <= d:
                assert set(mine) <= theirs
            else:
                assert set(mine) == theirs


@pytest.mark.parametrize(("total", "p", "d"), [(2, 4, 2), (2, 4, 1), (1, 4, 2), (1, 2, 1)])
def test_replicated_heads_on_a_wider_prefill_come_from_one_rank_each(total, p, d):
    """A P rank that only repeats a head an earlier source sends feeds nobody: no two shares
    ever write the same bytes of D's blocks."""
    for j in range(d):
        chosen = source_ranks(p, d, j, total)
        firsts = [heads_of_rank(total, p, i).start for i in chosen]
        assert len(set(firsts)) == len(firsts)
        assert set(firsts) == set(heads_of_rank(total, d, j))
    fed = [fed_ranks(p, d, i, total) for i in range(p)]
    assert sum(len(f) for f in fed) == sum(len(source_ranks(p, d, j, total)) for j in range(d))
    assert any(f == [] for f in fed), "some P rank only repeats a replicated head"


def test_share_ids_name_the_pair():
    assert share_id("t", 2, 2, 1, 1) == "t", "equal sizes: the plain id"
    assert [share_id("t", 1, 2, j, 0) for j in range(2)] == ["t@d0", "t@d1"]
    assert [share_id("t", 2, 1, 0, i) for i in range(2)] == ["t@p0", "t@p1"]
    long = "x" * 128  # the longest id the params accept: its shares still fit a message
    shares = {share_id(long, 1, 4, j, 0) for j in range(4)}
    assert len(shares) == 4 and all(len(s) <= 128 for s in shares)
    assert share_id(long, 1, 4, 3, 0) == share_id(long, 1, 4, 3, 0), "both sides agree"


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 2), (1, 2), (2, 4), (1, 4), (2, 1), (4, 2)])
def test_supported_sizes_are_not_refused(p, d):
    assert tp_mismatch(p, d) is None
    assert tp_mismatch(p, d, total_kv_heads=8) is None
    assert tp_mismatch(p, d, total_kv_heads=1) is None  # replicated on every rank


@pytest.mark.parametrize(
    ("p", "d", "heads", "why"),
    [
        (2, 3, None, "neither size is a multiple"),
        (6, 4, 12, "neither size is a multiple"),
        (1, 4, 6, "6 KV heads do not divide over the decode size 4"),
        (4, 4, 6, "do not divide over the prefill size 4"),
    ],
)
def test_refusals_name_both_sizes(p, d, heads, why):
    problem = tp_mismatch(p, d, total_kv_heads=heads)
    assert f"prefill tensor parallel size {p}, decode tensor parallel size {d}" in problem
    assert why in problem
    if heads is None:
        with pytest.raises(ValueError, match=f"prefill tensor parallel size {p}"):
            source_ranks(p, d, 0)


# -- layouts: heads derived from strides --------------------------------------------------------


def test_heads_outermost_in_a_run_are_described():
    _, layout = _shard(8, 2, 1)
    assert layout.kv_heads == 4 and layout.total_kv_heads == 8
    head_bytes = BLOCK * HEAD_SIZE * 4
    assert all(layer.head_bytes == head_bytes for layer in layout.layers)
    assert all(layer.runs == ((0, 4 * head_bytes),) for layer in layout.layers)
    assert KVLayout.model_validate(layout.wire()) == layout


def test_a_kv_dim_outside_the_block_gives_two_runs_each_sliceable():
    cache = [torch.zeros(2, NUM_BLOCKS, 4, BLOCK, HEAD_SIZE)]  # [K/V, B, H, N, C]
    layout = kv_layout_from_tensors(cache, NUM_BLOCKS, BLOCK, head_dim=2, total_kv_heads=4)
    layer = layout.layers[0]
    assert len(layer.runs) == 2 and layer.head_bytes == BLOCK * HEAD_SIZE * 4
    assert [n for _, n in layout.block_runs(0, HeadSlice(1, 2))] == [2 * layer.head_bytes] * 2
    assert layout.block_runs(0, HeadSlice(1, 2))[1][0] == layer.runs[1][0] + layer.head_bytes


def test_heads_inside_the_token_dim_are_left_undescribed():
    """[B, N, H, C] in memory (heads not outermost in the block): a head range is no sub-run, so
    the layout serves equal sizes only, and a peer of another size is refused."""
    physical = torch.zeros(NUM_BLOCKS, BLOCK, 4, HEAD_SIZE)
    cache = [physical.permute(0, 2, 1, 3)]  # the logical [B, H, N, C] view
    layout = kv_layout_from_tensors(cache, NUM_BLOCKS, BLOCK, 2, 0, head_dim=1, total_kv_heads=8)
    assert layout.kv_heads == 0 and layout.layers[0].head_bytes == 0
    _, wide = _shard(8, 1, 0)
    assert "describe their KV heads" in wide.incompatibility(layout)


# -- exchange: which heads each side addresses ---------------------------------------------------


@pytest.mark.parametrize(
    ("total", "p", "d"),
    [
        (8, 1, 1),
        (8, 2, 2),
        (8, 1, 2),
        (8, 2, 4),
        (8, 1, 4),
        (2, 1, 4),
        (2, 2, 4),
        (1, 1, 2),
        (8, 2, 1),
        (8, 4, 2),
        (8, 4, 1),
        (2, 4, 2),
        (2, 4, 1),
    ],
)
def test_each_decode_rank_gets_exactly_its_heads(total, p, d):
    """What NIXL does with the prepared descriptors (index i of P's list to index i of D's),
    done with ctypes on real tensors: every D rank ends with its heads of every block, from
    its one source (D wider: P's side a sub-run) or from each of its sources (P wider: D's
    side a sub-run per source)."""
    layers = np.repeat(np.arange(LAYERS), NUM_BLOCKS)
    blocks = np.tile(np.arange(NUM_BLOCKS), LAYERS)
    for j in range(d):
        d_cache, d_layout = _shard(total, d, j)
        for i in source_ranks(p, d, j, total):
            p_cache, p_layout = _shard(total, p, i, filled=True)  # kept alive for the copy
            assert p_layout.incompatibility(d_layout) is None
            assert d_layout.incompatibility(p_layout) is None
            p_heads, d_heads = exchange_slices(p_layout, d_layout)
            if p < d:
                assert d_heads is None, "the narrower side (D) addresses whole runs"
            if p > d and len(heads_of_rank(total, p, i)) < len(heads_of_rank(total, d, j)):
                assert p_heads is None and d_heads is not None, "D's side is the sub-run"
            assert exchange_slices(d_layout, p_layout) == (d_heads, p_heads), "symmetric"
            src, dst = _DescriptorIndex(p_layout, p_heads), _DescriptorIndex(d_layout, d_heads)
            _copy(src, src.indices(layers, blocks), dst, dst.indices(layers, blocks))
        want = heads_of_rank(total, d, j)
        expected = _cache(len(want), want)
        for got, exp in zip(d_cache, expected, strict=True):
            assert torch.equal(got, exp), f"D rank {j} of {d} from P of {p}"


def _copy(src: _DescriptorIndex, src_idx, dst: _DescriptorIndex, dst_idx) -> None:
    """Copy descriptor ``src_idx[n]`` to ``dst_idx[n]``: lengths must match (NIXL requires it)."""
    import ctypes

    s_rows, d_rows = src.descriptors(), dst.descriptors()
    assert len(src_idx) == len(dst_idx)
    for a, b in zip(src_idx, dst_idx, strict=True):
        (s_addr, s_len, _), (d_addr, d_len, _) = s_rows[a], d_rows[b]
        assert s_len == d_len
        ctypes.memmove(int(d_addr), int(s_addr), int(s_len))


def test_wrong_prefill_rank_is_refused_naming_both_shards():
    _, p_layout = _shard(8, 2, 1)
    _, d_layout = _shard(8, 4, 0)  # holds heads 0..1, P rank 1 holds 4..7
    problem = d_layout.incompatibility(p_layout)
    assert "tensor parallel size 4 here, 2 at the peer" in problem
    assert "heads 0..1" in problem and "4..7" in problem


def test_a_peer_of_another_model_is_refused():
    _, p_layout = _shard(8, 1, 0)
    _, d_layout = _shard(4, 2, 0)
    assert "8 KV heads here, 4 at the peer" in p_layout.incompatibility(d_layout)


def test_a_peer_declaring_a_wrong_share_is_refused():
    _, p_layout = _shard(8, 1, 0)
    _, d_layout = _shard(8, 2, 0)
    lying = d_layout.model_copy(update={"total_kv_heads": 8, "kv_heads": 2})
    lying = KVLayout.model_validate(
        {
            **lying.model_dump(),
            "layers": [
                {**layer.model_dump(), "runs": ((0, 2 * layer.head_bytes),)}
                for layer in lying.layers
            ],
        }
    )
    assert "declares 2 KV heads, its share of 8 is 4" in p_layout.incompatibility(lying)


# -- HELLO on P: sizes that cannot pair are refused ----------------------------------------------


@pytest.mark.parametrize(
    ("p", "d", "refused"), [(1, 2, False), (2, 1, False), (2, 2, False), (2, 3, True)]
)
def test_prefill_refuses_a_hello_of_a_size_that_cannot_pair(p, d, refused):
    """Sizes neither a multiple of the other: the HELLO is refused with both sizes named
    before any agent is loaded."""
    from fakes import FakeChannel

    from splitserve.transfer import messages
    from splitserve.transfer.peering import PeerAdmission
    from splitserve.transfer.side_channel import PeerRef

    _, p_layout = _shard(12, p, 0)
    _, d_layout = _shard(12, d, 0)
    added = []
    agent = type("Agent", (), {})()
    agent.layout = p_layout
    agent.add_peer = lambda metadata, layout: added.append(layout) or "D"
    channel = FakeChannel()
    peers = PeerAdmission(agent, channel, lambda _: messages.HelloAck(agent_name="P"), list)
    hello = messages.Hello(agent_name="D", agent_metadata=b"m", layout=d_layout.wire())
    peers.on_hello(PeerRef(inbound=b"c1"), hello)
    if refused:
        assert added == [] and peers.admitted == 0
        text = str(channel.sent)
        assert f"prefill tensor parallel size {p}, decode tensor parallel size {d}" in text
    else:
        assert added == [d_layout] and peers.admitted == 1
