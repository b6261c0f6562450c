"""A deployment placed on hosts (``PoolSettings.hosts``, ``proxy.host``): validation names the
field, each server binds and advertises its host's address, ``up --host`` picks its share,
``--print-commands`` prints one section per host, and every host's ``up`` gets the same keys
(pure: nothing is started)."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from splitserve.cli import cli
from splitserve.config import DeploymentError, parse_deployment, proxy_config_for
from splitserve.launch import hosts
from splitserve.launch.deployment import DeploymentRunner, plan_servers
from splitserve.launch.hosts import local_host
from splitserve.launch.secrets import DeploymentSecrets

P, D, X = "10.9.0.2", "10.9.0.3", "10.9.0.4"


def _placed(**over) -> dict:
    data = {
        "model": {"preset": "tiny", "served_name": "tiny"},
        "prefill": {"base_port": 8000, "side_channel_base_port": 5701, "hosts": [P]},
        "decode": {"base_port": 8000, "side_channel_base_port": 5701, "hosts": [D]},
        "connector": {"name": "splitserve"},
        "proxy": {"host": X, "port": 8000, "api_key": "k" * 20},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def _single() -> dict:
    """The same deployment on one host (no placement): ports apart, as before."""
    data = _placed(
        prefill={"hosts": None},
        decode={"hosts": None, "base_port": 8100, "side_channel_base_port": 5702},
    )
    data["proxy"] = {"port": 8200}
    return data


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"prefill": {"hosts": [P, D]}}, "prefill: hosts: 2 given for 1 server"),
        ({"prefill": {"hosts": ["p-host"]}}, r"prefill: hosts\[0\]: 'p-host' is not an IP"),
        ({"decode": {"hosts": ["0.0.0.0"]}}, r"decode: hosts\[0\]: 0.0.0.0 cannot place"),
        ({"decode": {"hosts": ["127.0.0.1"]}}, "not a wildcard, loopback"),
        ({"decode": {"hosts": None}}, "decode.hosts: required once another pool"),
        ({"proxy": {"host": "127.0.0.1"}}, "proxy.host: the address of the proxy's host"),
        ({"decode": {"side_channel_base_port": None}}, "decode.side_channel_base_port"),
        ({"decode": {"hosts": [P], "base_port": 8000}}, r"ports overlap: \[5701, 8000\]"),
    ],
)
def test_bad_placements_are_named(change: dict, needle: str) -> None:
    data = _placed(**change)
    if change.get("decode", {}).get("side_channel_base_port", 0) is None:
        data["decode"].pop("side_channel_base_port")
    if "hosts" in change.get("decode", {}) and change["decode"]["hosts"] is None:
        data["decode"].pop("hosts")
    with pytest.raises(DeploymentError, match=needle):
        parse_deployment(data, "dep.yaml")


def test_proxy_host_needs_the_proxy_placed_too() -> None:
    data = _placed()
    del data["proxy"]["host"]
    with pytest.raises(DeploymentError, match="proxy.host: .* not given"):
        parse_deployment(data, "dep.yaml")


def test_servers_bind_and_advertise_their_hosts_address(tmp_path) -> None:
    """Same ports on different hosts are fine; each server binds its address, has it as
    VLLM_HOST_IP and side_channel_host; D admits only the prefill hosts; the proxy's pools
    are at the placed addresses."""
    dep = parse_deployment(_placed(decode={"env": {"UCX_TLS": "tcp"}}), "dep.yaml")
    p0, d0 = plan_servers(dep, tmp_path)
    assert (p0.host, d0.host) == (P, D)
    for s, address in ((p0, P), (d0, D)):
        argv = s.command.argv
        assert argv[argv.index("--host") + 1] == address
        assert s.command.env["VLLM_HOST_IP"] == address
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        extra = kv["kv_connector_extra_config"]
        assert extra["side_channel_host"] == address and extra["side_channel_port"] == 5701
        assert extra["allowed_prefill_hosts"] == [P]
    assert d0.command.env["UCX_TLS"] == "tcp"
    proxy = proxy_config_for(dep, [5701])
    assert [p.url for p in proxy.prefill] == [f"http://{P}:8000"]
    assert [d.url for d in proxy.decode] == [f"http://{D}:8000"]
    assert proxy.host == X
    assert dep.host_addresses() == [P, D, X]


def test_a_deployment_without_hosts_is_unchanged(tmp_path) -> None:
    data = _single()
    dep = parse_deployment(data, "dep.yaml")
    assert not dep.placed and dep.host_addresses() == []
    p0, _ = plan_servers(dep, tmp_path)
    assert p0.host == "127.0.0.1" and "VLLM_HOST_IP" not in p0.command.env
    assert local_host(dep) is None
    with pytest.raises(DeploymentError, match="places nothing on hosts"):
        local_host(dep, P)


def test_local_host_from_flag_or_interfaces(monkeypatch) -> None:
    dep = parse_deployment(_placed(), "dep.yaml")
    assert local_host(dep, D) == D
    with pytest.raises(DeploymentError, match="nothing of this deployment is placed there"):
        local_host(dep, "10.9.0.99")
    with pytest.raises(DeploymentError, match="not an IP address"):
        local_host(dep, "d-host")
    monkeypatch.setattr(hosts, "local_addresses", lambda: {"127.0.0.1", D})
    assert local_host(dep) == D
    monkeypatch.setattr(hosts, "local_addresses", lambda: {"127.0.0.1"})
    with pytest.raises(DeploymentError, match="give --host ADDR"):
        local_host(dep)
    monkeypatch.setattr(hosts, "local_addresses", lambda: {P, D})
    with pytest.raises(DeploymentError, match="several"):
        local_host(dep)


def test_local_addresses_include_loopback() -> None:
    assert "127.0.0.1" in hosts.local_addresses()


def test_runner_holds_its_hosts_share(tmp_path) -> None:
    dep = parse_deployment(_placed(run_dir=str(tmp_path / "run")), "dep.yaml")
    d = DeploymentRunner(dep, echo=lambda _: None, host=D)
    x = DeploymentRunner(dep, echo=lambda _: None, host=X)
    assert (d.runs_proxy, x.runs_proxy) == (False, True)
    assert d.url == x.url == f"http://{X}:8000"
    assert "proxy" not in d.child_ports() and "proxy" in x.child_ports()


def test_placed_keys_are_made_once_and_reused(tmp_path) -> None:
    placed = parse_deployment(_placed(), "dep.yaml")
    a = DeploymentSecrets.create(placed, tmp_path)
    b = DeploymentSecrets.create(placed, tmp_path)
    assert a.engine_api_key == b.engine_api_key
    assert a.side_channel_key_file is not None
    assert sorted(f.name for f in (tmp_path / "secrets").iterdir()) == [
        "engine-api.key",
        "side-channel.key",
    ]
    for f in (tmp_path / "secrets").iterdir():
        assert f.stat().st_mode & 0o777 == 0o600
    (tmp_path / "secrets" / "engine-api.key").write_text("\n")
    with pytest.raises(DeploymentError, match="empty key file"):
        DeploymentSecrets.create(placed, tmp_path)
    single = parse_deployment(_single())
    c = DeploymentSecrets.create(single, tmp_path / "one")
    d = DeploymentSecrets.create(single, tmp_path / "one")
    assert c.engine_api_key != d.engine_api_key  # one host: fresh keys every start


def test_print_commands_one_section_per_host(tmp_path) -> None:
    data = _placed(run_dir=str(tmp_path / "run"))
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump(data))
    first = CliRunner().invoke(cli, ["up", str(f), "--print-commands"])
    assert first.exit_code == 0, first.output
    out = first.output
    sections = out.split("# ===== host ")[1:]
    assert [s.split(":", 1)[0] for s in sections] == [P, D, X]
    assert f"`splitserve up {f} --host {P}` runs" in out
    assert "# prefill-0" in sections[0] and "# decode-0" not in sections[0]
    assert "# decode-0" in sections[1] and f"VLLM_HOST_IP={D}" in sections[1]
    assert "# proxy on" in sections[2] and "prefill-0" not in sections[2]
    assert "copy this folder" in out
    key = (tmp_path / "run" / "secrets" / "engine-api.key").read_text().strip()
    assert key not in out
    again = CliRunner().invoke(cli, ["up", str(f), "--print-commands"])
    assert again.exit_code == 0
    assert (tmp_path / "run" / "secrets" / "engine-api.key").read_text().strip() == key


def test_up_with_a_host_of_no_share_is_a_usage_error(tmp_path) -> None:
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump(_placed(run_dir=str(tmp_path / "run"))))
    result = CliRunner().invoke(cli, ["up", str(f), "--host", "10.9.0.99"])
    assert result.exit_code == 2
    assert "nothing of this deployment is placed there" in result.output
    assert not (tmp_path / "run").exists()
