"""Catalogs the planner plans from: model shapes, accelerators and interconnects.

Runs in whatever process calls the planner (the ``splitserve plan`` CLI, a notebook, a test).
Pure data plus lookup: no engine import, no I/O except reading a Hugging Face ``config.json``.

Invariants:
- every figure is a published one, cited beside it; a figure the vendor quotes "with sparsity"
  is halved to the dense value, because prefill GEMMs are dense;
- bandwidths are bytes per second and FLOP/s are per second, in SI units (1 GB = 1e9 bytes);
- a lookup of an unknown name raises ``PlannerInputError`` naming the input and the choices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class PlannerInputError(ValueError):
    """A bad planner input (unknown name, missing field, negative number); the message names it."""


class ModelShape(BaseModel):
    """The shapes of a decoder-only transformer that the arithmetic needs.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``. Mixture-of-experts models
    give ``num_experts`` > 0 (experts per MoE layer), ``experts_per_token`` and
    ``moe_intermediate_size``; ``dense_layers`` leading layers keep a dense MLP (DeepSeek's
    ``first_k_dense_replace``). Multi-head latent attention (DeepSeek-V2/V3) gives
    ``kv_lora_rank`` and the ``qk_*``/``v_head_dim`` sizes; it caches one latent vector of
    ``kv_lora_rank + qk_rope_head_dim`` per token per layer instead of K and V.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    num_experts: int = Field(0, ge=0)
    experts_per_token: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    shared_expert_intermediate_size: int = Field(0, ge=0)
    dense_layers: int = Field(0, ge=0)
    kv_lora_rank: int = Field(0, ge=0)
    q_lora_rank: int = Field(0, ge=0)
    qk_nope_head_dim: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ModelShape:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError("experts_per_token must be between 1 and num_experts")
            if not self.moe_intermediate_size:
                raise ValueError("moe_intermediate_size is required with num_experts")
        if self.kv_lora_rank and not (self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError("kv_lora_rank (MLA) needs qk_rope_head_dim and v_head_dim")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0


def _llama_like(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    head_dim: int | None = None,
    **extra: int,
) -> ModelShape:
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        intermediate_size=inter,
        vocab_size=vocab,
        **extra,
    )


