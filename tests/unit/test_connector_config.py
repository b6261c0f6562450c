"""SplitserveConnector's extra config, kv_transfer_params parsing and block arithmetic."""

from __future__ import annotations

import pytest

from splitserve.connectors.vllm.config import ConnectorConfigError, parse_connector_config
from splitserve.connectors.vllm.params import (
    KVParamsError,
    blocks_to_receive,
    produce_params,
    receive_params,
)


def test_defaults_and_required_port():
    config = parse_connector_config({"side_channel_port": 5701})
    assert config.side_channel_host == "127.0.0.1"
    assert config.auth_key_file is None and config.lease_s > 0 and config.done_timeout_s > 0
    assert not config.insecure and config.allowlist is None
    with pytest.raises(ConnectorConfigError, match="side_channel_port"):
        parse_connector_config({})


def test_unknown_key_is_named():
    with pytest.raises(ConnectorConfigError, match="unknown key 'lease_seconds'"):
        parse_connector_config({"side_channel_port": 5701, "lease_seconds": 3})


def test_invalid_value_is_named():
    with pytest.raises(ConnectorConfigError, match="'lease_s'"):
        parse_connector_config({"side_channel_port": 5701, "lease_s": -1})
    with pytest.raises(ConnectorConfigError, match="'side_channel_port'"):
        parse_connector_config({"side_channel_port": 70000})


def test_receive_params():
    assert receive_params(None) is None
    assert receive_params({"do_remote_decode": True}) is None
    got = receive_params(
        {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 5}
    )
    assert (got.transfer_id, got.remote_host, got.remote_port) == ("t", "h", 5)
    for bad in (
        {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": "5"},
        {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": True},
        {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "", "remote_port": 5},
        {"do_remote_prefill": True, "remote_host": "h", "remote_port": 5},
        {"do_remote_prefill": True, "transfer_id": 7, "remote_host": "h", "remote_port": 5},
    ):
        with pytest.raises(KVParamsError):
            receive_params(bad)


def test_produce_params_make_an_id_for_stock_routers():
    assert produce_params({"do_remote_prefill": True}) is None
    assert produce_params({"do_remote_decode": True, "transfer_id": "abc"}).transfer_id == "abc"
    made = produce_params({"do_remote_decode": True, "remote_host": None})
    assert len(made.transfer_id) == 32
    with pytest.raises(KVParamsError):
        produce_params({"do_remote_decode": True, "transfer_id": ""})


@pytest.mark.parametrize(
    ("prompt", "local", "expected"),
    [
        (1, 0, range(0, 0)),  # nothing to load: D computes the only token
        (127, 0, range(0, 1)),
        (128, 0, range(0, 1)),
        (129, 0, range(0, 1)),  # 128 tokens to load: exactly one block
        (130, 0, range(0, 2)),
        (1300, 256, range(2, 11)),  # D holds two blocks already
        (257, 256, range(2, 2)),  # D holds everything it needs
    ],
)
def test_blocks_to_receive(prompt, local, expected):
    assert blocks_to_receive(prompt, local, 128) == expected


def test_an_inline_key_is_refused_with_where_to_put_it():
    with pytest.raises(ConnectorConfigError, match="auth_key_file"):
        parse_connector_config({"side_channel_port": 5701, "auth_key": "secret-in-argv"})


def test_a_network_side_channel_without_a_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_AUTH_KEY", raising=False)
    monkeypatch.delenv("SPLITSERVE_AUTH_KEY_FILE", raising=False)
    loopback = parse_connector_config({"side_channel_port": 5701})
    assert loopback.load_auth_key() is None  # loopback: only local processes reach it
    open_port = parse_connector_config({"side_channel_port": 5701, "side_channel_host": "0.0.0.0"})
    with pytest.raises(ConnectorConfigError, match="no auth key") as err:
        open_port.load_auth_key()
    assert "insecure" in str(err.value) and "auth_key_file" in str(err.value)
    lab = parse_connector_config(
        {"side_channel_port": 5701, "side_channel_host": "0.0.0.0", "insecure": True}
    )
    assert lab.load_auth_key() is None


def test_the_key_comes_from_a_0600_file_or_the_environment(tmp_path, monkeypatch):
    from splitserve.transfer.auth import write_key_file

    monkeypatch.delenv("SPLITSERVE_AUTH_KEY", raising=False)
    monkeypatch.delenv("SPLITSERVE_AUTH_KEY_FILE", raising=False)
    path = write_key_file(tmp_path / "k" / "auth.key")
    assert path.stat().st_mode & 0o777 == 0o600
    config = parse_connector_config(
        {"side_channel_port": 5701, "side_channel_host": "10.0.0.1", "auth_key_file": str(path)}
    )
    assert config.load_auth_key() == path.read_text().strip().encode()
    monkeypatch.setenv("SPLITSERVE_AUTH_KEY_FILE", str(path))
    assert parse_connector_config({"side_channel_port": 1}).load_auth_key() is not None
    monkeypatch.delenv("SPLITSERVE_AUTH_KEY_FILE")
    monkeypatch.setenv("SPLITSERVE_AUTH_KEY", "short")
    with pytest.raises(ConnectorConfigError, match="at least 16"):
        parse_connector_config({"side_channel_port": 1}).load_auth_key()
    missing = {"side_channel_port": 1, "auth_key_file": str(tmp_path / "nope")}
    with pytest.raises(ConnectorConfigError, match="cannot read the auth key file"):
        parse_connector_config(missing).load_auth_key()


def test_allowed_prefill_hosts():
    config = parse_connector_config(
        {"side_channel_port": 1, "allowed_prefill_hosts": ["10.1.0.0/16", "P-0.pool", "::1"]}
    )
    ok = {"do_remote_prefill": True, "transfer_id": "t", "remote_port": 5}
    for host in ("10.1.2.3", "p-0.pool", "::1"):
        assert receive_params({**ok, "remote_host": host}, config.allowlist).remote_host == host
    for host in ("10.2.0.1", "evil.example", "127.0.0.1"):
        with pytest.raises(KVParamsError, match="remote_host .* not an allowed prefill host"):
            receive_params({**ok, "remote_host": host}, config.allowlist)
    assert receive_params({**ok, "remote_host": "anything"}, None).remote_host == "anything"
    with pytest.raises(ConnectorConfigError, match="allowed host"):
        parse_connector_config({"side_channel_port": 1, "allowed_prefill_hosts": ["a b"]})


def test_peer_liveness_bound_defaults_to_5_s_and_is_bounded():
    assert parse_connector_config({"side_channel_port": 5701}).peer_liveness_s == 5.0
    config = parse_connector_config({"side_channel_port": 5701, "peer_liveness_s": 30})
    assert config.peer_liveness_s == 30.0
    for bad in (0, 0.1, 301, "soon"):
        with pytest.raises(ConnectorConfigError, match="'peer_liveness_s'"):
            parse_connector_config({"side_channel_port": 5701, "peer_liveness_s": bad})
