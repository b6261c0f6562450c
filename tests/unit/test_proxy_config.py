"""Proxy settings (splitserve.proxy.config) and the `splitserve proxy` command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from splitserve.cli import cli
from splitserve.proxy.cli import config_from_options
from splitserve.proxy.config import ConfigError, build_config, load_config

BASE = {"prefill": [{"url": "http://p:8000"}], "decode": [{"url": "http://d:8000/"}]}


def test_defaults() -> None:
    c = build_config(BASE)
    assert c.engine == "vllm" and c.flow == "sequential"
    assert c.decode[0].url == "http://d:8000", "trailing slash dropped"
    assert c.prefill[0].side_host == "p"
    assert (
        build_config(
            {**BASE, "engine": "sglang", "prefill": [{"url": "http://p:1", "bootstrap_port": 8998}]}
        ).flow
        == "concurrent"
    )


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({**BASE, "prefil": []}, "prefil: Extra inputs are not permitted"),
        ({**BASE, "prefill": []}, "prefill: List should have at least 1 item"),
        ({**BASE, "decode": [{"url": "http://d:8000/v1"}]}, "decode.0.url"),
        ({**BASE, "decode": [{"url": "d:8000"}]}, "decode.0.url"),
        ({**BASE, "flow": "concurrent"}, "prefill.0.side_channel_port"),
        ({**BASE, "engine": "sglang"}, "prefill.0.bootstrap_port"),
        ({**BASE, "engine": "sglang", "flow": "sequential"}, "flow"),
        ({**BASE, "timeouts": {"connect_s": 0}}, "timeouts.connect_s"),
        ({**BASE, "routing": {"prefill": "random"}}, "routing.prefill"),
        ({**BASE, "decode": [{"url": "http://d:1"}, {"url": "http://d:1"}]}, "duplicate"),
        ({**BASE, "port": 70000}, "port"),
        ({**BASE, "port": 0, "workers": 2}, "port: several workers"),
        ({**BASE, "workers": 0}, "workers"),
    ],
)
def test_bad_settings_name_the_field(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        build_config(data)


def test_yaml(tmp_path: Path) -> None:
    f = tmp_path / "proxy.yaml"
    f.write_text(
        "proxy:\n  engine: vllm\n  flow: concurrent\n  port: 9000\n  prefill:\n"
        "    - {url: 'http://10.0.0.1:8000', side_channel_port: 5600}\n"
        "  decode:\n    - url: http://10.0.0.2:8000\n  routing: {prefix_affinity: true}\n"
    )
    c = load_config(f)
    assert c.port == 9000 and c.prefill[0].side_channel_port == 5600
    assert c.routing.prefix_affinity
    f.write_text(
        "engine: vllm\nprefill: [{url: 'http://x:1'}]\ndecode: [{url: 'http://y:1'}]\ntimeout: 3\n"
    )
    with pytest.raises(ConfigError, match="timeout: Extra inputs"):
        load_config(f)
    f.write_text(": : :")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_flags_override_file(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("prefill: [{url: 'http://x:1'}]\ndecode: [{url: 'http://y:1'}]\napi_key: k\n")
    c = config_from_options(
        str(f),
        ("http://a:1", "http://b:1"),
        (),
        (5601, 5602),
        (),
        {"flow": "concurrent", "port": 1234},
    )
    assert [p.side_channel_port for p in c.prefill] == [5601, 5602]
    assert c.decode[0].url == "http://y:1" and c.port == 1234
    assert c.api_key is not None and c.api_key.get_secret_value() == "k"
    with pytest.raises(ConfigError, match="one --side-channel-port per --prefill"):
        config_from_options(None, ("http://a:1",), ("http://d:1",), (1, 2), (), {})


def test_cli_rejects_bad_settings_without_traceback() -> None:
    result = CliRunner().invoke(
        cli, ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--flow", "concurrent"]
    )
    assert result.exit_code == 2
    assert "prefill.0.side_channel_port" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["proxy", "--help"])
    assert result.exit_code == 0 and "--prefill" in result.output


def test_first_token_from_prefill_default_flag_and_validation(tmp_path) -> None:
    base = {
        "prefill": [{"url": "http://p:1", "side_channel_port": 5}],
        "decode": [{"url": "http://d:1"}],
    }
    assert build_config({**base, "flow": "concurrent"}).first_token_from_prefill is True
    assert build_config(base).first_token_from_prefill is False  # sequential: not supported
    with pytest.raises(ConfigError, match="first_token_from_prefill: only the vLLM concurrent"):
        build_config({**base, "first_token_from_prefill": True})
    # A YAML concurrent flow overridden by --flow sequential: the unset default follows the flow.
    path = tmp_path / "p.yaml"
    path.write_text(
        "flow: concurrent\nprefill: [{url: 'http://a:1', side_channel_port: 5}]\n"
        "decode: [{url: 'http://d:1'}]\n"
    )
    c = config_from_options(
        str(path), ("http://a:1",), ("http://d:1",), (5,), (), {"flow": "sequential"}
    )
    assert c.first_token_from_prefill is False
    c = config_from_options(
        None,
        ("http://a:1",),
        ("http://d:1",),
        (5,),
        (),
        {"flow": "concurrent", "first_token_from_prefill": False},
    )
    assert c.first_token_from_prefill is False
    result = CliRunner().invoke(
        cli,
        [
            "proxy",
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:1",
            "--first-token-from-prefill",
        ],
    )
    assert result.exit_code == 2 and "first_token_from_prefill" in result.output
