"""KVReceiver (D's half), push and pull, against the fakes of the NIXL agent and side channel.

The fakes (``tests/unit/fakes.py``) only record what our logic asks of them; the real agent and
channel are tested between real processes in tests/integration.
"""

from __future__ import annotations

import pytest
from transfer_steps import (
    LAYERS,
    NUM_BLOCKS,
    P_ADDR,
    announce,
    complete_all,
    first_token,
    make_receiver,
    pull_done,
    pull_receiver,
    pull_receiver_for_first_token,
    sent_of,
)

from splitserve.transfer import messages
from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef


def test_receiver_registers_and_completes_on_done():
    receiver, agent, channel = make_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0)
    assert [type(m).__name__ for _, m in channel.sent] == ["Hello", "Register"]
    channel.inbox.append(Inbound(P_ADDR, messages.HelloAck(agent_name="P")))
    receiver.poll()
    done = messages.Done(transfer_id="t", num_blocks=2, prefill_end_wall=0.0)
    agent.notifs = {"Mallory": [messages.encode(done)]}
    assert receiver.poll() == {}, "DONE from another agent is ignored"
    agent.notifs = {"P": [messages.encode(done)]}
    outcome = receiver.poll()["t"]
    assert outcome.ok


def test_receiver_fails_on_lost_peer_and_on_abort():
    receiver, agent, channel = make_receiver()
    receiver.expect("a", "127.0.0.1", 1, [4], 0)
    receiver.expect("b", "127.0.0.1", 2, [5], 0)
    channel.inbox.append(PeerLost(P_ADDR))
    channel.inbox.append(
        Inbound(PeerRef(host="127.0.0.1", port=2), messages.Abort(transfer_id="b", reason="x"))
    )
    settled = receiver.poll()
    assert not settled["a"].ok and "lost connection" in settled["a"].reason
    assert not settled["b"].ok and "aborted" in settled["b"].reason


def test_receiver_timeout_waits_for_ack_before_settling():
    receiver, agent, channel = make_receiver(done_timeout_s=2)
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    settled = {}
    for _ in range(3):
        settled |= receiver.poll()
    assert settled == {}, "held until P acknowledges (or the ack timeout)"
    assert isinstance(channel.sent[-1][1], messages.Abort)
    channel.inbox.append(Inbound(P_ADDR, messages.AbortAck(transfer_id="t")))
    outcome = receiver.poll()["t"]
    assert not outcome.ok and "no DONE" in outcome.reason


def test_receiver_local_abort_settles_on_ack_timeout_without_answer():
    receiver, agent, channel = make_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    receiver.abort("t", "client left")
    settled = {}
    for _ in range(6):
        settled |= receiver.poll()
    assert not settled["t"].ok and "aborted" in settled["t"].reason


def test_receiver_passes_the_first_token_and_fails_a_done_without_it():
    receiver, agent, channel = make_receiver()
    receiver.expect("a", "127.0.0.1", 1, [4], 0, first_token=True)
    receiver.expect("b", "127.0.0.1", 1, [5], 0, first_token=True)
    assert channel.sent[1][1].first_token is True
    channel.inbox.append(Inbound(P_ADDR, messages.HelloAck(agent_name="P")))
    receiver.poll()
    with_token = messages.Done(transfer_id="a", num_blocks=1, prefill_end_wall=0.0, first_token=5)
    without = messages.Done(transfer_id="b", num_blocks=1, prefill_end_wall=0.0)
    agent.notifs = {"P": [messages.encode(with_token), messages.encode(without)]}
    settled = receiver.poll()
    assert settled["a"].ok and settled["a"].first_token == 5
    assert not settled["b"].ok and "no first token" in settled["b"].reason


def test_receiver_pulls_announced_blocks_and_completes_after_its_reads():
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0, first_token=True)
    channel.inbox.append(Inbound(P_ADDR, ack))
    for layer in range(LAYERS):
        announce(channel, "t", [layer], [10, 11], [4, 5])
    assert receiver.poll() == {}
    assert agent.peers_added == [b"p-meta"]
    assert [h.op for h in agent.posted] == ["READ"] * LAYERS
    # READ copies are (layer, local = our block, remote = P's block)
    assert sorted(c for h in agent.posted for c in h.copies) == sorted(
        (layer, d, s) for layer in range(LAYERS) for s, d in [(10, 4), (11, 5)]
    )
    pull_done(channel, "t", 2, first_token=9)
    assert receiver.poll() == {}, "DONE is there, but a READ is still in flight"
    assert not sent_of(channel, messages.Pulled)
    complete_all(agent)
    outcome = receiver.poll()["t"]
    assert outcome.ok and outcome.first_token == 9
    assert [m.transfer_id for m in sent_of(channel, messages.Pulled)] == ["t"]
    assert receiver.stats.reads_posted == LAYERS


