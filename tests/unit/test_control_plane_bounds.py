"""Unit tests of our own bounds on what a peer sends (pure: no socket, no engine)."""

from __future__ import annotations

import contextlib
import random

import pytest

from splitserve.transfer import messages
from splitserve.transfer.auth import CurveKeys, PeerLog
from splitserve.transfer.layout import PEER_BLOCKS_FACTOR, KVLayout


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 2000,
        b'{"a":' * 5000,
        b"\xff\xfe",
        b"[]",
        b'{"v": 1, "type": "abort", "transfer_id": "t", "reason": "' + b"x" * 5000 + b'"}',
        b'{"v": 1, "type": "register", "transfer_id": "t", "agent_name": "a", "block_ids": [[-1]],'
        b' "token_offset": 0}',
        b'{"v": 1, "type": "announce", "transfer_id": "t", "layers": [99999],'
        b' "src_block_ids": [0], "dst_block_ids": [0]}',
        b'{"v": 1, "type": "done", "transfer_id": "' + b"t" * 200 + b'", "num_blocks": 1,'
        b' "prefill_end_wall": 0}',
    ],
)
def test_any_hostile_body_is_a_message_error(body: bytes) -> None:
    with pytest.raises(messages.MessageError):
        messages.decode(b"\x00" + body)


def test_random_bytes_never_escape_as_another_exception() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        wire = rng.randbytes(rng.randrange(0, 300))
        with contextlib.suppress(messages.MessageError):
            messages.decode(wire, b"k" * 16 if rng.random() < 0.5 else None)


def test_an_oversized_message_is_refused_before_parsing() -> None:
    with pytest.raises(messages.MalformedMessageError, match="limit"):
        messages.decode(b"\x00" + b" " * (messages.MAX_MESSAGE_BYTES + 1))


def _layout(num_blocks: int) -> KVLayout:
    layer = {"base_addr": 4096, "block_stride": 64, "num_blocks": num_blocks, "runs": [[0, 64]]}
    return KVLayout.model_validate({"block_size": 16, "layers": [layer, layer]})


def test_a_peer_declaring_absurd_block_counts_is_incompatible_before_any_allocation() -> None:
    ours = _layout(1000)
    assert ours.incompatibility(_layout(1000 * PEER_BLOCKS_FACTOR)) is None
    problem = ours.incompatibility(_layout(10**12))
    assert problem is not None and "more than" in problem


def test_curve_keys_are_derived_alike_from_the_same_key_only() -> None:
    a, b = CurveKeys.derive(b"k" * 16), CurveKeys.derive(b"k" * 16)
    assert a == b and len(a.server_public) == 40 and a.server_public != a.client_public
    assert CurveKeys.derive(b"j" * 16).server_public != a.server_public


def test_peer_log_logs_once_per_peer_and_kind(caplog) -> None:
    import logging

    log = PeerLog(logging.getLogger("test.peerlog"), every_s=60)
    with caplog.at_level(logging.WARNING, logger="test.peerlog"):
        for _ in range(100):
            log.warn("p1", "rejected", "bad from %s", "p1")
        log.warn("p2", "rejected", "bad from %s", "p2")
        log.warn("p1", "other", "other from %s", "p1")
    assert [r.getMessage() for r in caplog.records] == [
        "bad from p1",
        "bad from p2",
        "other from p1",
    ]


# -- a connection speaks for one agent (sender side; the attacker is a message in the inbox) ----


def _hello_sender():
    from fakes import FakeAgent, FakeChannel
    from transfer_steps import LAYOUT

    from splitserve.transfer.sender import KVSender

    agent, channel = FakeAgent(LAYOUT), FakeChannel()
    agent.peer_name = "D1"
    sender = KVSender(agent, channel, lease_s=10.0)
    return sender, agent, channel, LAYOUT


def _hello(name: str, layout) -> messages.Hello:
    return messages.Hello(agent_name=name, agent_metadata=b"m", layout=layout.model_dump())


def test_a_hello_replayed_on_another_connection_is_refused_and_its_register_too() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    d1 = PeerRef(inbound=messages.routing_id("D1"))
    mallory = PeerRef(inbound=messages.routing_id("mallory"))
    channel.inbox.append(Inbound(d1, _hello("D1", layout)))
    channel.inbox.append(Inbound(mallory, _hello("D1", layout)))  # D1's HELLO, replayed
    steal = messages.Register(transfer_id="x", agent_name="D1", block_ids=[[1, 2]], token_offset=0)
    channel.inbox.append(Inbound(mallory, steal))
    sender.poll()
    to_mallory = [m for peer, m in channel.sent if peer == mallory]
    assert [type(m).__name__ for m in to_mallory] == ["Abort", "Abort"]
    assert "does not belong" in to_mallory[0].reason and "HELLO" in to_mallory[1].reason
    assert [type(m).__name__ for peer, m in channel.sent if peer == d1] == ["HelloAck"]
    assert agent.peers_added == [b"m"], "the replayed HELLO was not even loaded"
    assert sender.registration_of("x") is None


def test_a_hello_whose_metadata_names_another_agent_is_refused() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    agent.peer_name = "D2"  # the metadata inside is another agent's
    peer = PeerRef(inbound=messages.routing_id("D1"))
    channel.inbox.append(Inbound(peer, _hello("D1", layout)))
    sender.poll()
    (answer,) = [m for _, m in channel.sent]
    assert isinstance(answer, messages.Abort) and "names agent 'D2'" in answer.reason


