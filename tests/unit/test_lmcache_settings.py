"""The deployment's LMCache section: bad settings are refused with the field named, good ones
become the environment LMCache reads and the composition's kv-transfer-config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from splitserve.connectors.lmcache.settings import LMCacheSettings, composed_kv_config


def test_defaults_are_a_local_tier() -> None:
    env = LMCacheSettings().env()
    assert env["LMCACHE_LOCAL_CPU"] == "True" and "LMCACHE_REMOTE_URL" not in env
    assert env["PYTHONHASHSEED"] == "0"


def test_remote_tier_becomes_lmcache_url_and_command_line() -> None:
    s = LMCacheSettings(remote={"host": "10.0.0.5", "port": 6555}, local_cpu_gb=0)
    assert s.env()["LMCACHE_REMOTE_URL"] == "lm://10.0.0.5:6555"
    assert s.env()["LMCACHE_LOCAL_CPU"] == "False"
    assert s.remote is not None
    assert s.remote.argv("py") == ["py", "-m", "lmcache.v1.server", "10.0.0.5", "6555"]


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 250}, "multiple of 16"),
        ({"local_cpu_gb": 0}, "no tier"),
        ({"remote": {"port": 70000}}, "remote.port"),
        ({"remote": {"port": 6555, "tls": True}}, "remote.tls"),
        ({"chunksize": 256}, "chunksize"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(section: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LMCacheSettings(**section)
    text = str(info.value).replace("\n", " ")
    assert field.split(".")[-1] in text


def test_composition_puts_lmcache_first() -> None:
    ours = {"kv_connector": "SplitserveConnector", "kv_role": "kv_both"}
    config = composed_kv_config(ours)
    children = config["kv_connector_extra_config"]["connectors"]
    assert config["kv_connector"] == "MultiConnector"
    assert [c["kv_connector"] for c in children] == [
        "SplitserveLMCacheConnector",
        "SplitserveConnector",
    ]
    assert children[0]["kv_connector_module_path"] == "splitserve.connectors.lmcache.vllm_connector"
