"""The ``lmcache:`` section of a deployment (unit tests of our own wiring, nothing started):
validated with the rest of the file, composed into the P servers' commands only, its shared
tier planned as a supervised TCP server of ``up``, refused where it cannot work."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from splitserve.cli import cli
from splitserve.config import DeploymentError, parse_deployment
from splitserve.connectors.lmcache.settings import CONNECTOR_NAME
from splitserve.launch.deployment import (
    LMCACHE_TIER,
    DeploymentRunner,
    PortInUseError,
    check_ports,
    lmcache_tier_here,
    plan_servers,
)
from splitserve.launch.kubernetes import build_manifests
from splitserve.netutil import free_ports


def _deployment(lmcache: dict | None = None, **over) -> dict:
    data = {
        "model": {"preset": "tiny", "served_name": "tiny"},
        "prefill": {"base_port": 9100, "side_channel_base_port": 9600, "count": 2},
        "decode": {"base_port": 9200, "side_channel_base_port": 9700},
        "connector": {"name": "splitserve"},
        "proxy": {"port": 9000},
    }
    if lmcache is not None:
        data["lmcache"] = lmcache
    data.update(over)
    return data


def _kv(server) -> dict:
    argv = server.command.argv
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_p_servers_compose_lmcache_first_and_d_servers_stay_plain(tmp_path) -> None:
    dep = parse_deployment(_deployment({"chunk_size": 256, "remote": {"port": 9800}}))
    servers = {s.name: s for s in plan_servers(dep, tmp_path)}
    for name in ("prefill-0", "prefill-1"):
        kv = _kv(servers[name])
        assert kv["kv_connector"] == "MultiConnector"
        children = kv["kv_connector_extra_config"]["connectors"]
        assert [c["kv_connector"] for c in children] == [CONNECTOR_NAME, "SplitserveConnector"]
        assert children[1]["kv_connector_extra_config"]["side_channel_port"] == (
            9600 if name == "prefill-0" else 9601
        )
        env = servers[name].command.env
        assert env["LMCACHE_REMOTE_URL"] == "lm://127.0.0.1:9800"
        assert env["LMCACHE_CHUNK_SIZE"] == "256" and env["PYTHONHASHSEED"] == "0"
    decode = servers["decode-0"]
    assert _kv(decode)["kv_connector"] == "SplitserveConnector"
    assert not any(k.startswith("LMCACHE_") for k in decode.command.env)


def test_the_shared_tier_is_started_before_the_p_servers_as_a_tcp_server(tmp_path) -> None:
    dep = parse_deployment(_deployment({"remote": {"port": 9800}}))
    planned = plan_servers(dep, tmp_path)
    tier = lmcache_tier_here(dep, planned)
    assert tier is not None and tier.argv()[1:] == ["-m", "lmcache.v1.server", "127.0.0.1", "9800"]
    assert lmcache_tier_here(dep, [s for s in planned if s.role == "decode"]) is None
    runner = DeploymentRunner(dep, echo=lambda _: None)
    runner.planned = planned
    assert runner.child_ports()[LMCACHE_TIER] == [9800]
    off = parse_deployment(_deployment({"remote": {"port": 9800, "start": False}}))
    assert lmcache_tier_here(off, plan_servers(off, tmp_path)) is None
    local = parse_deployment(_deployment({"local_cpu_gb": 2}))
    assert lmcache_tier_here(local, plan_servers(local, tmp_path)) is None


def test_a_taken_tier_port_fails_before_anything_starts(tmp_path) -> None:
    import socket

    port = free_ports(1)[0]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        dep = parse_deployment(_deployment({"remote": {"port": port}}))
        with pytest.raises(PortInUseError, match=f"lmcache.remote.port: port {port}"):
            check_ports(dep, plan_servers(dep, tmp_path), with_proxy=False)


@pytest.mark.parametrize(
    ("lmcache", "over", "needle"),
    [
        ({"remote": {"port": 9100}}, {}, "ports overlap: [9100]"),
        ({"chunk_size": 100}, {}, "chunk_size"),
        ({"local_cpu_gb": 0}, {}, "no tier"),
        ({"remote": {"port": 9800, "bogus": 1}}, {}, "bogus"),
        ({"remote": {"port": 70000}}, {}, "lmcache.remote.port"),
        ({}, {"connector": {"name": "nixl"}}, "composes with the splitserve connector"),
    ],
)
def test_bad_lmcache_settings_are_refused_naming_the_field(lmcache, over, needle) -> None:
    with pytest.raises(DeploymentError) as err:
        parse_deployment(_deployment(lmcache, **over), "dep.yaml")
    assert needle in str(err.value) and "dep.yaml" in str(err.value)


def test_placed_on_hosts_the_tier_is_one_every_p_host_reaches() -> None:
    placed = {
        "prefill": {
            "base_port": 9100,
            "side_channel_base_port": 9600,
            "hosts": ["10.0.0.1"],
        },
        "decode": {"base_port": 9200, "side_channel_base_port": 9700, "hosts": ["10.0.0.2"]},
        "proxy": {"port": 9000, "host": "10.0.0.3", "insecure": True},
    }
    with pytest.raises(DeploymentError, match="lmcache.remote.start"):
        parse_deployment(_deployment({"remote": {"port": 9800}}, **placed))
    with pytest.raises(DeploymentError, match="lmcache.remote.host"):
        parse_deployment(_deployment({"remote": {"port": 9800, "start": False}}, **placed))
    remote = {"port": 9800, "start": False, "host": "10.0.0.9"}
    assert parse_deployment(_deployment({"remote": remote}, **placed)).lmcache.remote.host


def test_up_refuses_bad_lmcache_settings_without_a_traceback(tmp_path) -> None:
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump(_deployment({"chunk_size": 100})))
    result = CliRunner().invoke(cli, ["up", str(f)])
    assert result.exit_code != 0
    assert "lmcache" in result.output and "chunk_size" in result.output
    assert "Traceback" not in result.output


def test_kubernetes_manifests_refuse_lmcache() -> None:
    dep = parse_deployment(_deployment({"remote": {"port": 9800}}))
    with pytest.raises(DeploymentError, match="lmcache: not emitted"):
        build_manifests(dep, "dep.yaml")
