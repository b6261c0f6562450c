"""SideChannel's FIRST_TOKEN relay, over real ZMQ sockets on loopback in one process.

Three channels stand for P's worker (bound), D (connects to P) and P's engine (connects to its
own worker, sends FIRST_TOKEN right after sampling). Waits are bounded polls, not timings.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from splitserve.transfer import messages
from splitserve.transfer.side_channel import Inbound, PeerRef, SideChannel

KEY = b"relay-test-key"


def wait_for(receive, count: int, bound: float = 10.0) -> list:
    got: list = []
    end = time.monotonic() + bound
    while len(got) < count:
        got += [e for e in receive() if isinstance(e, Inbound)]
        if time.monotonic() > end:
            raise AssertionError(f"{len(got)} of {count} messages within {bound} s: {got}")
        time.sleep(0.005)
    return got


@pytest.fixture
def sides() -> Iterator[tuple[SideChannel, SideChannel, SideChannel, PeerRef]]:
    worker = SideChannel("127.0.0.1", 0, KEY, name="test-p-worker")
    d = SideChannel(None, None, KEY, name="test-d")
    engine = SideChannel(None, None, KEY, name="test-p-engine")
    p_addr = PeerRef(host="127.0.0.1", port=worker.bound_port)
    d.send(p_addr, messages.Abort(transfer_id="hello-from-d", reason="identify"))
    (first,) = wait_for(worker.receive_bound, 1)
    try:
        yield worker, d, engine, first.peer
    finally:
        for channel in (worker, d, engine):
            channel.close()


def token(tid: str, value: int) -> messages.FirstToken:
    return messages.FirstToken(transfer_id=tid, token=value, sampled_wall=time.time())


def test_first_token_is_relayed_to_the_routed_receiver_after_what_p_sent(sides) -> None:
    worker, d, engine, d_peer = sides
    p_addr = PeerRef(host="127.0.0.1", port=worker.bound_port)
    worker.relay_first_token("t", d_peer)
    announce = messages.Announce(transfer_id="t", layers=[0], src_block_ids=[1], dst_block_ids=[2])
    worker.send(d_peer, announce)
    engine.send(p_addr, token("unrouted", 1))
    engine.send(p_addr, token("t", 42))
    got = [e.message for e in wait_for(d.receive_connected, 2)]
    assert [type(m).__name__ for m in got] == ["Announce", "FirstToken"]
    assert got[1].transfer_id == "t" and got[1].token == 42
    assert worker.relayed == 1
    assert worker.receive_bound() == [], "relayed or dropped, never handed to the sender"


def test_no_relay_after_the_route_is_cleared_and_none_for_a_forged_token(sides) -> None:
    worker, d, engine, d_peer = sides
    p_addr = PeerRef(host="127.0.0.1", port=worker.bound_port)
    worker.relay_first_token("t", d_peer)
    worker.relay_first_token("t", None)
    forger = SideChannel(None, None, b"not-the-key", name="test-forger")
    try:
        worker.relay_first_token("u", d_peer)
        forger.send(p_addr, token("u", 666))
        engine.send(p_addr, token("t", 7))
        engine.send(p_addr, token("u", 8))
        (only,) = [e.message for e in wait_for(d.receive_connected, 1)]
        assert (only.transfer_id, only.token) == ("u", 8)
        end = time.monotonic() + 10
        # the forger, without the key, cannot even complete the CurveZMQ handshake
        while worker.stats.refused_handshakes < 1 and time.monotonic() < end:
            time.sleep(0.005)
        assert worker.stats.refused_handshakes >= 1 and worker.relayed == 1
        assert worker.stats.rejected == 0, "no byte of the forger reached the decoder"
    finally:
        forger.close()
