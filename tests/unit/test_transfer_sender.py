"""KVSender / KVReceiver logic, push and pull, against fakes of the NIXL agent and side channel.

The fakes (``FakeAgent``, ``FakeChannel``) only record what our logic asks of them; the real
agent and channel are tested between real processes in tests/integration.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
import torch

from splitserve.transfer import messages
from splitserve.transfer.layout import kv_layout_from_tensors
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef
from splitserve.transfer.state import TransferState
from splitserve.transfer.strategy import Direction

B = 16
LAYERS = 3
NUM_BLOCKS = 64
LAYOUT = kv_layout_from_tensors([torch.zeros(2, NUM_BLOCKS, 1, B, 4)] * LAYERS, NUM_BLOCKS, B)
PEER = PeerRef(inbound=b"d-1")


class FakeHandle:
    def __init__(self, copies, notif):
        self.copies, self.notif, self.state = copies, notif, "PROC"
        self.num_bytes = len(copies)
        self.peer = "D"


class FakeAgent:
    name = "P"
    layout = LAYOUT

    def __init__(self, peer_name="D"):
        self.posted: list[FakeHandle] = []
        self.notifs: dict[str, list[bytes]] = {}
        self.peer_name = peer_name
        self.peers_added: list[bytes] = []
        self.holds = 0  # hold_progress minus drop_progress
        self.urgent = 0  # of which urgent

    def add_peer(self, metadata, layout):
        self.peers_added.append(metadata)
        return self.peer_name

    def post(self, op, peer, layers, local, remote, notif=b""):
        LAYOUT.validate_block_ids(local, "local")
        LAYOUT.validate_block_ids(remote, "remote")
        handle = FakeHandle(list(zip(layers, local, remote, strict=True)), notif)
        handle.op = op
        self.posted.append(handle)
        return handle

    def hold_progress(self, urgent=False):
        self.holds += 1
        self.urgent += urgent

    def linger_progress(self, seconds):
        self.lingered = seconds

    def drop_progress(self, urgent=False):
        self.holds -= 1
        self.urgent -= urgent

    def check(self, handle):
        return handle.state

    def release(self, handle):
        pass

    def metadata(self):
        return b"meta"

    def notifications(self):
        out, self.notifs = self.notifs, {}
        return out

    _peers = {"D": type("P", (), {"layout": LAYOUT})}


class FakeChannel:
    auth_key = None

    def __init__(self):
        self.inbox: list = []
        self.sent: list = []
        self.routes: dict = {}  # FIRST_TOKEN relay: transfer id -> D

    def receive_bound(self):
        out = [e for e in self.inbox if isinstance(e, Inbound) and e.peer.inbound is not None]
        self.inbox = [e for e in self.inbox if e not in out]
        return out

    def receive_connected(self):
        out = [e for e in self.inbox if not (isinstance(e, Inbound) and e.peer.inbound)]
        self.inbox = [e for e in self.inbox if e not in out]
        return out

    def send(self, peer, message):
        self.sent.append((peer, message))

    def relay_first_token(self, transfer_id, peer):
        if peer is None:
            self.routes.pop(transfer_id, None)
        else:
            self.routes[transfer_id] = peer


def make_sender(lease_s=10.0, direction=Direction.PUSH):
    clock = itertools.count().__next__  # every call is one second later
    agent, channel = FakeAgent(), FakeChannel()
    sender = KVSender(
        agent, channel, lease_s=lease_s, direction=direction, clock=lambda: float(clock())
    )
    channel.inbox.append(
        Inbound(PEER, messages.Hello(agent_name="D", agent_metadata=b"m", layout={}))
    )
    sender._on_hello = lambda peer, hello: sender._peer_agents.__setitem__(peer.inbound, "D")
    return sender, agent, channel


def register(channel, tid, dst, offset=0):
    reg = messages.Register(transfer_id=tid, agent_name="D", block_ids=[dst], token_offset=offset)
    channel.inbox.append(Inbound(PEER, reg))


def complete_all(agent):
    for handle in agent.posted:
        handle.state = "DONE"


def run_prefill(sender, tid, p_blocks, chunks, skip_layers=(), before_layer=None):
    """Steps computing up to each of ``chunks``; ``before_layer(step, layer)`` runs before a
    layer is reported (e.g. a registration arriving mid-forward)."""
    for step, computed in enumerate(chunks):
        sender.begin_step([StepUpdate(tid, p_blocks, computed)])
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


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("registration", ["early", "late", "middle", "mid-forward"])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 33, 100])
def test_every_needed_block_written_exactly_once(registration, num_tokens, direction):
    """Any prompt length, chunking, registration time, push or pull: each (layer, block) is
    written (announced) once, then DONE; pull frees only on D's PULLED."""
    rng = random.Random(num_tokens)
    sender, agent, channel = make_sender(direction=direction)
    tid = "t"
    n_blocks = math.ceil(num_tokens / B)
    p_blocks = rng.sample(range(NUM_BLOCKS), n_blocks)
    needed = math.ceil((num_tokens - 1) / B)  # what a vLLM D asks for
    dst = rng.sample(range(NUM_BLOCKS), needed)
    chunks = sorted({min(num_tokens, c) for c in (7, 20, 50, num_tokens)})
    sender.add_request(tid, num_tokens)
    if registration == "early":
        register(channel, tid, dst)
    if registration == "mid-forward":  # during the last step's forward, after its layer 0

        def mid_forward(step, layer):
            if step == len(chunks) - 1 and layer == 1:
                register(channel, tid, dst)

        run_prefill(sender, tid, p_blocks, chunks, before_layer=mid_forward)
    else:
        run_prefill(sender, tid, p_blocks, chunks[:1])
        if registration == "middle":
            register(channel, tid, dst)
        run_prefill(sender, tid, p_blocks, chunks[1:])
    sender.finish_request(tid)
    if registration == "late":
        register(channel, tid, dst)
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
            channel.inbox.append(Inbound(PEER, messages.Pulled(transfer_id=tid)))
            released |= sender.poll()
        else:
            assert not dones
        assert released == {tid}
        assert agent.holds == 0
        return
    assert released == {tid}
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


