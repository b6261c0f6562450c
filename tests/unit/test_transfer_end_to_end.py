"""P's KVSender and D's KVReceiver wired to each other through the fakes: every message P sends
is handed to D and back, so a whole pulled transfer runs end to end without NIXL or sockets.
"""

from __future__ import annotations

from transfer_steps import (
    LAYERS,
    P_ADDR,
    PEER,
    complete_all,
    first_token,
    pull_receiver,
    pull_receiver_for_first_token,
    pull_sender,
    register,
    register_for_first_token,
    sent_of,
)

from splitserve.transfer import messages
from splitserve.transfer.sender import StepUpdate
from splitserve.transfer.side_channel import Inbound


def stream_to_receiver(sender, p_channel, receiver, d_channel, d_agent, poll_sender=False):
    """Two steps of a 40-token prefill of "t" on P's blocks 1-3, each message P sends handed
    to D as it goes out, D's READs completing at once."""
    for computed in (20, 40):
        sender.begin_step([StepUpdate("t", [1, 2, 3], computed)])
        for layer in range(LAYERS):
            sender.layer_done(layer)
            for _, message in p_channel.sent:
                d_channel.inbox.append(Inbound(P_ADDR, message))
            p_channel.sent.clear()
            receiver.poll()
            complete_all(d_agent)
        sender.end_step()
        if poll_sender:
            sender.poll()


def test_pull_end_to_end_between_fake_sides_is_exactly_once():
    """P's ANNOUNCEs fed to D: D READs each (layer, block) once, P frees on D's PULLED."""
    sender, p_agent, p_channel = pull_sender()
    receiver, d_agent, d_channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [9, 8, 7], 0)
    d_channel.inbox.append(Inbound(P_ADDR, ack))
    sender.add_request("t", 40)
    register(p_channel, "t", [9, 8, 7])
    stream_to_receiver(sender, p_channel, receiver, d_channel, d_agent)
    sender.finish_request("t")
    sender.poll()
    for _, message in p_channel.sent:
        d_channel.inbox.append(Inbound(P_ADDR, message))
    outcome = receiver.poll()["t"]
    assert outcome.ok
    reads = sorted(c for h in d_agent.posted for c in h.copies)
    assert reads == sorted(
        (layer, d, s) for layer in range(LAYERS) for s, d in [(1, 9), (2, 8), (3, 7)]
    )
    (pulled,) = sent_of(d_channel, messages.Pulled)
    p_channel.inbox.append(Inbound(PEER, pulled))
    assert sender.poll() == {"t"}


def test_pull_end_to_end_with_first_token_needs_no_done():
    """P's ANNOUNCEs and its engine's FIRST_TOKEN fed to D: D READs each (layer, block) once
    and completes; P frees on PULLED having sent no DONE."""
    sender, p_agent, p_channel = pull_sender()
    receiver, d_agent, d_channel = pull_receiver_for_first_token([9, 8, 7])
    sender.add_request("t", 40)
    register_for_first_token(p_channel, "t", [9, 8, 7])
    stream_to_receiver(sender, p_channel, receiver, d_channel, d_agent, poll_sender=True)
    assert p_channel.routes == {"t": PEER}
    first_token(d_channel, "t", 5)  # what P's side channel relays
    outcome = receiver.poll()["t"]
    assert outcome.ok and outcome.first_token == 5
    reads = sorted(c for h in d_agent.posted for c in h.copies)
    assert reads == sorted(
        (layer, d, s) for layer in range(LAYERS) for s, d in [(1, 9), (2, 8), (3, 7)]
    )
    (pulled,) = sent_of(d_channel, messages.Pulled)
    p_channel.inbox.append(Inbound(PEER, pulled))
    sender.finish_request("t", first_token=5)
    assert sender.poll() == {"t"}
    assert not sent_of(p_channel, messages.Done)
