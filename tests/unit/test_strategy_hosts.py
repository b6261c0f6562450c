"""Per-peer transport from the host identity in the HELLO (strategy.transport_to)."""

from __future__ import annotations

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
