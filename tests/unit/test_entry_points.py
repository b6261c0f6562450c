"""Both engines' installed entry points name the functions in ``splitserve.plugins``.

The engines load ``splitserve`` through these entry points and only log one that does not load,
so a wrong or stale name would show up late (a disaggregated server refusing our connector or
transfer backend name). Loading an entry point imports ``splitserve.plugins`` only: no engine.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from splitserve import plugins

GROUPS = {
    "vllm.general_plugins": plugins.register_vllm,
    "sglang.srt.plugins": plugins.register_sglang,
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_entry_point_names_the_plugin_function(group: str) -> None:
    installed = [ep for ep in entry_points(group=group) if ep.name == "splitserve"]
    assert len(installed) == 1, f"no splitserve entry point in {group}: run `make env`"
    assert installed[0].load() is GROUPS[group], (
        f"{installed[0].value}: not splitserve.plugins (pyproject.toml, then `make env`)"
    )