# Published shapes: the `config.json` of each model's official Hugging Face repository.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # meta-llama/Llama-3.2-1B
        _llama_like("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, head_dim=64),
        # meta-llama/Llama-3.1-8B
        _llama_like("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256),
        # meta-llama/Llama-3.1-70B
        _llama_like("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256),
        # meta-llama/Llama-3.1-405B
        _llama_like("Llama-3.1-405B", 126, 16384, 128, 8, 53248, 128256),
        # Qwen/Qwen2.5-7B-Instruct
        _llama_like("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064),
        # Qwen/Qwen2.5-72B-Instruct
        _llama_like("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064),
        # mistralai/Mistral-7B-Instruct-v0.3
        _llama_like("Mistral-7B", 32, 4096, 32, 8, 14336, 32768),
        # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336, top-2 routing
        _llama_like(
            "Mixtral-8x7B",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            num_experts=8,
            experts_per_token=2,
            moe_intermediate_size=14336,
        ),
        # deepseek-ai/DeepSeek-V2-Lite: MLA (kv_lora_rank 512, rope 64, nope 128, v 128, no
        # q_lora), 64 routed experts of 1408 + 2 shared, top-6, first layer dense (10944)
        ModelShape(
            name="DeepSeek-V2-Lite",
            num_layers=27,
            hidden_size=2048,
            num_attention_heads=16,
            num_kv_heads=16,
            head_dim=192,
            intermediate_size=10944,
            vocab_size=102400,
            num_experts=64,
            experts_per_token=6,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=2 * 1408,
            dense_layers=1,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        # This project's own test models (splitserve.models presets `bench`, `mid`, `tiny`).
        _llama_like("splitserve-bench", 16, 512, 16, 16, 1024, 1024, head_dim=128),
        _llama_like("splitserve-mid", 8, 768, 8, 4, 1536, 1024, head_dim=96),
        _llama_like("splitserve-tiny", 4, 256, 4, 2, 512, 1024, head_dim=64),
    )
}


class Accelerator(BaseModel):
    """One accelerator (or one measured machine): dense BF16 peak, memory bandwidth, capacity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bf16_flops: float = Field(gt=0, description="dense BF16 FLOP/s")
    mem_bytes_per_s: float = Field(gt=0, description="HBM (or DRAM) bytes/s")
    mem_bytes: float = Field(gt=0, description="memory capacity in bytes")
    source: str = ""

    @property
    def ridge_flop_per_byte(self) -> float:
        """FLOP per byte above which a kernel is compute-bound (the roofline's ridge point)."""
        return self.bf16_flops / self.mem_bytes_per_s


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity);
        # A100 80GB SXM: 2,039 GB/s HBM2e.
        Accelerator(
            name="A100",
            bf16_flops=312e12,
            mem_bytes_per_s=2.039e12,
            mem_bytes=80e9,
            source="NVIDIA A100 datasheet (80GB SXM)",
        ),
        # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS *with
        # sparsity* -> 989.5 dense; 3.35 TB/s HBM3; 80 GB. Ridge 989.5e12 / 3.35e12 = 295.
        Accelerator(
            name="H100",
            bf16_flops=989.5e12,
            mem_bytes_per_s=3.35e12,
            mem_bytes=80e9,
            source="NVIDIA H100 datasheet (SXM)",
        ),
        # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 1,979 TFLOPS with sparsity ->
        # 989.5 dense; 4.8 TB/s HBM3e; 141 GB.
        Accelerator(
            name="H200",
            bf16_flops=989.5e12,
            mem_bytes_per_s=4.8e12,
            mem_bytes=141e9,
            source="NVIDIA H200 datasheet (SXM)",
        ),
        # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training / 8 GPUs; HGX B200: FP16/BF16 Tensor
        # Core 36 PFLOPS with sparsity per 8 GPUs -> 2.25 PFLOPS dense per GPU; HBM3e 8 TB/s;
        # 1,440 GB per 8 GPUs -> 180 GB.
        Accelerator(
            name="B200",
            bf16_flops=2.25e15,
            mem_bytes_per_s=8e12,
            mem_bytes=180e9,
            source="NVIDIA HGX/DGX B200 datasheet",
        ),
    )
}


class Link(BaseModel):
    """A KV-transfer path between a prefill and a decode replica, in bytes/s per GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bytes_per_s: float = Field(gt=0)
    per_transfer_s: float = Field(0.0, ge=0, description="fixed cost of one transfer")
    source: str = ""


LINKS: dict[str, Link] = {
    k.name: k
    for k in (
        # NVIDIA H100 datasheet: "NVLink: 900GB/s" per GPU (18 links x 50 GB/s, both directions
        # together). The textbook uses the headline figure; one direction is half of it.
        Link(name="NVLink4", bytes_per_s=900e9, source="NVIDIA H100 datasheet"),
        # NVIDIA B200 datasheet: fifth-generation NVLink 1.8 TB/s per GPU.
        Link(name="NVLink5", bytes_per_s=1800e9, source="NVIDIA B200 datasheet"),
        # PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes = 64 GB/s per direction (before 128b/130b).
        Link(name="PCIe5", bytes_per_s=64e9, source="PCI-SIG PCIe 5.0 x16, one direction"),
        Link(name="PCIe4", bytes_per_s=32e9, source="PCI-SIG PCIe 4.0 x16, one direction"),
        # InfiniBand Trade Association / NVIDIA ConnectX: HDR100 100 Gb/s, HDR 200 Gb/s, NDR
        # 400 Gb/s per port -> / 8 bits per byte.
        Link(name="HDR100", bytes_per_s=12.5e9, source="InfiniBand HDR100, 100 Gb/s"),
        Link(name="HDR", bytes_per_s=25e9, source="InfiniBand HDR, 200 Gb/s"),
        Link(name="NDR", bytes_per_s=50e9, source="InfiniBand NDR, 400 Gb/s"),
        # IEEE 802.3 line rates.
        Link(name="100GbE", bytes_per_s=12.5e9, source="Ethernet 100 Gb/s"),
        Link(name="25GbE", bytes_per_s=3.125e9, source="Ethernet 25 Gb/s"),
    )
}


def _lookup(kind: str, name: str, table: dict[str, Any]) -> Any:
    by_lower = {k.lower(): v for k, v in table.items()}
    found = by_lower.get(name.lower())
    if found is None:
        raise PlannerInputError(f"unknown {kind} {name!r}; choose one of: {', '.join(table)}")
    return found


def get_accelerator(name: str) -> Accelerator:
    return _lookup("GPU", name, ACCELERATORS)


def get_link(name: str) -> Link:
    return _lookup("link", name, LINKS)


def custom_link(gb_per_s: float, name: str | None = None) -> Link:
    """A link of ``gb_per_s`` GB/s (1e9 bytes/s)."""
    if not gb_per_s > 0:
        raise PlannerInputError(f"link bandwidth must be a positive GB/s figure, got {gb_per_s}")
    return Link(
        name=name or f"custom {gb_per_s:g} GB/s",
        bytes_per_s=gb_per_s * 1e9,
        source="given by the user",
    )


def get_model(name_or_path: str) -> ModelShape:
    """A catalog model by name (case-insensitive), else a ``config.json`` path (or its folder)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return model_from_hf_config(path)
    if name_or_path.lower().endswith(".json") or "/" in name_or_path:
        raise PlannerInputError(f"model config {name_or_path!r} does not exist")
    return _lookup("model", name_or_path, MODELS)


def _need(cfg: dict[str, Any], path: Path, *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise PlannerInputError(f"{path}: config.json has no {' / '.join(keys)}")


def model_from_hf_config(path: str | Path) -> ModelShape:
    """Read the shapes from a Hugging Face ``config.json`` (Llama, Qwen, Mistral, Mixtral,
    DeepSeek-V2/V3 key names); a missing or wrong field raises ``PlannerInputError`` naming it."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlannerInputError(f"cannot read model config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise PlannerInputError(f"{path}: config.json is not a JSON object")
    cfg = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg.get("text_config"), dict) else cfg
    heads = _need(cfg, path, "num_attention_heads", "n_head")
    hidden = _need(cfg, path, "hidden_size", "n_embd", "d_model")
    fields: dict[str, Any] = {
        "name": str(cfg.get("_name_or_path") or path.parent.name or path.name),
        "num_layers": _need(cfg, path, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "intermediate_size": _need(cfg, path, "intermediate_size", "ffn_dim", "n_inner"),
        "vocab_size": _need(cfg, path, "vocab_size"),
    }
    head_dim = cfg.get("head_dim")
    experts = (
        cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    )
    if experts:
        fields["num_experts"] = experts
        fields["experts_per_token"] = _need(cfg, path, "num_experts_per_tok")
        fields["moe_intermediate_size"] = (
            cfg.get("moe_intermediate_size") or fields["intermediate_size"]
        )
        shared = cfg.get("shared_expert_intermediate_size") or 0
        if cfg.get("n_shared_experts"):
            shared = cfg["n_shared_experts"] * fields["moe_intermediate_size"]
        fields["shared_expert_intermediate_size"] = shared
        fields["dense_layers"] = cfg.get("first_k_dense_replace") or 0
    if cfg.get("kv_lora_rank"):
        fields["kv_lora_rank"] = cfg["kv_lora_rank"]
        fields["q_lora_rank"] = cfg.get("q_lora_rank") or 0
        fields["qk_nope_head_dim"] = _need(cfg, path, "qk_nope_head_dim")
        fields["qk_rope_head_dim"] = _need(cfg, path, "qk_rope_head_dim")
        fields["v_head_dim"] = _need(cfg, path, "v_head_dim")
        head_dim = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    if head_dim is None:
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
            raise PlannerInputError(
                f"{path}: hidden_size and num_attention_heads must be positive integers"
            )
        head_dim = hidden // heads
    fields["head_dim"] = head_dim
    try:
        return ModelShape(**fields)
    except ValidationError as e:
        raise PlannerInputError(f"{path}: {explain_validation(e)}") from None


def explain_validation(e: ValidationError) -> str:
    """One line naming each bad field of a pydantic error."""
    return "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or 'value'}: {err['msg']}" for err in e.errors()
    )
