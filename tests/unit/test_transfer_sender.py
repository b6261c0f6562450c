"""KVSender (P's half), push and pull, against the fakes of the NIXL agent and side channel.

The fakes (``tests/unit/fakes.py``) only record what our logic asks of them; the real agent and
channel are tested between real processes in tests/integration.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from fakes import FakeAgent, FakeChannel
from transfer_steps import (
    LAYERS,
    LAYOUT,
    NUM_BLOCKS,
    PEER,
    B,
    announced,
    complete_all,
    copies,
    make_sender,
    pull_sender,
    register,
    register_for_first_token,
    run_prefill,
    sent_of,
)

from splitserve.transfer import messages
from splitserve.transfer.layout import kv_layout_from_tensors
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import Inbound, PeerRef
from splitserve.transfer.state import TransferState
from splitserve.transfer.strategy import Direction


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("registration", ["early", "late", "middle", "mid-forward"])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 33, 100])
def test_every_needed_block_written_exactly_once(registration, num_tokens, direction):
    """Any prompt length, chunking, registration time, push or pull: each (layer, block) is
    written (announced) once, then DONE; pull frees only on D's PULLED."""
    rng = random.Random(num_tokens)
    sender, agent, channel = make_sender(direction=direction)
    transfer_id = "t"
    n_blocks = math.ceil(num_tokens / B)
    p_blocks = rng.sample(range(NUM_BLOCKS), n_blocks)
    needed = math.ceil((num_tokens - 1) / B)  # what a vLLM D asks for
    dst = rng.sample(range(NUM_BLOCKS), needed)
    chunks = sorted({min(num_tokens, c) for c in (7, 20, 50, num_tokens)})
    sender.add_request(transfer_id, num_tokens)
    if registration == "early":
        register(channel, transfer_id, dst)
    if registration == "mid-forward":  # during the last step's forward, after its layer 0

        def mid_forward(step, layer):
            if step == len(chunks) - 1 and layer == 1:
                register(channel, transfer_id, dst)

        run_prefill(sender, transfer_id, p_blocks, chunks, before_layer=mid_forward)
    else:
        run_prefill(sender, transfer_id, p_blocks, chunks[:1])
        if registration == "middle":
            register(channel, transfer_id, dst)
        run_prefill(sender, transfer_id, p_blocks, chunks[1:])
    sender.finish_request(transfer_id)
    if registration == "late":
        register(channel, transfer_id, dst)
    released = sender.poll()
    complete_all(agent)
    released |= sender.poll()  # carrier posted once the data WRITEs are done
    complete_all(agent)
    released |= sender.poll()
    expected = sorted(
        (layer, p_blocks[i], dst[i]) for layer in range(LAYERS) for i in range(needed)
    )
    if direction is Direction.PULL:
        assert agent.posted == [], "a pulling P posts nothing"
        assert sorted(announced(channel)) == expected
        dones = sent_of(channel, messages.Done)
        if needed:
            assert released == set(), "held until D's READs are done"
            assert len(dones) == 1 and dones[0].num_blocks == needed
            assert isinstance(channel.sent[-1][1], messages.Done), "DONE after every ANNOUNCE"
            assert agent.holds == 1, "P keeps NIXL progressing while D reads"
            assert agent.urgent == 1, "at the fast rate once everything is announced"
            channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id=transfer_id)))
            released |= sender.poll()
        else:
            assert not dones
        assert released == {transfer_id}
        assert agent.holds == 0
        return
    assert released == {transfer_id}
    assert sorted(copies(agent)) == expected
    carriers = [h for h in agent.posted if h.notif]
    if needed:
        assert len(carriers) == 1
        done = messages.decode(carriers[0].notif)
        assert isinstance(done, messages.Done) and done.num_blocks == needed
    else:
        assert not carriers


def test_time_inside_write_posts_is_counted():
    # Over cma the copy runs inside the post: the counter is the transfer's CPU cost on P.
    sender, agent, channel = make_sender()
    post = agent.post

    def slow_post(*args, **kwargs):
        time.sleep(0.01)
        return post(*args, **kwargs)

    agent.post = slow_post
    sender.add_request("t", 2 * B)
    register(channel, "t", [5, 6])
    run_prefill(sender, "t", [1, 2], [2 * B])
    assert sender.stats.writes_posted >= LAYERS
    assert sender.stats.post_seconds >= 0.01 * sender.stats.writes_posted


