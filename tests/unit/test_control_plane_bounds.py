"""Unit tests of our own bounds on what a peer sends (pure: no socket, no engine)."""

from __future__ import annotations

import contextlib
import itertools
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
    clock = itertools.count().__next__  # every call is one second later
    sender = KVSender(agent, channel, lease_s=10.0, clock=lambda: float(clock()))
    return sender, agent, channel, LAYOUT


def _test_layout():
    from transfer_steps import LAYOUT

    return LAYOUT


def _hello(name: str, layout) -> messages.Hello:
    return messages.Hello(agent_name=name, agent_metadata=b"m", layout=layout.model_dump())


D1 = b"ss:d1-connection"
MALLORY = b"ss:mallory-connection"


def _steal() -> messages.Register:
    return messages.Register(transfer_id="x", agent_name="D1", block_ids=[[1, 2]], token_offset=0)


def _replayed(layout, answer: bool | None):
    """D1 is admitted; its HELLO is replayed on another connection with a REGISTER behind it;
    D1 answers P's question with ``answer`` (None: never)."""
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, _ = _hello_sender()
    d1, mallory = PeerRef(inbound=D1), PeerRef(inbound=MALLORY)
    channel.inbox.append(Inbound(d1, _hello("D1", layout)))
    channel.inbox.append(Inbound(mallory, _hello("D1", layout)))  # D1's HELLO, replayed
    channel.inbox.append(Inbound(mallory, _steal()))
    sender.poll()
    (ask,) = [m for peer, m in channel.sent if peer == d1 and isinstance(m, messages.Confirm)]
    assert bytes.fromhex(ask.routing_id) == MALLORY
    assert sender.registration_of("x") is None, "held until D1 answers"
    if answer is not None:
        channel.inbox.append(Inbound(d1, messages.Confirmed(nonce=ask.nonce, owned=answer)))
        sender.poll()
    else:
        for _ in range(8):  # past confirm_timeout_s (the test clock: one second a call)
            sender.poll()
    return sender, channel, d1, mallory


def test_a_hello_replayed_on_another_connection_is_refused_and_its_register_too() -> None:
    sender, channel, d1, mallory = _replayed(_test_layout(), answer=False)
    to_mallory = [m for peer, m in channel.sent if peer == mallory]
    assert [type(m).__name__ for m in to_mallory] == ["Abort", "Abort"]
    assert "did not confirm" in to_mallory[0].reason
    assert to_mallory[1].transfer_id == "x" and "say HELLO again" in to_mallory[1].reason
    assert [type(m).__name__ for peer, m in channel.sent if peer == d1] == ["HelloAck", "Confirm"]
    assert sender.registration_of("x") is None


def test_a_replayed_hello_that_nobody_confirms_is_refused_within_the_timeout() -> None:
    sender, channel, _, mallory = _replayed(_test_layout(), answer=None)
    to_mallory = [m for peer, m in channel.sent if peer == mallory]
    assert [type(m).__name__ for m in to_mallory] == ["Abort", "Abort"]
    assert sender.registration_of("x") is None


def test_a_second_connection_the_agent_confirms_is_served_with_what_it_sent_meanwhile() -> None:
    """One agent may reach a sender by two addresses (a host name and an address; a relay):
    the second connection is admitted once the agent confirms it over the first."""
    sender, channel, _, second = _replayed(_test_layout(), answer=True)
    assert [type(m).__name__ for peer, m in channel.sent if peer == second] == ["HelloAck"]
    assert sender.registration_of("x") is not None, "the held REGISTER was handled"


def test_a_blink_of_the_admitted_connection_neither_unbinds_it_nor_admits_the_waiting_one() -> None:
    """A reply that finds the agent's connection down (between its reconnections, with the same
    routing id) keeps its binding, and the connection waiting for its confirmation is refused
    at its deadline, not bound on the blink (that would let a replayed HELLO in)."""
    from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef

    sender, agent, channel, layout = _hello_sender()
    old, new = PeerRef(inbound=D1), PeerRef(inbound=b"ss:claims-to-be-d1")
    channel.inbox.append(Inbound(old, _hello("D1", layout)))
    channel.inbox.append(Inbound(new, _hello("D1", layout)))
    channel.inbox.append(Inbound(new, _steal()))
    sender.poll()
    channel.inbox.append(PeerLost(old, "connection gone"))  # the Confirm found no such peer
    for _ in range(8):
        sender.poll()
    assert [type(m).__name__ for peer, m in channel.sent if peer == new][0] == "Abort"
    assert sender.peers.agent_of(new) is None and sender.peers.agent_of(old) == "D1"
    assert sender.registration_of("x") is None


