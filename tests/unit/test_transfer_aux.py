"""Aux rows (per-request engine metadata, e.g. SGLang's first output token) in the transfer core:
layouts whose layers hold different numbers of blocks, the final WRITE that carries the aux rows
and DONE, and registrations that name (or fail to name) an aux row.

``FakeAgent`` / ``FakeChannel`` (``tests/unit/fakes.py``) record what our logic asks of them (no
NIXL, no sockets).
"""

from __future__ import annotations

import itertools

import pytest
from fakes import FakeAgent, FakeChannel

from splitserve.transfer import messages
from splitserve.transfer.layout import KVLayout, LayerLayout
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import Inbound, PeerRef
from splitserve.transfer.state import TransferState

B = 4
KV_LAYERS = 2
KV_BLOCKS = 32
AUX_ROWS = 8


def layer(base: int, item: int, n: int) -> LayerLayout:
    return LayerLayout(base_addr=base, block_stride=item, num_blocks=n, runs=((0, item),))


LAYOUT = KVLayout(
    block_size=B,
    layers=(
        layer(0x10000, 64, KV_BLOCKS),
        layer(0x20000, 64, KV_BLOCKS),
        layer(0x30000, 16, AUX_ROWS),
        layer(0x40000, 8, AUX_ROWS),
    ),
    aux_layers=2,
)
PEER = PeerRef(inbound=b"ss:D")


def make_sender():
    clock = itertools.count().__next__
    agent, channel = FakeAgent(LAYOUT), FakeChannel()
    sender = KVSender(agent, channel, lease_s=10.0, clock=lambda: float(clock()))
    sender.peers.admit(PEER, "D")
    return sender, agent, channel


def register(channel, transfer_id, dst, aux_row, offset=0):
    reg = messages.Register(
        transfer_id=transfer_id,
        agent_name="D",
        block_ids=[dst],
        token_offset=offset,
        aux_row=aux_row,
    )
    channel.inbox.append(Inbound(PEER, reg))


def settle(sender, agent, rounds=3):
    released = {}
    for _ in range(rounds):
        released.update(sender.poll_settled())
        for handle in agent.posted:
            handle.state = "DONE"
    return released


def test_layout_counts_and_validates_per_layer():
    assert LAYOUT.num_kv_layers == KV_LAYERS and LAYOUT.num_blocks == KV_BLOCKS
    LAYOUT.validate_block_ids([KV_BLOCKS - 1], "kv")
    LAYOUT.validate_block_ids([AUX_ROWS - 1], "aux", 2)
    with pytest.raises(ValueError, match="outside"):
        LAYOUT.validate_block_ids([AUX_ROWS], "aux", 2)
    other = LAYOUT.model_copy(update={"aux_layers": 1})
    assert "aux layers" in LAYOUT.incompatibility(other)
    with pytest.raises(ValueError):
        KVLayout(block_size=B, layers=LAYOUT.layers[:1], aux_layers=1)


def test_aux_rows_ride_on_the_final_write_after_the_kv_and_after_finish():
    sender, agent, channel = make_sender()
    sender.add_request("r", 2 * B, aux_row=3)
    register(channel, "r", [10, 11], aux_row=5)
    sender.begin_step([StepUpdate("r", [1, 2], 2 * B)])
    sender.end_step()
    kv = sorted(c for h in agent.posted for c in h.copies)
    assert kv == [(0, 1, 10), (0, 2, 11), (1, 1, 10), (1, 2, 11)]
    assert not settle(sender, agent)  # the engine has not filled the aux row yet
    assert not any(h.notif for h in agent.posted)
    sender.finish_request("r")
    released = settle(sender, agent)
    assert released["r"].state is TransferState.COMPLETED
    final = agent.posted[-1]
    assert final.copies == [(2, 3, 5), (3, 3, 5)]
    done = messages.decode(final.notif)
    assert isinstance(done, messages.Done) and done.num_blocks == 2


def test_receiver_needing_only_the_aux_rows_still_gets_them():
    sender, agent, channel = make_sender()
    sender.add_request("r", B, aux_row=0)
    register(channel, "r", [], aux_row=7, offset=B)
    sender.begin_step([StepUpdate("r", [4], B)])
    sender.end_step()
    sender.finish_request("r")
    released = settle(sender, agent)
    assert released["r"].state is TransferState.COMPLETED
    assert [h.copies for h in agent.posted] == [[(2, 0, 7), (3, 0, 7)]]


@pytest.mark.parametrize("aux_row", [None, AUX_ROWS])
def test_registration_with_a_missing_or_bad_aux_row_fails(aux_row):
    sender, agent, channel = make_sender()
    sender.add_request("r", B, aux_row=1)
    register(channel, "r", [3], aux_row=aux_row)
    sender.finish_request("r")
    released = settle(sender, agent)
    assert released["r"].state is TransferState.FAILED
    assert not agent.posted
    assert isinstance(channel.sent[-1][1], messages.Abort)


def test_registration_is_visible_before_the_request_is_added():
    sender, agent, channel = make_sender()
    register(channel, "r", [3, 4], aux_row=2, offset=B)
    reg = sender.registration_of("r")
    assert reg is not None and reg.token_offset == B and reg.aux_row == 2
    sender.add_request("r", 3 * B, aux_row=0)
    assert sender.state_of("r") is TransferState.STREAMING


def test_cancel_refuses_a_registration_already_held():
    sender, agent, channel = make_sender()
    register(channel, "r", [3], aux_row=2)
    assert sender.registration_of("r") is not None
    sender.cancel("r", "aborted")
    assert isinstance(channel.sent[-1][1], messages.Abort)


def test_aux_row_required_exactly_when_the_layout_has_aux_layers():
    sender, _, _ = make_sender()
    with pytest.raises(ValueError):
        sender.add_request("r", B)
    receiver = KVReceiver(FakeAgent(LAYOUT), FakeChannel(), done_timeout_s=5)
    with pytest.raises(ValueError):
        receiver.expect("r", "h", 1, [1], 0)
    with pytest.raises(ValueError):
        receiver.expect("r", "h", 1, [1], 0, aux_row=AUX_ROWS)
    receiver.expect("r", "h", 1, [1], 0, aux_row=AUX_ROWS - 1)


def test_abort_before_registering_reaches_the_sender_which_drops_the_id():
    channel = FakeChannel()
    receiver = KVReceiver(FakeAgent(LAYOUT), channel, done_timeout_s=5)
    receiver.abort("r", "client gone", "127.0.0.1", 5)
    abort = channel.sent[-1][1]
    assert isinstance(abort, messages.Abort) and abort.transfer_id == "r"
    sender, agent, p_channel = make_sender()
    p_channel.inbox.append(Inbound(PEER, abort))
    assert sender.registration_of("r") is None
    assert sender.cancelled("r")
    assert isinstance(p_channel.sent[-1][1], messages.AbortAck)
