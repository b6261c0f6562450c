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


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({**BASE, "client_timeouts": {"header_s": 0}}, "client_timeouts.header_s"),
        ({**BASE, "client_timeouts": {"body_s": -1}}, "client_timeouts.body_s"),
        ({**BASE, "client_timeouts": {"idle_keepalive_s": 0}}, "client_timeouts.idle_keepalive_s"),
        ({**BASE, "client_timeouts": {"header": 5}}, "client_timeouts.header"),
        ({**BASE, "max_connections": 0}, "max_connections"),
        ({**BASE, "max_in_flight": 0}, "max_in_flight"),
        ({**BASE, "max_header_bytes": 10}, "max_header_bytes"),
        ({**BASE, "api_key": "k", "api_key_file": "/k"}, "api_key_file: give api_key or"),
        ({**BASE, "host": "0.0.0.0"}, "host: 0.0.0.0 opens the proxy to the network"),
        ({**BASE, "host": "::"}, "host: :: opens"),
        ({**BASE, "host": "10.0.0.5"}, "host: 10.0.0.5 opens"),
        ({**BASE, "host": "proxy.example.com"}, "host: proxy.example.com opens"),
    ],
)
def test_bad_edge_settings_name_the_field(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        build_config(data)


def test_edge_defaults_are_finite() -> None:
    c = build_config(BASE)
    t = c.client_timeouts
    assert 0 < t.header_s <= t.idle_keepalive_s and 0 < t.body_s < 3600
    assert 0 < c.max_in_flight <= c.max_connections < 1_000_000
    assert c.max_header_bytes == 64 * 1024 and c.client_key() is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_key(host: str) -> None:
    assert build_config({**BASE, "host": host}).host == host


def test_a_network_host_with_a_key_or_insecure(tmp_path: Path) -> None:
    assert build_config({**BASE, "host": "0.0.0.0", "api_key": "k"}).client_key() == b"k"
    assert build_config({**BASE, "host": "0.0.0.0", "insecure": True}).client_key() is None
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    c = build_config({**BASE, "host": "0.0.0.0", "api_key_file": str(key)})
    assert c.client_key() == b"s3cret"
    assert "s3cret" not in repr(c.model_dump())  # the dump holds the path, not the key


def test_api_key_file_problems_name_the_file(tmp_path: Path) -> None:
    missing = build_config({**BASE, "api_key_file": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"api_key_file: cannot read .*nope"):
        missing.client_key()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"api_key_file: .*empty is empty"):
        build_config({**BASE, "api_key_file": str(empty)}).client_key()
    f = tmp_path / "p.yaml"
    f.write_text(
        f"prefill: [{{url: 'http://x:1'}}]\ndecode: [{{url: 'http://y:1'}}]\n"
        f"host: 0.0.0.0\napi_key_file: {tmp_path / 'nope'}\n"
    )
    result = CliRunner().invoke(cli, ["proxy", "--config", str(f)])
    assert result.exit_code == 2 and "api_key_file: cannot read" in result.output
    assert "Traceback" not in result.output


def test_the_key_from_the_environment_opens_a_network_host(tmp_path: Path) -> None:
    """``splitserve proxy`` validates the file and the flags together: a YAML that binds
    0.0.0.0 with no key of its own starts when SPLITSERVE_PROXY_API_KEY gives one."""
    f = tmp_path / "p.yaml"
    f.write_text("prefill: [{url: 'http://x:1'}]\ndecode: [{url: 'http://y:1'}]\nhost: 0.0.0.0\n")
    with pytest.raises(ConfigError, match="host: 0.0.0.0 opens"):
        config_from_options(str(f), (), (), (), (), {})
    c = config_from_options(str(f), (), (), (), (), {"api_key": "from-env"})
    assert c.client_key() == b"from-env"
    f.write_text(f.read_text() + f"api_key_file: {tmp_path / 'nope'}\n")
    c = config_from_options(str(f), (), (), (), (), {"api_key": "from-env"})
    assert c.client_key() == b"from-env" and c.api_key_file is None  # the flag's key wins
