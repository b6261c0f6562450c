"""Per-peer transport from the host identity in the HELLO (strategy.transport_to)."""

from __future__ import annotations

import pytest

from splitserve.transfer import messages, strategy


def test_same_host_or_unknown_peer_reads_ucx_tls_other_host_is_never_cma():
    me = strategy.host_identity()
    assert strategy.transport_to(None, {}) == "cma"  # a version-1 peer without the field
    assert strategy.transport_to(me, {}) == "cma"
    assert strategy.transport_to("other-boot/1", {}) == "tcp"
    assert strategy.transport_to("other-boot/1", {"UCX_TLS": "cma,tcp"}) == "tcp"
    assert strategy.transport_to("other-boot/1", {"UCX_TLS": "rc,sm"}) == "rdma"
    assert strategy.choose(strategy.transport_to("other-boot/1", {}), "DRAM") is (
        strategy.Direction.PUSH
    )


def test_host_identity_is_boot_id_and_network_namespace():
    boot, netns = strategy.host_identity().split("/")
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot == f.read().strip()
    assert netns.isdigit()


def test_local_only_ucx_tls_cannot_reach_another_host():
    assert strategy.cross_host_tls_problem({}) is None
    assert strategy.cross_host_tls_problem({"UCX_TLS": "tcp,cma"}) is None
    assert strategy.cross_host_tls_problem({"UCX_TLS": "^cma"}) is None
    assert "no network transport" in strategy.cross_host_tls_problem({"UCX_TLS": "cma,self"})
    assert "no network transport" in strategy.cross_host_tls_problem({"UCX_TLS": "sm"})


def test_hello_host_is_optional_on_the_wire():
    hello = messages.Hello(agent_name="d", agent_metadata=b"m", layout={}, host="b/1")
    assert messages.decode(messages.encode(hello)).host == "b/1"
    old = messages.Hello(agent_name="d", agent_metadata=b"m", layout={})
    wire = messages.encode(old)
    assert b'"host"' not in wire
    assert messages.decode(wire).host is None


def test_backend_list_defaults_to_ucx_and_merges_the_older_ucx_params():
    from splitserve.transfer.agent import NixlBackend, backend_list

    assert backend_list(None) == [NixlBackend(name="UCX")]
    assert backend_list(None, {"num_workers": "2"}) == [
        NixlBackend(name="UCX", params={"num_workers": "2"})
    ]
    chosen = backend_list(
        [NixlBackend(name="LIBFABRIC"), NixlBackend(name="UCX", params={"num_workers": "4"})],
        {"num_workers": "2", "ucx_devices": "eth0"},
    )
    assert [b.name for b in chosen] == ["LIBFABRIC", "UCX"]
    assert chosen[1].params == {"num_workers": "4", "ucx_devices": "eth0"}


def test_connector_settings_name_backends():
    from splitserve.connectors.sglang.transport import BackendSettings, BackendSettingsError
    from splitserve.connectors.vllm.config import SplitserveConnectorConfig

    cfg = SplitserveConnectorConfig.model_validate(
        {"side_channel_port": 5600, "nixl_backends": [{"name": "UCX", "params": {"a": "b"}}]}
    )
    assert cfg.nixl_backends[0].params == {"a": "b"}
    env = {"SPLITSERVE_SGLANG_NIXL_BACKENDS": '[{"name": "LIBFABRIC"}]'}
    assert BackendSettings.from_env(env).nixl_backends[0].name == "LIBFABRIC"
    with pytest.raises(BackendSettingsError, match="NIXL_BACKENDS: not JSON"):
        BackendSettings.from_env({"SPLITSERVE_SGLANG_NIXL_BACKENDS": "[oops"})


def test_auto_sender_chooses_per_receiver_from_its_host():
    """Unit test of our own logic with the fake agent and channel (tests/unit/fakes.py): a
    sender whose default is pull (cma) answers a receiver on another host with push, one on
    its own host (or one that does not say) with pull."""
    from fakes import FakeAgent, FakeChannel
    from transfer_steps import LAYOUT, PEER

    from splitserve.transfer.sender import KVSender
    from splitserve.transfer.side_channel import Inbound

    pull, push = strategy.Direction.PULL, strategy.Direction.PUSH
    for host, expected in ((strategy.host_identity(), pull), ("elsewhere/1", push), (None, pull)):
        agent, channel = FakeAgent(LAYOUT), FakeChannel()
        sender = KVSender(agent, channel, lease_s=5, direction=pull, per_peer=True)
        hello = messages.Hello(
            agent_name="D", agent_metadata=b"m", layout=LAYOUT.model_dump(), host=host
        )
        channel.inbox.append(Inbound(PEER, hello))
        sender.poll()
        (ack,) = [m for _, m in channel.sent if isinstance(m, messages.HelloAck)]
        assert ack.direction == ("pull" if expected is pull else None), host  # None: push
        assert sender.direction_of("D") is expected
    # Set explicitly (not auto), the direction holds for every receiver.
    agent, channel = FakeAgent(LAYOUT), FakeChannel()
    sender = KVSender(agent, channel, lease_s=5, direction=pull)
    hello = messages.Hello(
        agent_name="D", agent_metadata=b"m", layout=LAYOUT.model_dump(), host="elsewhere/1"
    )
    channel.inbox.append(Inbound(PEER, hello))
    sender.poll()
    assert sender.direction_of("D") is pull
