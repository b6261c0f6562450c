"""Where the adaptive budget goes (issue #18): on the servers that decode. Every shipped config
puts ``AdaptiveChunkScheduler`` on its decode servers and none on its prefill servers, ``up``
builds the command lines so, and a prefill-side budget (honoured, useless) is warned about
(pure: nothing is started)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from splitserve.config import DeploymentError, load_deployment, parse_deployment
from splitserve.launch.deployment import SCHEDULER_CLS, plan_servers

REPO = Path(__file__).resolve().parents[2]
# configs/demo-cpu-stock-nixl.yaml is the baseline without any of our parts.
WITH_BUDGET = ["demo-cpu.yaml", "llama-8b-1p1d-gpu.yaml", "llama-70b-2p2d-gpu.yaml"]


@pytest.mark.parametrize("name", WITH_BUDGET)
def test_shipped_configs_put_the_budget_on_decode_only(name: str, tmp_path: Path) -> None:
    dep = load_deployment(REPO / "configs" / name)
    assert dep.prefill.scheduler is None
    assert dep.decode.scheduler is not None
    for server in plan_servers(dep, tmp_path):
        has = SCHEDULER_CLS in server.command.argv
        assert has == (server.role == "decode"), (server.name, server.command.argv)


def test_every_shipped_config_keeps_the_budget_off_prefill(tmp_path: Path) -> None:
    for f in sorted((REPO / "configs").glob("*.yaml")):
        assert load_deployment(f).prefill.scheduler is None, f


def _minimal(**over) -> dict:
    data = {
        "model": {"preset": "tiny", "served_name": "tiny"},
        "prefill": {"base_port": 9100, "side_channel_base_port": 9600},
        "decode": {"base_port": 9200},
        "connector": {"name": "nixl"},
        "proxy": {"port": 9000},
    }
    data.update(over)
    return data


def test_a_prefill_budget_is_honoured_with_a_warning(caplog, tmp_path: Path) -> None:
    data = _minimal(prefill={"base_port": 9100, "side_channel_base_port": 9600, "scheduler": {}})
    with caplog.at_level(logging.WARNING, logger="splitserve.config"):
        dep = parse_deployment(data, "dep.yaml")
    assert "prefill.scheduler" in caplog.text and "decode.scheduler" in caplog.text
    prefill = next(s for s in plan_servers(dep, tmp_path) if s.role == "prefill")
    assert SCHEDULER_CLS in prefill.command.argv


def test_a_bad_decode_budget_names_the_field() -> None:
    data = _minimal(decode={"base_port": 9200, "scheduler": {"target_itl_ms": -1}})
    with pytest.raises(DeploymentError, match=r"dep.yaml: decode.scheduler.target_itl_ms"):
        parse_deployment(data, "dep.yaml")