def test_blocks_go_out_only_when_complete_and_per_layer():
    sender, agent, channel = make_sender()
    sender.add_request("t", 40)
    register(channel, "t", [5, 6, 7])
    sender.begin_step([StepUpdate("t", [1, 2, 3], 20)])  # block 0 complete, block 1 partial
    sender.layer_done(0)
    assert copies(agent) == [(0, 1, 5)]
    sender.layer_done(1)
    sender.layer_done(2)
    sender.end_step()
    sender.begin_step([StepUpdate("t", [1, 2, 3], 40)])  # blocks 1 and 2 (partial, last)
    sender.layer_done(0)
    assert copies(agent)[-1:] == [(0, 2, 6), (0, 3, 7)][-1:]
    assert (0, 2, 6) in copies(agent) and (0, 3, 7) in copies(agent)


def test_registration_during_the_forward_streams_the_remaining_layers():
    """P started the forward before D's REGISTER arrived (the concurrent flow's usual race):
    the layers already computed go out when it arrives, the rest as they are computed, and
    nothing waits for the step's end."""
    sender, agent, channel = make_sender()
    sender.add_request("t", 32)
    sender.begin_step([StepUpdate("t", [1, 2], 32)])
    sender.layer_done(0)
    assert copies(agent) == []
    register(channel, "t", [5, 6])
    sender.layer_done(1)
    assert sorted(copies(agent)) == [(0, 1, 5), (0, 2, 6), (1, 1, 5), (1, 2, 6)]
    sender.layer_done(2)
    assert sorted(copies(agent))[-2:] == [(2, 1, 5), (2, 2, 6)]
    posted = len(agent.posted)
    sender.end_step()
    assert len(agent.posted) == posted  # nothing left for the step's end
    complete_all(agent)
    sender.poll()
    assert [h for h in agent.posted if h.notif], "DONE posted right after the step"


def test_a_layer_the_engine_did_not_report_is_posted_at_step_end():
    sender, agent, channel = make_sender()
    sender.add_request("t", 32)
    register(channel, "t", [5, 6])
    run_prefill(sender, "t", [1, 2], [32], skip_layers=(1,))
    assert sorted(copies(agent)) == sorted(
        (layer, p, d) for layer in range(3) for p, d in [(1, 5), (2, 6)]
    )


@pytest.mark.parametrize("direction", list(Direction))
def test_layers_posted_in_the_forward_and_at_step_end_are_counted_apart(direction):
    """The overlap proof: a layer the hook reported counts as posted in the forward, one it
    never reported as caught up by ``end_step``; a hook that stops firing shows at once."""
    sender, agent, channel = make_sender(direction=direction)
    sender.add_request("t", 3 * B)
    register(channel, "t", [5, 6, 7])
    # step 1: the hook reports every layer, one of them twice (counted once)
    sender.begin_step([StepUpdate("t", [1, 2, 3], B)])
    for layer in (0, 0, 1, 2):
        sender.layer_done(layer)
    sender.end_step()
    assert sender.stats.layers_posted_in_forward == LAYERS
    assert sender.stats.layers_posted_at_step_end == 0
    # step 2: the hook misses layer 1
    sender.begin_step([StepUpdate("t", [1, 2, 3], 2 * B)])
    sender.layer_done(0)
    sender.layer_done(2)
    sender.end_step()
    assert sender.stats.layers_posted_in_forward == LAYERS + 2
    assert sender.stats.layers_posted_at_step_end == 1
    # step 3: the hook never fires, every layer goes out after the forward
    sender.begin_step([StepUpdate("t", [1, 2, 3], 3 * B)])
    sender.end_step()
    assert sender.stats.layers_posted_in_forward == LAYERS + 2
    assert sender.stats.layers_posted_at_step_end == 1 + LAYERS
    sent = copies(agent) if direction is Direction.PUSH else announced(channel)
    assert sorted(sent) == sorted(
        (layer, p, d) for layer in range(LAYERS) for p, d in [(1, 5), (2, 6), (3, 7)]
    )


