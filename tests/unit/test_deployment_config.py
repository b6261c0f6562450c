"""Deployment YAML validation: errors name the file and the field; good files resolve to the
right engine commands and proxy settings (pure: nothing is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from splitserve.cli import cli
from splitserve.config import DeploymentError, load_deployment, parse_deployment, proxy_config_for
from splitserve.launch.deployment import plan_servers

REPO = Path(__file__).resolve().parents[2]


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


def test_every_shipped_config_parses() -> None:
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files
    for f in files:
        load_deployment(f)


def test_unknown_field_names_file_and_field(tmp_path) -> None:
    bad = _minimal()
    bad["prefill"]["bsae_port"] = 1
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump(bad))
    with pytest.raises(DeploymentError) as e:
        load_deployment(f)
    assert str(f) in str(e.value) and "prefill.bsae_port" in str(e.value)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model": {"preset": "nope"}}, "preset"),
        ({"model": {"preset": "tiny", "path": "/x"}}, "exactly one of"),
        ({"decode": {"base_port": 9100}}, "ports overlap"),
        ({"proxy": {"port": 9000, "prefill": []}}, "proxy.prefill"),
        ({"proxy": {"port": 9000, "retries": {"max_attempts": 0}}}, "proxy.retries.max_attempts"),
        ({"prefill": {"base_port": 9100, "count": 2, "cpu_cores": [0]}}, "cpu_cores"),
        ({"connector": {"name": "nixl"}, "proxy": {"flow": "concurrent"}}, "proxy.flow"),
    ],
)
def test_bad_settings_are_named(change: dict, needle: str) -> None:
    with pytest.raises(DeploymentError, match=needle):
        parse_deployment(_minimal(**change), "dep.yaml")


def test_not_a_mapping_and_bad_yaml(tmp_path) -> None:
    f = tmp_path / "dep.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(DeploymentError, match="mapping"):
        load_deployment(f)
    f.write_text("model: [unclosed\n")
    with pytest.raises(DeploymentError, match="not valid YAML"):
        load_deployment(f)
    with pytest.raises(DeploymentError, match="cannot read"):
        load_deployment(tmp_path / "missing.yaml")


def test_up_cli_reports_bad_config_without_traceback(tmp_path) -> None:
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump(_minimal(decode={"base_port": "eighty"})))
    result = CliRunner().invoke(cli, ["up", str(f)])
    assert result.exit_code == 2
    assert "decode.base_port" in result.output and str(f) in result.output
    assert "Traceback" not in result.output


def test_plan_resolves_ports_connector_and_proxy(tmp_path) -> None:
    dep = parse_deployment(
        _minimal(
            prefill={
                "base_port": 9100,
                "side_channel_base_port": 9600,
                "count": 2,
                "cpu_cores": [0, 1],
            },
            decode={"base_port": 9200, "side_channel_base_port": 9700},
        )
    )
    servers = plan_servers(dep, tmp_path)
    assert [(s.name, s.port, s.side_channel_port) for s in servers] == [
        ("prefill-0", 9100, 9600),
        ("prefill-1", 9101, 9601),
        ("decode-0", 9200, 9700),
    ]
    p1 = servers[1].command
    assert p1.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9601"
    assert p1.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "NixlConnector" in p1.argv[p1.argv.index("--kv-transfer-config") + 1]
    proxy = proxy_config_for(dep, [9600, 9601])
    assert [p.url for p in proxy.prefill] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert proxy.flow == "sequential" and proxy.port == 9000


def test_first_token_from_prefill_follows_the_flow_and_is_validated() -> None:
    ours = _minimal(connector={"name": "splitserve"})
    ports = [9600]
    assert proxy_config_for(parse_deployment(ours), ports).first_token_from_prefill is True
    off = _minimal(connector={"name": "splitserve"}, proxy={"first_token_from_prefill": False})
    assert proxy_config_for(parse_deployment(off), ports).first_token_from_prefill is False
    stock = parse_deployment(_minimal())  # NixlConnector: sequential flow, option off
    assert proxy_config_for(stock, [None]).first_token_from_prefill is False
    with pytest.raises(DeploymentError, match="proxy.first_token_from_prefill"):
        parse_deployment(_minimal(proxy={"first_token_from_prefill": True}))


def test_stock_connector_settings_reach_its_extra_config_and_the_lease_is_checked(tmp_path) -> None:
    dep = parse_deployment(
        _minimal(connector={"name": "nixl", "settings": {"kv_lease_duration": 120}})
    )
    (p0, d0) = plan_servers(dep, tmp_path)
    kv = json.loads(p0.command.argv[p0.command.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlConnector"
    assert kv["kv_connector_extra_config"] == {"kv_lease_duration": 120}
    plain = plan_servers(parse_deployment(_minimal()), tmp_path)[0].command.argv
    assert "kv_connector_extra_config" not in plain[plain.index("--kv-transfer-config") + 1]
    for bad in (0, 2.5, "30", True):
        with pytest.raises(DeploymentError, match="kv_lease_duration"):
            parse_deployment(
                _minimal(connector={"name": "nixl", "settings": {"kv_lease_duration": bad}})
            )


def test_up_reads_the_proxy_key_before_starting_anything(tmp_path) -> None:
    """An unreadable api_key_file fails `up` at once (not after the engines loaded); with a
    readable one the proxy is probed on /health (its /ready needs the key) and the example
    request carries the key."""
    from splitserve.config import DeploymentError, parse_deployment
    from splitserve.launch.deployment import DeploymentRunner

    data = _minimal(run_dir=str(tmp_path / "run"))
    data["proxy"]["api_key_file"] = str(tmp_path / "missing")
    runner = DeploymentRunner(parse_deployment(data, "dep.yaml"), echo=lambda _: None)
    with pytest.raises(DeploymentError, match="api_key_file"):
        runner.start()
    (tmp_path / "key").write_text("k" * 20)
    data["proxy"]["api_key_file"] = str(tmp_path / "key")
    runner = DeploymentRunner(parse_deployment(data, "dep.yaml"), echo=lambda _: None)
    assert runner._proxy_client_key() == b"k" * 20
    assert "Authorization: Bearer" in runner.example_request()
