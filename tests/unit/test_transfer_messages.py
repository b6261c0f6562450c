"""Control messages, HMAC, the transfer state machine, KV layouts and the direction strategy."""

from __future__ import annotations

import pytest
import torch

from splitserve.transfer import messages, strategy
from splitserve.transfer.layout import kv_layout_from_tensors
from splitserve.transfer.state import IllegalTransition, Transfer, TransferState

KEY = b"k" * 16


def sample_messages():
    return [
        messages.Hello(agent_name="d", agent_metadata=b"\x00\xffmeta", layout={"a": 1}),
        messages.HelloAck(agent_name="p"),
        messages.HelloAck(
            agent_name="p", direction="pull", agent_metadata=b"\x01m", layout={"b": 2}
        ),
        messages.Register(transfer_id="t", agent_name="d", block_ids=[[1, 2, 3]], token_offset=0),
        messages.Done(transfer_id="t", num_blocks=3, prefill_end_wall=12.5),
        messages.Abort(transfer_id="t", reason="gone"),
        messages.AbortAck(transfer_id="t"),
        messages.Announce(transfer_id="t", layers=[2], src_block_ids=[1], dst_block_ids=[4]),
        messages.Pulled(transfer_id="t"),
    ]


@pytest.mark.parametrize("key", [None, KEY])
def test_every_message_round_trips(key):
    for message in sample_messages():
        assert messages.decode(messages.encode(message, key), key) == message


def test_hmac_rejects_wrong_key_missing_mac_and_tampering():
    wire = messages.encode(sample_messages()[3], KEY)
    with pytest.raises(messages.MessageAuthError):
        messages.decode(wire, b"other-key")
    with pytest.raises(messages.MessageAuthError):
        messages.decode(messages.encode(sample_messages()[3], None), KEY)
    tampered = wire[:-3] + b"9]]" if wire.endswith(b"]]") else wire[:-1] + b"X"
    with pytest.raises(messages.MessageError):
        messages.decode(tampered, KEY)


def test_malformed_and_foreign_version_messages_are_rejected():
    with pytest.raises(messages.MalformedMessageError):
        messages.decode(b"", None)
    with pytest.raises(messages.MalformedMessageError):
        messages.decode(b"\x00not json", None)
    with pytest.raises(messages.MessageVersionError):
        messages.decode(b'\x00{"v": 2, "type": "abort_ack", "transfer_id": "t"}', None)
    with pytest.raises(messages.MalformedMessageError):  # negative block id
        messages.decode(
            b'\x00{"v":1,"type":"register","transfer_id":"t","agent_name":"d",'
            b'"block_ids":[[-1]],"token_offset":0}',
            None,
        )
    with pytest.raises(messages.MalformedMessageError):  # unknown field
        messages.decode(b'\x00{"v":1,"type":"abort_ack","transfer_id":"t","x":1}', None)


def test_state_machine_allows_the_protocol_and_refuses_the_rest():
    t = Transfer("t", TransferState.AWAITING_REGISTRATION)
    t.transition(TransferState.STREAMING)
    t.transition(TransferState.FLUSHING)
    t.transition(TransferState.COMPLETED)
    assert t.state.terminal
    with pytest.raises(IllegalTransition):
        t.transition(TransferState.FAILED)
    r = Transfer("r", TransferState.REGISTERED, deadline=10.0)
    assert not r.expired(9.9) and r.expired(10.0)
    r.transition(TransferState.EXPIRED, "late")
    assert r.reason == "late"
    with pytest.raises(IllegalTransition):
        Transfer("x", TransferState.REGISTERED).transition(TransferState.STREAMING)


def test_layout_from_kv_first_tensor_and_block_validation():
    cache = [torch.zeros(2, 10, 2, 16, 8) for _ in range(2)]
    layout = kv_layout_from_tensors(cache, num_blocks=10, block_size=16)
    layer = layout.layers[0]
    run = 2 * 16 * 8 * 4
    assert layer.block_stride == run
    assert layer.runs == ((0, run), (10 * run, run))
    assert layer.base_addr == cache[0].data_ptr()
    assert layout.bytes_per_block_all_layers == 2 * 2 * run
    layout.validate_block_ids([0, 9], "ok")
    with pytest.raises(ValueError, match="outside the cache"):
        layout.validate_block_ids([10], "registered block")
    with pytest.raises(ValueError, match="outside the cache"):
        layout.validate_block_ids([-1], "registered block")


def test_layout_compatibility():
    a = kv_layout_from_tensors([torch.zeros(2, 10, 2, 16, 8)], 10, 16)
    b = kv_layout_from_tensors([torch.zeros(2, 20, 2, 16, 8)], 20, 16)  # more blocks: fine
    c = kv_layout_from_tensors([torch.zeros(2, 10, 4, 16, 8)], 10, 16)  # more heads
    assert a.incompatibility(b) is None
    assert "runs" in a.incompatibility(c)
    assert "layers" in a.incompatibility(
        kv_layout_from_tensors([torch.zeros(2, 10, 2, 16, 8)] * 2, 10, 16)
    )


def test_block_major_layout_is_one_run_per_block():
    layout = kv_layout_from_tensors([torch.zeros(10, 2, 2, 16, 8)], 10, 16)
    assert layout.layers[0].runs == ((0, 2 * 2 * 16 * 8 * 4),)


def test_strategy_by_transport():
    assert strategy.transport_of({}) == "cma"
    assert strategy.transport_of({"UCX_TLS": "tcp"}) == "tcp"
    assert strategy.transport_of({"UCX_TLS": "rc,cuda_copy"}) == "rdma"
    assert strategy.choose("cma", "DRAM") is strategy.Direction.PULL
    assert strategy.choose("tcp", "DRAM") is strategy.Direction.PUSH
    assert strategy.choose("rdma", "VRAM") is strategy.Direction.PUSH
    assert strategy.effective("cma", "DRAM") is strategy.Direction.PULL
    assert strategy.effective("tcp", "DRAM") is strategy.Direction.PUSH
    # the connector's ``direction`` key overrides the choice either way
    assert strategy.effective("cma", "DRAM", "push") is strategy.Direction.PUSH
    assert strategy.effective("tcp", "DRAM", "pull") is strategy.Direction.PULL


def test_first_token_fields_round_trip_signed_and_stay_off_the_wire_when_unset():
    reg = messages.Register(
        transfer_id="t", agent_name="d", block_ids=[[1]], token_offset=0, first_token=True
    )
    done = messages.Done(transfer_id="t", num_blocks=1, prefill_end_wall=1.0, first_token=42)
    for message in (reg, done):
        assert messages.decode(messages.encode(message, KEY), KEY) == message
    # Unset optional fields are not on the wire: a peer that predates them accepts the message.
    plain = messages.Done(transfer_id="t", num_blocks=1, prefill_end_wall=1.0)
    assert b"first_token" not in messages.encode(plain, KEY)
    assert b"first_token" not in messages.encode(sample_messages()[3], KEY)
    # The token is covered by the MAC like every other field.
    wire = messages.encode(done, KEY)
    with pytest.raises(messages.MessageAuthError):
        messages.decode(wire.replace(b'"first_token":42', b'"first_token":43'), KEY)
    with pytest.raises(messages.MalformedMessageError):
        messages.decode(messages.encode(done).replace(b":42", b":-1"))