class _StepClock:
    """``time.perf_counter`` for the sender: a value the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("direction", list(Direction))
def test_the_forward_tail_is_the_last_hook_to_the_end_of_the_prompts_forward(
    direction, monkeypatch
):
    """One tail per request whose prompt a step completed: from the step's last layer hook to
    ``end_step``. A step that leaves the prompt incomplete, or one whose hook never fired (the
    layers went out at the step's end), records none."""
    clock = _StepClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    sender, agent, channel = make_sender(direction=direction)
    sender.add_request("t", 2 * B)
    sender.add_request("u", B)
    register(channel, "t", [5, 6])
    register(channel, "u", [7])
    # step 1: "t" half computed, "u" complete: one tail ("u"), from layer 2's hook
    sender.begin_step([StepUpdate("t", [1, 2], B), StepUpdate("u", [3], B)])
    for layer in range(LAYERS):
        clock.now = 1.0 + layer
        sender.layer_done(layer)
    clock.now = 3.25
    sender.end_step()
    assert list(sender.stats.forward_tails_s) == [0.25]
    # step 2: completes "t", the hook fires for layers 0 and 1 only (layer 2 caught up)
    sender.begin_step([StepUpdate("t", [1, 2], 2 * B)])
    clock.now = 10.0
    sender.layer_done(0)
    clock.now = 10.5
    sender.layer_done(1)
    clock.now = 11.0
    sender.end_step()
    assert list(sender.stats.forward_tails_s) == [0.25, 0.5]
    # a prompt-completing step with no hook at all: no tail
    sender.add_request("v", B)
    register(channel, "v", [8])
    sender.begin_step([StepUpdate("v", [4], B)])
    sender.end_step()
    assert list(sender.stats.forward_tails_s) == [0.25, 0.5]


def test_a_catch_up_step_with_nothing_left_is_not_counted_at_step_end():
    """SGLang's ``send`` opens a step per chunk after a forward whose hook posted every layer:
    ``end_step`` then finds nothing to post, which is no bulk transfer."""
    sender, agent, channel = make_sender()
    sender.add_request("t", 2 * B)
    register(channel, "t", [5, 6])
    sender.begin_step([StepUpdate("t", [1, 2], B)])
    for layer in range(LAYERS):
        sender.layer_done(layer)
    sender.end_step()
    sender.begin_step([StepUpdate("t", [1, 2], B)])  # the chunk's catch-up step
    sender.end_step()
    assert sender.stats.layers_posted_in_forward == LAYERS
    assert sender.stats.layers_posted_at_step_end == 0


def test_layers_of_a_step_without_transfers_are_not_counted():
    sender, agent, channel = make_sender()
    sender.begin_step([])
    for layer in range(LAYERS):
        sender.layer_done(layer)
    sender.end_step()
    sender.layer_done(0)  # outside a step
    assert sender.stats.layers_posted_in_forward == 0
    assert sender.stats.layers_posted_at_step_end == 0


def test_prefix_hit_on_sender_goes_out_in_the_first_step():
    sender, agent, channel = make_sender()
    sender.add_request("t", 50)
    register(channel, "t", [9, 8, 7])
    # P had 32 tokens cached: the first step computes 32..50, blocks 0-1 were never computed
    run_prefill(sender, "t", [1, 2, 3, 4], [50])
    assert sorted(copies(agent)) == sorted(
        (layer, p, d) for layer in range(3) for p, d in [(1, 9), (2, 8), (3, 7)]
    )


def test_receiver_offset_skips_blocks_it_holds():
    sender, agent, channel = make_sender()
    sender.add_request("t", 64)
    register(channel, "t", [9, 8], offset=32)
    run_prefill(sender, "t", [1, 2, 3, 4], [64])
    assert sorted(copies(agent)) == sorted(
        (layer, p, d) for layer in range(3) for p, d in [(3, 9), (4, 8)]
    )


@pytest.mark.parametrize(
    ("dst", "offset", "why"),
    [
        ([1, 2, 3, 4], 0, "asks blocks"),
        ([1, NUM_BLOCKS], 0, "outside the cache"),
        ([1, 1], 0, "duplicate"),
        ([1], 5, "not a multiple"),
    ],
)
def test_invalid_registration_fails_and_aborts_without_writing(dst, offset, why):
    sender, agent, channel = make_sender()
    sender.add_request("t", 40)
    run_prefill(sender, "t", [1, 2, 3], [40])
    sender.finish_request("t")
    register(channel, "t", dst, offset)
    assert sender.poll() == {"t"}
    assert agent.posted == []
    aborts = [m for _, m in channel.sent if isinstance(m, messages.Abort)]
    assert len(aborts) == 1 and why in aborts[0].reason


def test_lease_expiry_without_registration():
    sender, agent, channel = make_sender(lease_s=5)
    sender.add_request("t", 40)
    run_prefill(sender, "t", [1, 2, 3], [40])
    sender.finish_request("t")
    released = set()
    for _ in range(10):
        released |= sender.poll()
    assert released == {"t"}
    assert sender.stats.lease_expiries == 1


def test_write_failure_fails_the_transfer_and_waits_for_in_flight_writes():
    sender, agent, channel = make_sender()
    sender.add_request("t", 40)
    register(channel, "t", [5, 6, 7])
    run_prefill(sender, "t", [1, 2, 3], [20])
    agent.posted[0].state = "ERR"
    run_prefill(sender, "t", [1, 2, 3], [40])
    sender.finish_request("t")
    assert sender.state_of("t") is TransferState.FAILED
    assert sender.poll() == set(), "a WRITE still in flight holds the blocks"
    complete_all(agent)
    assert sender.poll() == {"t"}
    assert any(isinstance(m, messages.Abort) for _, m in channel.sent)


def test_receiver_abort_is_acknowledged_after_writes_settle():
    sender, agent, channel = make_sender()
    sender.add_request("t", 40)
    register(channel, "t", [5, 6, 7])
    run_prefill(sender, "t", [1, 2, 3], [20])
    channel.inbox.append(Inbound(PEER, messages.Abort(transfer_id="t", reason="client left")))
    sender.poll()
    assert not any(isinstance(m, messages.AbortAck) for _, m in channel.sent)
    complete_all(agent)
    run_prefill(sender, "t", [1, 2, 3], [40])  # engine keeps computing: nothing more is sent
    assert len(agent.posted) == 3
    sender.finish_request("t")
    assert sender.poll() == {"t"}
    assert any(isinstance(m, messages.AbortAck) for _, m in channel.sent)


def test_registration_for_unknown_transfer_is_held_then_refused():
    sender, agent, channel = make_sender(lease_s=3)
    register(channel, "ghost", [1])
    for _ in range(6):
        sender.poll()
    aborts = [m for _, m in channel.sent if isinstance(m, messages.Abort)]
    assert [a.transfer_id for a in aborts] == ["ghost"]
    assert "unknown transfer id" in aborts[0].reason


def test_registration_that_arrives_before_the_request_is_matched():
    sender, agent, channel = make_sender()
    register(channel, "t", [5, 6, 7])
    sender.poll()
    sender.add_request("t", 40)
    run_prefill(sender, "t", [1, 2, 3], [40])
    assert len(copies(agent)) == 9


def test_done_waits_for_the_first_token_and_carries_it():
    sender, agent, channel = make_sender()
    sender.add_request("t", 20)
    register_for_first_token(channel, "t", [7, 8])  # every prompt token: two blocks
    run_prefill(sender, "t", [1, 2], [20])
    complete_all(agent)
    sender.poll()
    assert not any(h.notif for h in agent.posted), "no DONE before the engine sampled"
    sender.finish_request("t", first_token=99)
    sender.poll()
    (carrier,) = [h for h in agent.posted if h.notif]
    done = messages.decode(carrier.notif)
    assert isinstance(done, messages.Done) and done.first_token == 99 and done.num_blocks == 2
    carrier.state = "DONE"
    assert sender.poll() == {"t"}


def test_done_without_a_requested_first_token_fails_the_transfer():
    sender, agent, channel = make_sender()
    sender.add_request("t", 20)
    register_for_first_token(channel, "t", [7, 8])
    run_prefill(sender, "t", [1, 2], [20])
    complete_all(agent)
    sender.finish_request("t", first_token=None)
    assert sender.poll() == {"t"}
    assert sender.state_of("t") is None
    assert not any(h.notif for h in agent.posted)
    assert isinstance(channel.sent[-1][1], messages.Abort)


def test_plain_registration_gets_no_token_in_done():
    sender, agent, channel = make_sender()
    sender.add_request("t", 20)
    register(channel, "t", [7])
    run_prefill(sender, "t", [1, 2], [20])
    complete_all(agent)
    sender.poll()
    (carrier,) = [h for h in agent.posted if h.notif]
    assert messages.decode(carrier.notif).first_token is None


def test_pull_announces_per_layer_as_the_forward_runs():
    sender, agent, channel = pull_sender()
    sender.add_request("t", 40)
    register(channel, "t", [5, 6, 7])
    sender.begin_step([StepUpdate("t", [1, 2, 3], 20)])  # block 0 complete, block 1 partial
    sender.layer_done(0)
    assert announced(channel) == [(0, 1, 5)], "layer 0 announced before layer 1 runs"
    sender.layer_done(1)
    sender.layer_done(2)
    sender.end_step()
    assert len(sent_of(channel, messages.Announce)) == LAYERS
    assert sender.stats.announces_sent == LAYERS and sender.stats.writes_posted == 0
    assert (agent.holds, agent.urgent) == (1, 0), "slow progress rounds while P computes"
    assert sender.stats.bytes_sent == LAYERS * LAYOUT.layers[0].block_bytes
    sender.begin_step([StepUpdate("t", [1, 2, 3], 40)])
    for layer in range(LAYERS):
        sender.layer_done(layer)
    sender.end_step()
    sender.poll()
    assert (agent.holds, agent.urgent) == (1, 1), "all announced: D's last READs wait for us"
    channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id="t")))
    sender.finish_request("t")
    assert sender.poll() == {"t"} and (agent.holds, agent.urgent) == (0, 0)