@pytest.mark.parametrize(
    ("layers", "src", "dst", "why"),
    [
        ([0], [1], [6], "did not register"),
        ([0], [NUM_BLOCKS], [4], "outside the cache"),
        ([0], [1, 2], [4], "source blocks"),
        ([LAYERS], [1], [4], "layer outside"),
        ([0, 0], [1], [4], "duplicate"),
    ],
)
def test_receiver_refuses_an_invalid_announce(layers, src, dst, why):
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    announce(channel, "t", layers, src, dst)
    settled = receiver.poll()
    assert agent.posted == [] and settled == {}
    (abort,) = sent_of(channel, messages.Abort)
    assert why in abort.reason
    channel.inbox.append(Inbound(P_ADDR, messages.AbortAck(transfer_id="t")))
    outcome = receiver.poll()["t"]
    assert not outcome.ok and why in outcome.reason


def test_receiver_refuses_a_block_announced_twice_and_an_early_done():
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("a", "127.0.0.1", 1, [4], 0)
    receiver.expect("b", "127.0.0.1", 1, [5], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    announce(channel, "a", [0], [1], [4])
    announce(channel, "a", [0], [2], [4])
    announce(channel, "b", [0], [3], [5])
    pull_done(channel, "b", 1)  # layers 1.. never announced
    receiver.poll()
    reasons = {m.transfer_id: m.reason for m in sent_of(channel, messages.Abort)}
    assert "announced twice" in reasons["a"] and "before every" in reasons["b"]


def test_receiver_read_failure_fails_the_load_once_no_read_is_in_flight():
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    announce(channel, "t", [0], [1], [4])
    announce(channel, "t", [1], [1], [4])
    receiver.poll()
    agent.posted[0].state = "ERR"
    assert receiver.poll() == {}
    assert "READ" in sent_of(channel, messages.Abort)[0].reason
    channel.inbox.append(Inbound(P_ADDR, messages.AbortAck(transfer_id="t")))
    assert receiver.poll() == {}, "the other READ may still fill our blocks"
    agent.posted[1].state = "DONE"
    outcome = receiver.poll()["t"]
    assert not outcome.ok and "READ" in outcome.reason


def test_receiver_lost_prefill_side_settles_after_its_reads():
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    announce(channel, "t", [0], [1], [4])
    receiver.poll()
    channel.inbox.append(PeerLost(P_ADDR))
    assert receiver.poll() == {}
    agent.posted[0].state = "ERR"  # what NIXL reports once the peer is gone
    outcome = receiver.poll()["t"]
    assert not outcome.ok and "lost connection" in outcome.reason


def test_receiver_refuses_pull_messages_from_a_pushing_sender():
    receiver, agent, channel = make_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(Inbound(P_ADDR, messages.HelloAck(agent_name="P")))
    announce(channel, "t", [0], [1], [4])
    receiver.poll()
    assert agent.posted == []
    assert "did not offer pull" in sent_of(channel, messages.Abort)[0].reason


def test_receiver_ignores_a_done_notification_for_a_pulled_transfer():
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    receiver.poll()
    done = messages.Done(transfer_id="t", num_blocks=1, prefill_end_wall=0.0)
    agent.notifs = {"P": [messages.encode(done)]}
    assert receiver.poll() == {}
    assert receiver.stats.messages_rejected == 1


def test_receiver_completes_on_first_token_once_everything_is_announced_and_read():
    receiver, agent, channel = pull_receiver_for_first_token()
    for layer in range(LAYERS - 1):
        announce(channel, "t", [layer], [10, 11], [4, 5])
    first_token(channel, "t", 77)
    complete_all(agent)
    assert receiver.poll() == {}, "the last layer is not announced yet"
    announce(channel, "t", [LAYERS - 1], [10, 11], [4, 5])
    assert receiver.poll() == {}, "its READ is in flight"
    complete_all(agent)
    outcome = receiver.poll()["t"]
    assert outcome.ok and outcome.first_token == 77
    assert [m.transfer_id for m in sent_of(channel, messages.Pulled)] == ["t"]
    pull_done(channel, "t", 2, first_token=77)  # P's DONE crossed our PULLED
    assert receiver.poll() == {}
    assert receiver.stats.messages_rejected == 0 and receiver.stats.transfers_completed == 1
    assert receiver.stats.completed_on_first_token == 1
    assert len(sent_of(channel, messages.Pulled)) == 1


def test_receiver_ignores_first_token_for_a_transfer_that_did_not_ask_or_another_peer():
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)  # no first token asked
    receiver.expect("u", "127.0.0.1", 1, [5], 0, first_token=True)
    channel.inbox.append(Inbound(P_ADDR, ack))
    for layer in range(LAYERS):
        announce(channel, "t", [layer], [10], [4])
        announce(channel, "u", [layer], [11], [5])
    first_token(channel, "t", 1)
    first_token(channel, "u", 2, peer=PeerRef(host="127.0.0.1", port=9))
    receiver.poll()
    complete_all(agent)
    assert receiver.poll() == {}, "neither completes without DONE"
    pull_done(channel, "t", 1)
    pull_done(channel, "u", 1, first_token=2)
    settled = receiver.poll()
    assert settled["t"].ok and settled["t"].first_token is None
    assert settled["u"].ok and settled["u"].first_token == 2


