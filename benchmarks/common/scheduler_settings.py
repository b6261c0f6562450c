"""``--scheduler-set KEY=VALUE`` for the benchmarks that run the adaptive scheduler: options
beyond its defaults (``share_prefill=true``), each checked against the settings model before
any server starts."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from splitserve.schedulers.policy import BudgetPolicySettings


def parse_scheduler_sets(items: list[str], target_itl_ms: float = 50.0) -> dict[str, Any]:
    """The settings named by ``KEY=VALUE`` items (values read as YAML); ValueError naming the
    item or the setting when one is malformed or unknown."""
    extra: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--scheduler-set takes KEY=VALUE, got {item!r}")
        extra[key] = yaml.safe_load(value)
    try:
        BudgetPolicySettings(**{"target_itl_ms": target_itl_ms, **extra})
    except ValidationError as e:
        raise ValueError(f"--scheduler-set: {e}") from None
    return extra


HELP = (
    "an adaptive-scheduler setting beyond its defaults (repeatable; the value is read as "
    "YAML: share_prefill=true, floor_below_block=true)"
)