def test_pull_registration_mid_forward_announces_computed_layers_in_one_message():
    sender, agent, channel = pull_sender()
    sender.add_request("t", 32)
    sender.begin_step([StepUpdate("t", [1, 2], 32)])
    sender.layer_done(0)
    sender.layer_done(1)
    register(channel, "t", [5, 6])
    sender.layer_done(2)
    first, second = sent_of(channel, messages.Announce)
    assert first.layers == [0, 1] and first.dst_block_ids == [5, 6]
    assert second.layers == [2]


def test_pull_hello_ack_carries_metadata_and_layout():
    agent, channel = FakeAgent(LAYOUT), FakeChannel()
    sender = KVSender(agent, channel, lease_s=5, direction=Direction.PULL)
    hello = messages.Hello(agent_name="D", agent_metadata=b"m", layout=LAYOUT.model_dump())
    channel.inbox.append(Inbound(PEER, hello))
    sender.poll()
    (ack,) = sent_of(channel, messages.HelloAck)
    assert ack.direction == "pull" and ack.agent_metadata == b"meta"
    assert ack.layout == LAYOUT.wire()
    push = KVSender(agent, channel, lease_s=5)
    channel.inbox.append(Inbound(PEER, hello))
    push.poll()
    assert sent_of(channel, messages.HelloAck)[-1].direction is None