def _refusal(transfer_id: str) -> Inbound:
    reason = messages.HELLO_REFUSAL + "no valid HELLO on this connection; say HELLO again"
    return Inbound(P_ADDR, messages.Abort(transfer_id=transfer_id, reason=reason))


def test_a_register_refused_for_its_hello_is_said_again_once_after_a_new_hello():
    """P restarted (or pruned us): our REGISTER found no HELLO there. D says HELLO again and
    the same REGISTER, and the load goes on; refused a second time, it fails."""
    receiver, agent, channel = make_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0)
    (register,) = sent_of(channel, messages.Register)
    channel.sent.clear()
    channel.inbox.append(_refusal("t"))
    assert receiver.poll() == {}, "not failed: registered again"
    assert [type(m).__name__ for _, m in channel.sent] == ["Hello", "Register"]
    assert sent_of(channel, messages.Register) == [register]
    assert receiver.stats.registered_again == 1
    channel.sent.clear()
    channel.inbox.append(_refusal("t"))
    settled = receiver.poll()
    assert not settled["t"].ok and "say HELLO again" in settled["t"].reason
    assert channel.sent == [], "never a third time"


def test_refusals_of_registers_sent_before_one_hello_say_hello_once():
    """Two REGISTERs behind one refused HELLO: the first refusal says HELLO again, the second
    (its REGISTER came before that new HELLO) only registers again."""
    receiver, agent, channel = make_receiver()
    receiver.expect("a", "127.0.0.1", 1, [4], 0)
    receiver.expect("b", "127.0.0.1", 1, [5], 0)
    channel.sent.clear()
    channel.inbox += [_refusal("a"), _refusal("b")]
    assert receiver.poll() == {}
    kinds = [(type(m).__name__, getattr(m, "transfer_id", None)) for _, m in channel.sent]
    assert kinds == [("Hello", None), ("Register", "a"), ("Register", "b")]


def test_a_hello_refusal_for_every_transfer_spares_those_p_already_serves():
    """``*``: P holds no HELLO of ours. Transfers it has not started serving register again;
    one it serves (an ANNOUNCE came: the refusal is older than its registration) goes on."""
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("a", "127.0.0.1", 1, [4], 0)
    receiver.expect("b", "127.0.0.1", 1, [5], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    announce(channel, "b", [0], [1], [5])
    receiver.poll()
    channel.sent.clear()
    channel.inbox.append(_refusal("*"))
    assert receiver.poll() == {}, "neither failed"
    registered = [m.transfer_id for m in sent_of(channel, messages.Register)]
    assert registered == ["a"] and len(sent_of(channel, messages.Hello)) == 1


def test_an_abort_star_that_is_no_hello_refusal_still_fails_every_load():
    receiver, agent, channel = make_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(Inbound(P_ADDR, messages.Abort(transfer_id="*", reason="shutting down")))
    settled = receiver.poll()
    assert not settled["t"].ok and "shutting down" in settled["t"].reason


def test_a_loss_reported_while_idle_is_handled_before_the_next_registration():
    """P restarted while D's engine was idle (no poll): the old connection's loss waits in the
    channel. The next load must say HELLO (the new P knows none) and must not fail because of
    that older loss."""
    receiver, agent, channel = make_receiver()
    receiver.expect("old", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(PeerLost(P_ADDR))  # reported, not yet polled
    channel.sent.clear()
    receiver.expect("new", "127.0.0.1", 1, [5], 0)
    assert [type(m).__name__ for _, m in channel.sent] == ["Hello", "Register"]
    settled = receiver.poll()
    assert set(settled) == {"old"} and "lost connection" in settled["old"].reason
