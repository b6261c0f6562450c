"""Shared steps of the KVSender / KVReceiver unit tests: a small layout, a sender and a receiver
over the fakes of ``tests/unit/fakes.py``, and helpers that feed them messages and read back what
they posted and sent.

Imported as ``from transfer_steps import ...`` (pytest puts ``tests/unit`` on ``sys.path``).
"""

from __future__ import annotations

import itertools

import torch
from fakes import FakeAgent, FakeChannel

from splitserve.transfer import messages
from splitserve.transfer.layout import kv_layout_from_tensors
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import Inbound, PeerRef
from splitserve.transfer.strategy import Direction

B = 16
LAYERS = 3
NUM_BLOCKS = 64
LAYOUT = kv_layout_from_tensors([torch.zeros(2, NUM_BLOCKS, 1, B, 4)] * LAYERS, NUM_BLOCKS, B)
PEER = PeerRef(inbound=b"ss:D")  # D, as P's bound socket sees it
P_ADDR = PeerRef(host="127.0.0.1", port=1)  # P, as D's connecting socket sees it


def make_sender(lease_s=10.0, direction=Direction.PUSH):
    clock = itertools.count().__next__  # every call is one second later
    agent, channel = FakeAgent(LAYOUT), FakeChannel()
    sender = KVSender(
        agent, channel, lease_s=lease_s, direction=direction, clock=lambda: float(clock())
    )
    channel.inbox.append(
        Inbound(PEER, messages.Hello(agent_name="D", agent_metadata=b"m", layout={}))
    )
    sender.peers.on_hello = lambda peer, hello: sender.peers.admit(peer, "D")
    return sender, agent, channel


def register(channel, transfer_id, dst, offset=0):
    reg = messages.Register(
        transfer_id=transfer_id, agent_name="D", block_ids=[dst], token_offset=offset
    )
    channel.inbox.append(Inbound(PEER, reg))


def complete_all(agent):
    for handle in agent.posted:
        handle.state = "DONE"


def run_prefill(sender, transfer_id, p_blocks, chunks, skip_layers=(), before_layer=None):
    """Steps computing up to each of ``chunks``; ``before_layer(step, layer)`` runs before a
    layer is reported (e.g. a registration arriving mid-forward)."""
    for step, computed in enumerate(chunks):
        sender.begin_step([StepUpdate(transfer_id, p_blocks, computed)])
        for layer in range(LAYERS):
            if before_layer is not None:
                before_layer(step, layer)
            if layer not in skip_layers:
                sender.layer_done(layer)
        sender.end_step()
        sender.poll()


def copies(agent, with_carrier=False):
    out = []
    for handle in agent.posted:
        if handle.notif and not with_carrier:
            continue
        out.extend(handle.copies)
    return out


def announced(channel):
    """Pull: the (layer, P block, D block) copies P announced, in order."""
    out = []
    for _, message in channel.sent:
        if isinstance(message, messages.Announce):
            for layer in message.layers:
                out.extend(
                    (layer, s, d)
                    for s, d in zip(message.src_block_ids, message.dst_block_ids, strict=True)
                )
    return out


def sent_of(channel, kind):
    return [m for _, m in channel.sent if isinstance(m, kind)]


def make_receiver(done_timeout_s=100.0):
    clock = itertools.count().__next__
    agent, channel = FakeAgent(LAYOUT), FakeChannel()
    receiver = KVReceiver(
        agent,
        channel,
        done_timeout_s=done_timeout_s,
        abort_ack_timeout_s=3,
        clock=lambda: float(clock()),
    )
    return receiver, agent, channel


def register_for_first_token(channel, transfer_id, dst):
    reg = messages.Register(
        transfer_id=transfer_id, agent_name="D", block_ids=[dst], token_offset=0, first_token=True
    )
    channel.inbox.append(Inbound(PEER, reg))


def pull_sender(lease_s=10.0):
    return make_sender(lease_s, direction=Direction.PULL)


def pull_receiver(**kw):
    receiver, agent, channel = make_receiver(**kw)
    agent.peer_name = "P"
    ack = messages.HelloAck(
        agent_name="P", direction="pull", agent_metadata=b"p-meta", layout=LAYOUT.model_dump()
    )
    return receiver, agent, channel, ack


def announce(channel, transfer_id, layers, src, dst, peer=P_ADDR):
    message = messages.Announce(
        transfer_id=transfer_id, layers=layers, src_block_ids=src, dst_block_ids=dst
    )
    channel.inbox.append(Inbound(peer, message))


def pull_done(channel, transfer_id, num_blocks, first_token=None, peer=P_ADDR):
    done = messages.Done(
        transfer_id=transfer_id,
        num_blocks=num_blocks,
        prefill_end_wall=0.0,
        first_token=first_token,
    )
    channel.inbox.append(Inbound(peer, done))


def first_token(channel, transfer_id, token, peer=P_ADDR):
    message = messages.FirstToken(transfer_id=transfer_id, token=token, sampled_wall=0.0)
    channel.inbox.append(Inbound(peer, message))


def pull_receiver_for_first_token(blocks=(4, 5)):
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, list(blocks), 0, first_token=True)
    channel.inbox.append(Inbound(P_ADDR, ack))
    return receiver, agent, channel