def pulled_prefill(sender, channel, transfer_id="t"):
    sender.add_request(transfer_id, 32)
    register(channel, transfer_id, [5, 6])
    run_prefill(sender, transfer_id, [1, 2], [32])
    sender.finish_request(transfer_id)
    sender.poll()
    assert sent_of(channel, messages.Done)


def test_pull_without_pulled_frees_after_the_lease():
    """D died mid-pull (no PULLED ever comes): P frees a lease after DONE."""
    sender, agent, channel = pull_sender(lease_s=5)
    pulled_prefill(sender, channel)
    released = set()
    for _ in range(8):
        released |= sender.poll()
    assert released == {"t"}
    assert sender.stats.lease_expiries == 1 and agent.holds == 0
    assert isinstance(channel.sent[-1][1], messages.Abort)


def test_pull_abort_from_the_receiver_is_acknowledged_and_frees():
    sender, agent, channel = pull_sender()
    pulled_prefill(sender, channel)
    channel.inbox.append(Inbound(PEER, messages.Abort(transfer_id="t", reason="READ failed")))
    assert sender.poll() == {"t"}
    assert isinstance(channel.sent[-1][1], messages.AbortAck)
    assert agent.holds == 0
    assert agent.lingered == 10.0, "D's READs in flight still get our progress for a lease"


def test_pull_pulled_from_another_peer_or_before_done_is_ignored():
    sender, agent, channel = pull_sender()
    sender.add_request("t", 32)
    register(channel, "t", [5, 6])
    run_prefill(sender, "t", [1, 2], [16])  # half: no DONE yet
    channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id="t")))
    other = PeerRef(inbound=b"mallory")
    channel.inbox.append(Inbound(other, messages.Pulled(transfer_id="t")))
    sender.poll()
    assert sender.state_of("t") is TransferState.STREAMING


