"""Head slicing over real NIXL: a prefill shard of TP 1 (4 KV heads) and the two ranks of a
decode server of TP 2 (2 heads each), three ``KVAgent`` s in this process over UCX. Each D rank
gets exactly its heads of every block, by P's WRITE (push: P's descriptors address a sub-run of
its blocks) and by D's READ (pull: D's descriptors address the sub-run of P's), and nothing
else of D's cache is touched. The mapping itself is unit-tested (tests/unit/test_tp_mapping.py);
this checks that NIXL accepts and moves the sliced descriptors.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.integration

LAYERS, NUM_BLOCKS, BLOCK, HEAD_SIZE, HEADS = 2, 8, 16, 32, 4
DEADLINE_S = 60.0  # a bound for failure, not a timing


def _shard(tp: int, rank: int, seed: int | None):
    import torch

    from splitserve.transfer.layout import kv_layout_from_tensors
    from splitserve.transfer.tp import heads_of_rank

    heads = len(heads_of_rank(HEADS, tp, rank))
    shape = (NUM_BLOCKS, heads, BLOCK, HEAD_SIZE)  # vLLM's per-layer [B, H, N, C]
    if seed is None:
        cache = [torch.full(shape, -1.0) for _ in range(LAYERS)]
    else:
        gen = torch.Generator().manual_seed(seed)
        cache = [torch.rand(shape, generator=gen) for _ in range(LAYERS)]
    layout = kv_layout_from_tensors(
        cache, NUM_BLOCKS, BLOCK, tp, rank, head_dim=1, total_kv_heads=HEADS
    )
    return cache, layout


def _settle(agent, handles) -> None:
    end = time.monotonic() + DEADLINE_S
    while handles:
        handles, failed = agent.settle(handles)
        assert not failed, f"transfer failed: {failed}"
        assert time.monotonic() < end, "transfer did not complete"
        time.sleep(0.005)


@pytest.mark.parametrize("operation", ["WRITE", "READ"])
def test_each_decode_rank_gets_exactly_its_heads(operation):
    from splitserve.transfer.agent import KVAgent

    p_cache, p_layout = _shard(1, 0, seed=5)
    p_agent = KVAgent(f"p-{operation}", p_layout)
    blocks = [1, 4, 6]  # D asks for some blocks: the others must stay untouched
    dst = [0, 2, 7]
    try:
        for rank in (0, 1):
            d_cache, d_layout = _shard(2, rank, seed=None)
            d_agent = KVAgent(f"d{rank}-{operation}", d_layout)
            try:
                layers = [layer for layer in range(LAYERS) for _ in blocks]
                if operation == "WRITE":
                    name = p_agent.add_peer(d_agent.metadata(), d_layout)
                    # D's side must call into NIXL too (its receiver polls; here a hold), else
                    # the connection's wire-up between two agents never completes
                    d_agent.hold_progress(urgent=True)
                    try:
                        handle = p_agent.post("WRITE", name, layers, blocks * LAYERS, dst * LAYERS)
                        _settle(p_agent, [handle])
                    finally:
                        d_agent.drop_progress(urgent=True)
                else:
                    d_agent.add_peer(p_agent.metadata(), p_layout)  # P's agent is loaded
                    p_agent.hold_progress(urgent=True)  # over cma the READ completes on P's call
                    try:
                        handle = d_agent.post(
                            "READ", p_agent.name, layers, dst * LAYERS, blocks * LAYERS
                        )
                        _settle(d_agent, [handle])
                    finally:
                        p_agent.drop_progress(urgent=True)
                head_bytes = BLOCK * HEAD_SIZE * 4
                assert handle.num_bytes == len(layers) * 2 * head_bytes, "D's heads only"
                heads = slice(2 * rank, 2 * rank + 2)
                for layer in range(LAYERS):
                    for b in range(NUM_BLOCKS):
                        got = d_cache[layer][b]
                        if b in dst:
                            want = p_cache[layer][blocks[dst.index(b)], heads]
                            assert got.equal(want), f"rank {rank} layer {layer} block {b}"
                        else:
                            assert bool((got == -1.0).all()), f"block {b} touched"
            finally:
                d_agent.close()
    finally:
        p_agent.close()
