"""The model builder: validation of shapes, and byte-identical output for the same spec."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from splitserve.cli import cli
from splitserve.models import PRESETS, ModelSpec, build_model, resolve_spec, tree_digest


def test_bench_preset_is_kv_heavy() -> None:
    # 16 layers x 2 (K and V) x 16 KV heads x head dim 128 x 4 bytes = 256 KiB per token.
    assert PRESETS["bench"].kv_bytes_per_token() == 256 * 1024


def test_mid_preset_validates_and_has_modest_kv() -> None:
    # 8 layers x 2 (K and V) x 4 KV heads x head dim 96 x 4 bytes = 24 KiB per token; KV heads
    # divide by 1, 2 and 4 (tensor parallel).
    spec = resolve_spec("mid")
    assert spec == PRESETS["mid"]
    assert spec.kv_bytes_per_token() == 24 * 1024
    assert all(spec.num_kv_heads % tp == 0 for tp in (1, 2, 4))


def test_overrides_apply_and_validate() -> None:
    spec = resolve_spec("tiny", num_layers=2, head_dim=None)
    assert spec.num_layers == 2 and spec.head_dim == PRESETS["tiny"].head_dim
    with pytest.raises(ValidationError, match="num_kv_heads"):
        ModelSpec(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="unknown model preset"):
        resolve_spec("huge")


def test_tiny_preset_build_is_byte_identical(tmp_path) -> None:
    runner = CliRunner()
    digests = []
    for name in ("a", "b"):
        result = runner.invoke(
            cli, ["model", "build", "--preset", "tiny", "--out", str(tmp_path / name)]
        )
        assert result.exit_code == 0, result.output
        digests.append(tree_digest(tmp_path / name))
    assert digests[0] == digests[1]
    assert f"sha256 of files: {digests[0]}" in result.output


def test_shape_flags_reach_the_config(tmp_path) -> None:
    spec = resolve_spec(
        "tiny", num_layers=2, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512
    )
    a = build_model(spec, tmp_path / "a")
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["head_dim"] == 16 and cfg["vocab_size"] == 512
    # A different seed gives different weights.
    c = build_model(spec.model_copy(update={"seed": 1}), tmp_path / "c")
    assert tree_digest(c) != tree_digest(a)


def test_cli_reports_bad_shape_without_traceback(tmp_path) -> None:
    result = CliRunner().invoke(
        cli, ["model", "build", "--out", str(tmp_path / "m"), "--heads", "6", "--kv-heads", "4"]
    )
    assert result.exit_code == 2
    assert "num_kv_heads" in result.output
    assert "Traceback" not in result.output


def test_cli_rejects_too_small_vocab(tmp_path) -> None:
    # Below 300 the byte-level alphabet (256) and the special tokens do not fit.
    result = CliRunner().invoke(
        cli, ["model", "build", "--out", str(tmp_path / "m"), "--vocab", "100"]
    )
    assert result.exit_code == 2
    assert "vocab_size" in result.output
    assert not (tmp_path / "m").exists()
