"""KV-cache size arithmetic: bytes per token, per layer slice, per request.

Pure functions over a ``ModelShape``; runs in the caller's process.

Formulas (docs/planner.md derives them):
- standard / grouped-query attention: K and V per token per layer =
  ``2 * num_kv_heads * head_dim * dtype_bytes``;
- multi-head latent attention (MLA): one latent per token per layer =
  ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``;
- per token = per token per layer * num_layers; a layer slice of a request =
  per token per layer * tokens; a request = per token * tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.planner.catalog import ModelShape, PlannerInputError

KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(kv_dtype: str) -> int:
    """Bytes per element of a KV dtype name (fp32, bf16, fp16, fp8)."""
    try:
        return KV_DTYPE_BYTES[kv_dtype.lower()]
    except KeyError:
        raise PlannerInputError(
            f"unknown KV dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPE_BYTES)}"
        ) from None


def kv_elements_per_token_per_layer(model: ModelShape) -> int:
    """Cached elements one token adds to one layer."""
    if model.is_mla:
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.num_kv_heads * model.head_dim


def kv_bytes_per_token_per_layer(model: ModelShape, kv_dtype: str) -> int:
    return kv_elements_per_token_per_layer(model) * dtype_bytes(kv_dtype)


def kv_bytes_per_token(model: ModelShape, kv_dtype: str) -> int:
    return kv_bytes_per_token_per_layer(model, kv_dtype) * model.num_layers


@dataclass(frozen=True)
class KvSizes:
    """KV bytes of one request of ``tokens`` tokens."""

    kv_dtype: str
    tokens: int
    bytes_per_token: int
    bytes_per_token_per_layer: int
    layer_slice_bytes: int
    request_bytes: int


def kv_sizes(model: ModelShape, kv_dtype: str, tokens: int) -> KvSizes:
    if tokens < 0:
        raise PlannerInputError(f"tokens must be >= 0, got {tokens}")
    per_layer = kv_bytes_per_token_per_layer(model, kv_dtype)
    return KvSizes(
        kv_dtype=kv_dtype.lower(),
        tokens=tokens,
        bytes_per_token=per_layer * model.num_layers,
        bytes_per_token_per_layer=per_layer,
        layer_slice_bytes=per_layer * tokens,
        request_bytes=per_layer * model.num_layers * tokens,
    )
