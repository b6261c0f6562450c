"""``splitserve model``: build deterministic test models (see ``splitserve.models``)."""

from __future__ import annotations

import click
from pydantic import ValidationError

from splitserve.models import PRESETS, build_model, resolve_spec, tree_digest


@click.group()
def model() -> None:
    """Deterministic random-weight test models."""


@model.command("build")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to write the model to.",
)
@click.option("--layers", "num_layers", type=int, help="Number of decoder layers.")
@click.option("--hidden-size", type=int)
@click.option("--intermediate-size", type=int)
@click.option("--heads", "num_heads", type=int, help="Attention (query) heads.")
@click.option("--kv-heads", "num_kv_heads", type=int, help="Key/value heads (GQA).")
@click.option("--head-dim", type=int)
@click.option("--vocab", "vocab_size", type=int, help="Tokenizer and embedding size.")
@click.option("--max-position-embeddings", type=int)
@click.option("--seed", type=int)
def build(preset: str, out_dir: str, **shape: int | None) -> None:
    """Build a model; the same options always write byte-identical files."""
    try:
        spec = resolve_spec(preset, **shape)
    except (ValidationError, ValueError) as e:
        raise click.UsageError(_explain(e)) from None
    try:
        path = build_model(spec, out_dir)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    kv = spec.kv_bytes_per_token()
    click.echo(f"model written to {path}")
    click.echo(f"  shape: {spec.model_dump()}")
    click.echo(f"  KV per token (fp32): {kv} bytes ({kv / 1024:g} KiB)")
    click.echo(f"  sha256 of files: {tree_digest(path)}")


def _explain(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'model'}: {err['msg']}" for err in e.errors()
        )
    return str(e)