def test_pull_first_token_waits_for_the_engine():
    sender, agent, channel = pull_sender()
    sender.add_request("t", 20)
    register_for_first_token(channel, "t", [7, 8])
    run_prefill(sender, "t", [1, 2], [20])
    sender.poll()
    assert not sent_of(channel, messages.Done)
    sender.finish_request("t", first_token=42)
    sender.poll()
    (done,) = sent_of(channel, messages.Done)
    assert done.first_token == 42


def test_pull_refuses_aux_layers():
    aux = kv_layout_from_tensors([torch.zeros(2, NUM_BLOCKS, 1, B, 4)] * 2, NUM_BLOCKS, B)
    agent = FakeAgent(aux.model_copy(update={"aux_layers": 1}))
    with pytest.raises(ValueError, match="aux"):
        KVSender(agent, FakeChannel(), lease_s=1, direction=Direction.PULL)


def test_pull_relay_route_to_d_while_a_first_token_transfer_lives():
    sender, agent, channel = pull_sender()
    sender.add_request("t", 20)
    sender.add_request("plain", 20)
    register_for_first_token(channel, "t", [7, 8])
    register(channel, "plain", [9])
    sender.poll()
    assert channel.routes == {"t": PEER}, "only a D that asked for the token gets one"
    run_prefill(sender, "t", [1, 2], [20])
    channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id="t")))
    sender.finish_request("t", first_token=3)
    assert sender.poll() == {"t"}
    assert "t" not in channel.routes


def test_pull_pulled_before_done_completes_a_first_token_transfer():
    """D completed on FIRST_TOKEN: its PULLED comes before our DONE; we send no DONE and free
    once the engine finished the request too."""
    sender, agent, channel = pull_sender()
    sender.add_request("t", 20)
    register_for_first_token(channel, "t", [7, 8])
    run_prefill(sender, "t", [1, 2], [20])
    channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id="t")))
    assert sender.poll() == set(), "the engine still holds the request"
    assert sender.state_of("t") is TransferState.COMPLETED
    sender.finish_request("t", first_token=3)
    assert sender.poll() == {"t"}
    assert not sent_of(channel, messages.Done) and not sent_of(channel, messages.Abort)
    assert sender.stats.transfers_completed == 1 and agent.holds == 0


def test_pull_early_pulled_is_ignored_before_all_is_announced():
    sender, agent, channel = pull_sender()
    sender.add_request("half", 40)
    register_for_first_token(channel, "half", [9, 10, 11])
    run_prefill(sender, "half", [3, 4, 5], [20])
    channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id="half")))
    sender.poll()
    assert sender.state_of("half") is TransferState.STREAMING


def test_a_pushing_sender_ignores_pulled():
    """PULLED means something only to a pulling P: a pushing one completes on its DONE WRITE,
    never on a peer's word."""
    sender, agent, channel = make_sender()
    sender.add_request("t", 20)
    register_for_first_token(channel, "t", [7, 8])
    run_prefill(sender, "t", [1, 2], [20])
    complete_all(agent)
    channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id="t")))
    sender.poll()
    assert sender.state_of("t") is TransferState.FLUSHING
    assert sender.stats.transfers_completed == 0


def test_the_same_registration_again_is_ignored_and_another_is_refused():
    """D registers a transfer again after a HELLO refusal that may be older than the accepted
    registration: the identical REGISTER changes nothing; a different one is refused."""
    sender, agent, channel = make_sender()
    sender.add_request("t", 40)
    register(channel, "t", [4, 5])
    sender.poll()
    register(channel, "u", [6])  # an orphan (no such request yet), then the same again
    register(channel, "u", [6])
    register(channel, "t", [4, 5])
    sender.poll()
    assert sent_of(channel, messages.Abort) == []
    assert sender.registration_of("t") is not None
    register(channel, "t", [7, 8])
    register(channel, "u", [9])
    sender.poll()
    refused = {(m.transfer_id, m.reason) for m in sent_of(channel, messages.Abort)}
    assert refused == {("t", "registration in state streaming"), ("u", "duplicate registration")}