def test_only_the_registrant_withdraws_an_early_registration() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    d1 = PeerRef(inbound=messages.routing_id("D1"))
    other = PeerRef(inbound=messages.routing_id("D9"))
    channel.inbox.append(Inbound(d1, _hello("D1", layout)))
    reg = messages.Register(transfer_id="t", agent_name="D1", block_ids=[[1]], token_offset=0)
    channel.inbox.append(Inbound(d1, reg))  # before P has the request: kept as an orphan
    channel.inbox.append(Inbound(other, messages.Abort(transfer_id="t", reason="hostile")))
    sender.poll()
    assert sender.registration_of("t") is not None, "another peer's ABORT withdrew it"


def test_a_reconnecting_receiver_takes_its_routing_id_over() -> None:
    """Real ZMQ, our side channel's ROUTER: a second connection with D1's routing id (D1 back
    after a partition, before P noticed the old one died) is served, not refused."""
    import time

    import zmq

    from splitserve.transfer.side_channel import SideChannel

    p = SideChannel("127.0.0.1", 0, None, name="test-p")
    ctx = zmq.Context()
    try:
        for text in (b"\x00first", b"\x00second"):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, messages.routing_id("D1", "p:1"))
            dealer.connect(f"tcp://127.0.0.1:{p.bound_port}")
            dealer.send(text)
            time.sleep(0.3)
        end = time.monotonic() + 5
        while p.stats.rejected < 2 and time.monotonic() < end:
            time.sleep(0.02)
        assert p.stats.rejected == 2, "the second connection's message never arrived"
    finally:
        ctx.destroy(0)
        p.close()


# -- deadlines: no state waits forever for a transport gone silent ------------------------------


def test_push_writes_that_never_complete_fail_the_transfer_within_the_lease_and_free() -> None:
    from transfer_steps import make_sender, register, run_prefill

    from splitserve.transfer.state import TransferState

    sender, agent, channel = make_sender(lease_s=10.0)  # its clock: one second per call
    sender.add_request("t", 40)
    register(channel, "t", [5, 6, 7])
    run_prefill(sender, "t", [1, 2, 3], [40])  # every WRITE stays in flight, forever
    sender.finish_request("t")
    released: set[str] = set()
    for _ in range(30):  # well past the lease
        released |= sender.poll()
    assert released == {"t"}, "the stalled transfer's blocks were never freed"
    assert sender.state_of("t") is None
    assert sender.stats.transfers_stalled == 1
    assert all(getattr(h, "released", False) for h in agent.posted), "posts not cancelled"
    (abort,) = [m for _, m in channel.sent if isinstance(m, messages.Abort)]
    assert "stalled" in abort.reason
    assert TransferState.FAILED.value in abort.reason


def test_slow_but_moving_writes_never_stall() -> None:
    from transfer_steps import make_sender, register, run_prefill

    sender, agent, channel = make_sender(lease_s=10.0)
    sender.add_request("t", 400)
    register(channel, "t", list(range(5, 30)))
    for computed in range(16, 401, 16):  # a long prefill: each step one WRITE completes
        run_prefill(sender, "t", list(range(1, 26)), [computed])
        agent.posted[0].state = "DONE"
        agent.posted.pop(0)
    assert sender.stats.transfers_stalled == 0


def test_reads_of_an_ended_load_that_never_settle_are_cancelled_and_the_load_settles() -> None:
    from transfer_steps import P_ADDR, announce, pull_receiver

    from splitserve.transfer.side_channel import Inbound

    receiver, agent, channel, ack = pull_receiver()  # abort_ack_timeout_s=3, 1 s per call
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    announce(channel, "t", [0], [1], [4])
    announce(channel, "t", [1], [1], [4])
    receiver.poll()
    agent.posted[0].state = "ERR"  # one READ fails; the other never settles
    outcomes: dict = {}
    for _ in range(20):
        outcomes |= receiver.poll()
    assert not outcomes["t"].ok and "READ" in outcomes["t"].reason
    assert receiver.stats.reads_cancelled == 1
    assert getattr(agent.posted[1], "released", False)


def test_one_agent_may_reach_a_sender_by_two_addresses() -> None:
    """Each address an agent dials gets its own routing id (a sender named by host name and by
    address is two connections, both served); a HELLO still binds to the one it names."""
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    targets = ("p0.pool:5600", "10.0.0.7:5600")
    assert messages.routing_id("D1", targets[0]) != messages.routing_id("D1", targets[1])
    for target in targets:
        peer = PeerRef(inbound=messages.routing_id("D1", target))
        hello = _hello("D1", layout).model_copy(update={"target": target})
        channel.inbox.append(Inbound(peer, hello))
    wrong = PeerRef(inbound=messages.routing_id("D1", targets[0]))
    hello = _hello("D1", layout).model_copy(update={"target": targets[1]})
    channel.inbox.append(Inbound(wrong, hello))  # names the other address: not its connection
    sender.poll()
    kinds = [type(m).__name__ for _, m in channel.sent]
    assert kinds == ["HelloAck", "HelloAck", "Abort"]