def test_a_register_on_an_unbound_connection_makes_the_receiver_say_hello_again() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    channel.inbox.append(Inbound(PeerRef(inbound=D1), _steal()))
    sender.poll()
    aborts = [(m.transfer_id, m.reason) for _, m in channel.sent if isinstance(m, messages.Abort)]
    # One ABORT, naming the transfer, as a HELLO refusal: the receiver says HELLO again and
    # registers it again (receiver tests); nothing for the connection's other transfers.
    assert aborts == [("x", messages.HELLO_REFUSAL + "no valid HELLO on this connection; "
                       "say HELLO again")]  # fmt: skip


def test_a_connection_may_not_switch_agents() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    d1 = PeerRef(inbound=D1)
    channel.inbox.append(Inbound(d1, _hello("D1", layout)))
    sender.poll()
    agent.peer_name = "D2"
    channel.inbox.append(Inbound(d1, _hello("D2", layout)))
    sender.poll()
    kinds = [(type(m).__name__, getattr(m, "reason", "")) for _, m in channel.sent]
    assert kinds[0][0] == "HelloAck" and kinds[1][0] == "Abort"
    assert "speaks for agent 'D1'" in kinds[1][1]
    assert sender.peers.agent_of(d1) == "D1"


def test_a_hello_whose_metadata_names_another_agent_is_refused() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    agent.peer_name = "D2"  # the metadata inside is another agent's
    peer = PeerRef(inbound=D1)
    channel.inbox.append(Inbound(peer, _hello("D1", layout)))
    sender.poll()
    (answer,) = [m for _, m in channel.sent]
    assert isinstance(answer, messages.Abort) and "names agent 'D2'" in answer.reason


def test_only_the_registrant_withdraws_an_early_registration() -> None:
    from splitserve.transfer.side_channel import Inbound, PeerRef

    sender, agent, channel, layout = _hello_sender()
    d1 = PeerRef(inbound=D1)
    other = PeerRef(inbound=b"ss:d9")
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
    identity = messages.new_routing_id()
    try:
        for text in (b"\x00first", b"\x00second"):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.ROUTING_ID, identity)
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


def test_a_reply_to_a_gone_connection_reports_it_lost_and_a_receiver_knows_its_own_ids() -> None:
    """Real ZMQ both sides: P's reply to a routing id with no connection comes back as
    ``PeerLost`` (so its binding is dropped), and a receiver's channel answers ``owns`` only
    for the random id it dials an address with."""
    import time

    from splitserve.transfer.side_channel import PeerLost, PeerRef, SideChannel

    p = SideChannel("127.0.0.1", 0, None, name="test-p")
    d = SideChannel(None, None, None, name="test-d")
    try:
        p.send(PeerRef(inbound=b"ss:nobody"), messages.AbortAck(transfer_id="t"))
        target = PeerRef(host="127.0.0.1", port=p.bound_port)
        d.send(target, messages.Abort(transfer_id="t", reason="r"))
        events: list = []
        end = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < end:
            events += p.receive_bound()
            time.sleep(0.02)
        lost = [e for e in events if isinstance(e, PeerLost)]
        assert [e.peer.inbound for e in lost] == [b"ss:nobody"]
        (arrived,) = [e for e in events if not isinstance(e, PeerLost)]
        ours = arrived.peer.inbound
        assert d.owns(ours) and d.owns(ours, f"127.0.0.1:{p.bound_port}")
        assert not d.owns(ours, "127.0.0.1:1") and not d.owns(messages.new_routing_id())
    finally:
        d.close()
        p.close()


def test_a_receiver_answers_a_confirm_from_its_own_routing_ids() -> None:
    from transfer_steps import P_ADDR, pull_receiver

    from splitserve.transfer.side_channel import Inbound

    receiver, agent, channel, _ = pull_receiver()
    channel.owned.add((b"ss:mine", "127.0.0.1:1"))
    for routing_id, target in ((b"ss:mine", "127.0.0.1:1"), (b"ss:theirs", "127.0.0.1:1")):
        ask = messages.Confirm(nonce="n" * 32, routing_id=routing_id.hex(), target=target)
        channel.inbox.append(Inbound(P_ADDR, ask))
    receiver.poll()
    answers = [m.owned for _, m in channel.sent if isinstance(m, messages.Confirmed)]
    assert answers == [True, False]


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