# -- receiver -----------------------------------------------------------------------------------


def make_receiver(done_timeout_s=100.0):
    clock = itertools.count().__next__
    agent, channel = FakeAgent(), FakeChannel()
    receiver = KVReceiver(
        agent,
        channel,
        done_timeout_s=done_timeout_s,
        abort_ack_timeout_s=3,
        clock=lambda: float(clock()),
    )
    return receiver, agent, channel


P_ADDR = PeerRef(host="127.0.0.1", port=1)


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


# -- first token from the prefill side ----------------------------------------------------------


def register_for_first_token(channel, tid, dst):
    reg = messages.Register(
        transfer_id=tid, agent_name="D", block_ids=[dst], token_offset=0, first_token=True
    )
    channel.inbox.append(Inbound(PEER, reg))


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


# -- pull: the prefill side ---------------------------------------------------------------------


def pull_sender(lease_s=10.0):
    return make_sender(lease_s, direction=Direction.PULL)


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
    agent, channel = FakeAgent(), FakeChannel()
    sender = KVSender(agent, channel, lease_s=5, direction=Direction.PULL)
    hello = messages.Hello(agent_name="D", agent_metadata=b"m", layout=LAYOUT.model_dump())
    channel.inbox.append(Inbound(PEER, hello))
    sender.poll()
    (ack,) = sent_of(channel, messages.HelloAck)
    assert ack.direction == "pull" and ack.agent_metadata == b"meta"
    assert ack.layout == LAYOUT.model_dump(mode="json")
    push = KVSender(agent, channel, lease_s=5)
    channel.inbox.append(Inbound(PEER, hello))
    push.poll()
    assert sent_of(channel, messages.HelloAck)[-1].direction is None


def pulled_prefill(sender, channel, tid="t"):
    sender.add_request(tid, 32)
    register(channel, tid, [5, 6])
    run_prefill(sender, tid, [1, 2], [32])
    sender.finish_request(tid)
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
    agent = FakeAgent()
    agent.layout = aux.model_copy(update={"aux_layers": 1})
    with pytest.raises(ValueError, match="aux"):
        KVSender(agent, FakeChannel(), lease_s=1, direction=Direction.PULL)


# -- pull: the decode side ----------------------------------------------------------------------


def pull_receiver(**kw):
    receiver, agent, channel = make_receiver(**kw)
    agent.peer_name = "P"
    ack = messages.HelloAck(
        agent_name="P", direction="pull", agent_metadata=b"p-meta", layout=LAYOUT.model_dump()
    )
    return receiver, agent, channel, ack


def announce(channel, tid, layers, src, dst, peer=P_ADDR):
    message = messages.Announce(
        transfer_id=tid, layers=layers, src_block_ids=src, dst_block_ids=dst
    )
    channel.inbox.append(Inbound(peer, message))


def pull_done(channel, tid, num_blocks, first_token=None, peer=P_ADDR):
    done = messages.Done(
        transfer_id=tid, num_blocks=num_blocks, prefill_end_wall=0.0, first_token=first_token
    )
    channel.inbox.append(Inbound(peer, done))


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


# -- pull: the first token straight from P's engine (FIRST_TOKEN) --------------------------------


def first_token(channel, tid, token, peer=P_ADDR):
    message = messages.FirstToken(transfer_id=tid, token=token, sampled_wall=0.0)
    channel.inbox.append(Inbound(peer, message))


def pull_receiver_for_first_token(blocks=(4, 5)):
    receiver, agent, channel, ack = pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, list(blocks), 0, first_token=True)
    channel.inbox.append(Inbound(P_ADDR, ack))
    return receiver, agent, channel


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
