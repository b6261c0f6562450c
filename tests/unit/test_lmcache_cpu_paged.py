"""The CPU shim's copies against vLLM's own CPU KV layout: vLLM's ``cpu_attn_reshape_and_cache``
kernel writes the tokens, the shim must read back exactly what was written, and what the shim
writes must read back through the same views vLLM's attention uses.

LMCache changes this process's environment (its metrics logger sets
``PROMETHEUS_MULTIPROC_DIR``): the module puts it back when it ends
(``restore_process_environment``), or every in-process proxy of a later test serves its
metrics from files.
"""

from __future__ import annotations

import lmcache  # noqa: F401
import pytest
import torch
import vllm.v1.attention.backends.cpu_attn as vllm_attn

from splitserve.connectors.lmcache.cpu_paged import CpuPagedKV  # noqa: E402

pytestmark = pytest.mark.usefixtures("restore_process_environment")

LAYERS, HEADS, HEAD_SIZE, BLOCK, BLOCKS = 3, 2, 64, 32, 6


def _caches() -> list:
    # vLLM's CPU cache tensor per layer: [blocks, heads, block_size, 2 * head_size].
    return [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) for _ in range(LAYERS)]


def _vllm_write(cache, key, value, slots) -> None:
    """What vLLM's CPU attention does to store a step's K and V."""
    from vllm import _custom_ops as ops

    view = cache.view(BLOCKS, HEADS, BLOCK * 2, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    isa = vllm_attn._get_attn_isa(torch.float32, BLOCK, HEAD_SIZE)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def _slots(n: int) -> torch.Tensor:
    # Non-contiguous blocks (4, 1, 5) and a partial last block, as vLLM hands them out.
    blocks = [4, 1, 5]
    return torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)])


def test_gather_reads_what_vllm_kernel_wrote() -> None:
    caches, n = _caches(), 70
    slots = _slots(n)
    keys = torch.randn(LAYERS, n, HEADS, HEAD_SIZE)
    values = torch.randn(LAYERS, n, HEADS, HEAD_SIZE)
    for i, cache in enumerate(caches):
        _vllm_write(cache, keys[i], values[i], slots)
    got = CpuPagedKV(LAYERS, HEADS, HEAD_SIZE).gather(caches, slots)
    assert got.shape == (2, LAYERS, n, HEADS * HEAD_SIZE)
    assert torch.equal(got[0], keys.flatten(2))
    assert torch.equal(got[1], values.flatten(2))


def test_scatter_writes_what_vllm_kernel_writes() -> None:
    n = 45
    slots = _slots(n)
    keys = torch.randn(LAYERS, n, HEADS, HEAD_SIZE)
    values = torch.randn(LAYERS, n, HEADS, HEAD_SIZE)
    by_kernel, by_shim = _caches(), _caches()
    for i, cache in enumerate(by_kernel):
        _vllm_write(cache, keys[i], values[i], slots)
    kv = CpuPagedKV(LAYERS, HEADS, HEAD_SIZE)
    kv.scatter(by_shim, slots, torch.stack([keys.flatten(2), values.flatten(2)]))
    for shim_layer, kernel_layer in zip(by_shim, by_kernel, strict=True):
        assert torch.equal(shim_layer, kernel_layer)  # byte for byte, untouched slots still 0


def test_bf16_amx_packing_is_refused_not_guessed(monkeypatch) -> None:
    from splitserve.connectors.lmcache import cpu_paged

    monkeypatch.setattr(vllm_attn, "_get_attn_isa", lambda *a, **k: "amx")
    with pytest.raises(ValueError, match="amx"):
        cpu_paged.check_isa(_caches()[0], HEAD_SIZE)


def test_wrong_head_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU layout"):
        CpuPagedKV(LAYERS, HEADS + 1, HEAD_SIZE).gather(_caches(), _slots(4))
