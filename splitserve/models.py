"""Deterministic random-weight Llama models for tests, demos and benchmarks.

There is no model hub on our machines, so every test model is built locally: a Llama
architecture with seeded random weights, and a byte-level BPE tokenizer trained on seeded
synthetic text, with ``<s>`` / ``</s>`` / ``<pad>`` and a chat template, so stock vLLM and SGLang
serve it (completions and chat) with ``HF_HUB_OFFLINE=1``.

Determinism is a contract: the same spec writes byte-identical files (tests check a hash).
Everything random is seeded from ``ModelSpec.seed`` and the tokenizer is trained single-threaded.
A random model's greedy output is still deterministic, which is all a correctness test needs:
the same tokens with and without disaggregation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

# Synthetic vocabulary for the tokenizer corpus: a few real words (so prompts in examples read
# naturally) plus seeded random ones.
_BASE_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "cat",
    "sat",
    "on",
    "mat",
    "hello",
    "world",
    "cache",
    "token",
    "prefill",
    "decode",
    "scheduler",
    "budget",
    "kv",
    "block",
    "memory",
    "layer",
    "attention",
    "model",
    "sample",
    "greedy",
    "user",
    "assistant",
    "system",
    "what",
    "is",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "for",
    "with",
    "you",
    "are",
    "how",
    "why",
    "when",
    "where",
    "which",
    "this",
    "that",
]

_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<s>' if loop.first else '' }}{{ m['role'] }}: "
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class ModelSpec(BaseModel):
    """Shape of a test model. ``head_dim`` is independent of ``hidden_size`` so a model can be
    made KV-heavy (many KV heads x large head dim) while its GEMMs stay cheap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(4, ge=1, le=256)
    hidden_size: int = Field(256, ge=16, le=65536)
    intermediate_size: int = Field(512, ge=16, le=262144)
    num_heads: int = Field(4, ge=1, le=1024)
    num_kv_heads: int = Field(2, ge=1, le=1024)
    head_dim: int = Field(64, ge=8, le=1024)
    vocab_size: int = Field(1024, ge=300, le=65536)
    max_position_embeddings: int = Field(4096, ge=128, le=1_048_576)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (rotary embedding)")
        return self

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V for every layer of one token (default: fp32, what our CPU servers use)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


PRESETS: dict[str, ModelSpec] = {
    # Fast tests: 4 layers, KV 4 KiB/token in fp32. Builds in seconds, serves in ~1 minute.
    "tiny": ModelSpec(),
    # KV-heavy: 16 layers x 16 KV heads x head dim 128 = 256 KiB of fp32 KV per token, with cheap
    # GEMMs (hidden 512), so KV transfer is a visible share of prefill on a 2-core CPU.
    "bench": ModelSpec(
        num_layers=16,
        hidden_size=512,
        intermediate_size=1024,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        vocab_size=1024,
        max_position_embeddings=8192,
    ),
    # Between: a 1,024 / 2,048 / 4,000-token prefill takes ~1.1 / ~2.5 / ~6.1 s served on one
    # core (vLLM CPU, benchmarks/calibrate_engine.py, 2026-12-06); 24 KiB KV/token.
    "mid": ModelSpec(
        num_layers=8,
        hidden_size=768,
        intermediate_size=1536,
        num_heads=8,
        num_kv_heads=4,
        head_dim=96,
        vocab_size=1024,
        max_position_embeddings=8192,
    ),
}


def resolve_spec(preset: str | None = None, **overrides: int | None) -> ModelSpec:
    """A preset (default ``tiny``) with any non-None field overridden; validation errors name
    the field."""
    name = preset or "tiny"
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name].model_dump()
    base.update({k: v for k, v in overrides.items() if v is not None})
    return ModelSpec(**base)


def _corpus(rng: random.Random, vocab_size: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    n_words = max(3000, vocab_size * 3)
    words = list(_BASE_WORDS) + [
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(n_words)
    ]
    n_lines = max(5000, vocab_size * 5)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def _build_tokenizer(spec: ModelSpec, out: Path) -> tuple[int, int, int, int]:
    """Train and save the tokenizer; return (vocab size, bos id, eos id, pad id)."""
    # Single-threaded training: merge order must not depend on thread timing.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(spec.seed)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng, spec.vocab_size), trainer)
    got = tok.get_vocab_size()
    if got != spec.vocab_size:
        raise ValueError(
            f"the tokenizer reached only {got} tokens, not vocab_size={spec.vocab_size}; "
            f"use a vocab_size of at most {got}"
        )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", tok.token_to_id("<s>"))],
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=_CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    hf_tok.save_pretrained(str(out))
    return got, hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id


def build_model(spec: ModelSpec, out_dir: str | os.PathLike[str]) -> Path:
    """Write a servable model directory for ``spec`` to ``out_dir`` and return its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos, pad = _build_tokenizer(spec, out)

    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        # Wider than the usual 0.02: logits spread further apart, so greedy choices do not hinge
        # on rounding (batch shape, kernel order) and every token depends visibly on the context,
        # which is what a KV-transfer correctness test needs.
        initializer_range=0.05,
        torch_dtype="bfloat16",
    )
    with torch.no_grad():
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        # Tokens that decode to raw non-ASCII bytes (the byte-level alphabet keeps every input
        # encodable) and the special tokens get a zero output row: a random model then rarely
        # emits half a UTF-8 character (demo answers print as text) or an early end of sequence
        # (outputs run to max_tokens, so tests compare full-length sequences).
        model.lm_head.weight[_unprintable_ids(out)] = 0
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "splitserve-model.json").write_text(
        json.dumps(
            {"spec": spec.model_dump(), "kv_bytes_per_token_fp32": spec.kv_bytes_per_token()},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    logger.info("built model %s at %s", spec.model_dump(), out)
    return out


def _unprintable_ids(model_dir: Path) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    ids = []
    for i in range(len(tok)):
        text = tok.decode([i])
        if i in tok.all_special_ids or not (text.isascii() and text.isprintable()):
            ids.append(i)
    return ids


def tree_digest(path: str | os.PathLike[str]) -> str:
    """sha256 over every file's relative path and bytes, in sorted order."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()
