"""Each test-model preset (``splitserve.models.PRESETS``) has a planner catalog entry
``splitserve-<preset>`` of the same shape, so ``plan`` and ``simulate`` size what the
benchmarks serve."""

from __future__ import annotations

import pytest

from splitserve.models import PRESETS
from splitserve.planner.catalog import MODELS, get_model


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_catalog_model_matches_preset(preset: str) -> None:
    spec, shape = PRESETS[preset], get_model(f"splitserve-{preset}")
    assert (
        shape.num_layers,
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_attention_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.vocab_size,
    ) == (
        spec.num_layers,
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.vocab_size,
    )


def test_every_project_model_is_a_preset() -> None:
    ours = {name.removeprefix("splitserve-") for name in MODELS if name.startswith("splitserve-")}
    assert ours == set(PRESETS)
