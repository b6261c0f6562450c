"""A prefill worker whose engine went idle still answers D (issue #17's P TP 2 -> D TP 1 hang).

The stuck state, from the one real run: P TP 2 finished a first-token request, D's REGISTERs
(one share per P rank) came later than P's lease, P expired both shares, freed the blocks and
its engine went idle. An idle vLLM engine steps no more, so nothing polled the sender: D's late
REGISTERs sat in P's side channel unanswered, and D's load waited its whole ``done_timeout_s``
(the test's 300 s, as long as its client's timeout). Here with the real ``KVSender`` over the
fakes of the agent and channel (``tests/unit/fakes.py``) inside the real worker half: the
worker's idle drive polls the sender once the engine stopped stepping, and the sender refuses a
registration for an id whose lease expired at once, naming the lease.
"""

from __future__ import annotations

from types import SimpleNamespace

from fakes import FakeAgent, FakeChannel
from transfer_steps import LAYOUT, PEER

from splitserve.connectors.vllm.config import parse_connector_config
from splitserve.connectors.vllm.metadata import (
    ProduceEnd,
    ProduceStart,
    ProduceStep,
    SplitserveConnectorMetadata,
)
from splitserve.connectors.vllm.ranks import Ranks
from splitserve.connectors.vllm.worker import SplitserveWorker
from splitserve.transfer import messages
from splitserve.transfer.sender import KVSender
from splitserve.transfer.side_channel import Inbound

LEASE_S = 20.0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sender(clock: _Clock) -> tuple[KVSender, FakeChannel]:
    channel = FakeChannel()
    channel.check = lambda: None  # the worker checks its channel every step
    sender = KVSender(FakeAgent(LAYOUT), channel, lease_s=LEASE_S, clock=clock)
    channel.inbox.append(
        Inbound(PEER, messages.Hello(agent_name="D", agent_metadata=b"m", layout={}))
    )
    sender.peers.on_hello = lambda peer, hello: sender.peers.admit(peer, "D")
    return sender, channel


def _prefill_rank_of_a_wider_p(clock: _Clock) -> tuple[SplitserveWorker, FakeChannel]:
    """P rank 1 of TP 2 feeding a D of TP 1 (4 KV heads): its share is ``t@p1``."""
    config = parse_connector_config({"side_channel_port": 5701, "lease_s": LEASE_S})
    worker = SplitserveWorker(config, "p", 8, 16, Ranks(2, 1, total_kv_heads=4))
    worker.sender, channel = _sender(clock)
    worker.channel = channel
    worker.receiver = SimpleNamespace(poll=dict)  # nothing loads on this server
    worker._clock = clock
    return worker, channel


def _step(worker: SplitserveWorker, meta: SplitserveConnectorMetadata) -> set[str]:
    """One engine step as vLLM drives the worker half; its finished_sending."""
    worker.bind(meta)
    worker.wait_for_save()
    return worker.get_transfer_results()[0]


def _late_register(channel: FakeChannel, share: str) -> None:
    reg = messages.Register(
        transfer_id=share, agent_name="D", block_ids=[[3]], token_offset=0, first_token=True
    )
    channel.inbox.append(Inbound(PEER, reg))


def _refusals(channel: FakeChannel, share: str) -> list[str]:
    return [
        m.reason
        for _, m in channel.sent
        if isinstance(m, messages.Abort) and m.transfer_id == share
    ]


def test_an_idle_prefill_worker_refuses_a_registration_that_came_after_the_lease():
    clock = _Clock()
    worker, channel = _prefill_rank_of_a_wider_p(clock)
    start = ProduceStart("r", "t", 16, decode_tp_size=1)
    assert _step(worker, SplitserveConnectorMetadata(produce_start=[start])) == set()
    assert (
        _step(worker, SplitserveConnectorMetadata(produce_steps=[ProduceStep("r", "t", [1], 16)]))
        == set()
    )
    end = ProduceEnd("r", "t", True, first_token=7)  # P sampled its token: the lease starts
    assert _step(worker, SplitserveConnectorMetadata(produce_end=[end])) == set()
    clock.now += LEASE_S + 1  # D did not register within the lease (P held its blocks)
    assert _step(worker, SplitserveConnectorMetadata()) == {"r"}, "expired: P frees"
    assert worker.sender.stats.lease_expiries == 1
    # Nothing held, nothing running: vLLM's engine stops stepping. D's REGISTER comes now.
    _late_register(channel, "t@p1")
    assert not worker._drive_idle(), "the engine stepped just now: not idle yet"
    assert _refusals(channel, "t@p1") == [] and channel.inbox, "unanswered: the stuck state"
    clock.now += worker.idle_drive_s
    assert worker._drive_idle(), "idle past idle_drive_s: the idle drive polls the sender"
    (reason,) = _refusals(channel, "t@p1")
    assert "lease expired" in reason and f"{LEASE_S:g}s" in reason
    assert not channel.inbox


def test_the_idle_drive_never_polls_inside_a_step_and_reports_what_it_released():
    clock = _Clock()
    worker, channel = _prefill_rank_of_a_wider_p(clock)
    start = ProduceStart("r", "t", 16, decode_tp_size=1)
    _step(worker, SplitserveConnectorMetadata(produce_start=[start]))
    _step(worker, SplitserveConnectorMetadata(produce_steps=[ProduceStep("r", "t", [1], 16)]))
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r", "t", True)]))
    clock.now += 2 * worker.idle_drive_s  # a step under way (vLLM between bind and results)
    assert not worker._drive_idle(), "the engine's thread owns the sender during a step"
    worker.wait_for_save()
    assert worker.get_transfer_results()[0] == set()
    clock.now += LEASE_S + 1  # a long gap before the next step: the idle drive expires it
    assert worker._drive_idle()
    assert worker.sender.stats.lease_expiries == 1
    assert _step(worker, SplitserveConnectorMetadata()) == {"r"}, "reported by the next step"
    assert _step(worker, SplitserveConnectorMetadata()) == set(), "and only once"


def test_a_late_registration_is_refused_at_once_only_within_a_lease_of_the_expiry():
    clock = _Clock()
    sender, channel = _sender(clock)
    sender.add_request("t", 16)
    sender.finish_request("t", 7)
    clock.now += LEASE_S + 1
    assert sender.poll() == {"t"}
    _late_register(channel, "t")
    sender.poll()
    assert len(_refusals(channel, "t")) == 1, "refused at once"
    clock.now += LEASE_S + 1
    sender.poll()
    _late_register(channel, "t")
    sender.poll()
    assert len(_refusals(channel, "t")) == 1, "a lease later the id is unknown: held"
