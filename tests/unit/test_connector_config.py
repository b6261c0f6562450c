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
    assert config.auth_key is None and config.lease_s > 0 and config.done_timeout_s > 0
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
