"""SplitserveConnector's per-request records: every path a request takes through either half ends
with its one record deleted (no leak), and ``has_pending_push_work`` is true exactly while vLLM
holds blocks for us.

The scheduler half runs against the fakes of vLLM's ``Request`` / ``KVCacheBlocks`` /
``KVConnectorOutput`` in ``test_connector_first_token``; the worker half against a recording
sender and receiver (no NIXL, no sockets). The real engine paths run between two real servers in
tests/integration/test_connector_vllm.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.request")

from test_connector_first_token import (  # noqa: E402
    FakeBlocks,
    FakeOutput,
    FakeRequest,
    RequestStatus,
    admit,
    d_request,
    make_scheduler,
)

from splitserve.connectors.vllm.metadata import (  # noqa: E402
    ProduceEnd,
    ProduceStart,
    ProduceStep,
    ReceiveAbort,
    ReceiveStart,
    SplitserveConnectorMetadata,
)

P_PARAMS = {"do_remote_decode": True, "transfer_id": "t"}


def no_step(**changes):
    return SimpleNamespace(**{"preempted_req_ids": set(), "num_scheduled_tokens": {}, **changes})


def sent(*req_ids):
    out = FakeOutput()
    out.finished_sending = set(req_ids)
    return out


# -- scheduler half -----------------------------------------------------------------------------


def test_prefill_request_is_held_until_the_worker_reports_it_sent():
    sched = make_scheduler()
    request = FakeRequest("p", [1, 2, 3], 1, P_PARAMS)
    sched.update_state_after_alloc(request, FakeBlocks([0]), 0)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.request_finished(request)[0] is True
    assert sched.has_pending_push_work()
    sched.update_connector_output(sent("p"))
    assert not sched.has_pending_push_work() and sched._requests == {}


def test_preempted_prefill_request_drops_its_transfer_once():
    sched = make_scheduler()
    request = FakeRequest("p", [1, 2, 3], 1, P_PARAMS)
    sched.update_state_after_alloc(request, FakeBlocks([0]), 0)
    meta = sched.build_connector_meta(no_step(preempted_req_ids={"p"}))
    (end,) = meta.produce_end
    assert end.cancel_reason == "preempted on prefill" and end.holds_blocks is False
    sched.update_state_after_alloc(request, FakeBlocks([1]), 0)  # rescheduled: no new transfer
    meta = sched.build_connector_meta(no_step(num_scheduled_tokens={"p": 3}))
    assert meta.produce_start == [] and meta.produce_steps == []
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.request_finished(request) == (False, None)
    assert not sched.has_pending_push_work() and sched._requests == {}


def test_decode_request_aborted_while_loading_waits_for_the_worker():
    sched = make_scheduler()
    request = d_request(first=False)
    admit(sched, request)
    request.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request) == (False, None)
    meta = sched.build_connector_meta(no_step())
    assert [a.transfer_id for a in meta.receive_abort] == ["t"]
    assert sched.has_pending_push_work()
    sched.update_connector_output(FakeOutput(recving={"r"}, failed={"r"}))
    assert not sched.has_pending_push_work() and sched._requests == {}


def test_decode_request_loaded_then_finished_leaves_nothing():
    sched = make_scheduler()
    request = d_request(first=True)
    admit(sched, request)
    assert sched.get_num_new_matched_tokens(request, 6) == (0, False), "no second load"
    sched.update_connector_output(FakeOutput(recving={"r"}, tokens={"r": 99}))
    assert request.prompt_token_ids[-1] == 99
    request.status = RequestStatus.FINISHED_STOPPED
    assert sched.request_finished(request) == (False, None)
    assert sched.build_connector_meta(no_step()).receive_abort == []
    assert sched._requests == {}


def test_malformed_params_are_logged_once_and_forgotten(caplog):
    sched = make_scheduler()
    request = FakeRequest("m", [1, 2], 4, {"do_remote_prefill": True, "remote_port": 0})
    for _ in range(3):
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert caplog.text.count("malformed kv_transfer_params") == 1
    sched.update_state_after_alloc(request, FakeBlocks([0]), 0)
    request.status = RequestStatus.FINISHED_STOPPED
    assert sched.request_finished(request) == (False, None)
    assert sched._requests == {}


# -- worker half --------------------------------------------------------------------------------


class RecordingSender:
    def __init__(self):
        self.calls: list[tuple] = []
        self.released: set[str] = set()

    def add_request(self, transfer_id, num_tokens):
        self.calls.append(("add", transfer_id))

    def finish_request(self, transfer_id, first_token=None):
        self.calls.append(("finish", transfer_id))

    def cancel(self, transfer_id, reason):
        self.calls.append(("cancel", transfer_id))

    def begin_step(self, updates):
        self.calls.append(("step", [u.transfer_id for u in updates]))

    def end_step(self):
        pass

    def poll(self):
        released, self.released = self.released, set()
        return released


class RecordingReceiver:
    def __init__(self):
        self.calls: list[tuple] = []
        self.outcomes: dict = {}

    def expect(self, transfer_id, *args):
        self.calls.append(("expect", transfer_id))

    def abort(self, transfer_id, reason):
        self.calls.append(("abort", transfer_id))

    def release_remote(self, transfer_id, host, port):
        self.calls.append(("release", transfer_id))

    def poll(self):
        outcomes, self.outcomes = self.outcomes, {}
        return outcomes


def make_worker():
    from splitserve.connectors.vllm.config import parse_connector_config
    from splitserve.connectors.vllm.worker import SplitserveWorker

    worker = SplitserveWorker(parse_connector_config({"side_channel_port": 5701}), "e", 8, 4)
    worker.sender, worker.receiver = RecordingSender(), RecordingReceiver()
    worker.channel = SimpleNamespace(check=lambda: None)
    return worker


def bind(worker, **lists):
    worker.bind(SplitserveConnectorMetadata(**lists))
    worker.wait_for_save()


def receive_start(req_id, transfer_id):
    return ReceiveStart(req_id, transfer_id, "127.0.0.1", 5701, [1], 0, True)


def test_worker_reports_a_produced_request_once_its_transfer_settled():
    worker = make_worker()
    bind(worker, produce_start=[ProduceStart("p", "t", 8)])
    bind(worker, produce_steps=[ProduceStep("p", "t", [1, 2], 8), ProduceStep("x", "t", [3], 8)])
    assert ("step", ["t"]) in worker.sender.calls, "a step of another request is not applied"
    bind(worker, produce_end=[ProduceEnd("p", "t", True)])
    assert worker.get_transfer_results() == (set(), set(), set()), "not settled yet"
    worker.sender.released = {"t"}
    assert worker.get_transfer_results() == ({"p"}, set(), set())
    assert worker._transfers == {}


def test_worker_serves_a_reused_transfer_id_without_a_transfer():
    worker = make_worker()
    bind(worker, produce_start=[ProduceStart("p1", "t", 8)])
    bind(worker, produce_start=[ProduceStart("p2", "t", 8)])
    assert worker.sender.calls.count(("add", "t")) == 1
    bind(worker, produce_end=[ProduceEnd("p2", "t", True)])
    assert worker.get_transfer_results() == ({"p2"}, set(), set())
    bind(worker, receive_start=[receive_start("d1", "u"), receive_start("d2", "u")])
    assert worker.get_transfer_results() == (set(), {"d2"}, {"d2"})


def test_worker_loads_report_the_first_token_and_failures():
    worker = make_worker()
    bind(worker, receive_start=[receive_start("d1", "u1"), receive_start("d2", "u2")])
    bind(worker, receive_abort=[ReceiveAbort("d2", "u2"), ReceiveAbort("other", "u1")])
    assert worker.receiver.calls.count(("abort", "u2")) == 1
    assert ("abort", "u1") not in worker.receiver.calls
    worker.receiver.outcomes = {
        "u1": SimpleNamespace(ok=True, first_token=7, reason=None),
        "u2": SimpleNamespace(ok=False, first_token=None, reason="aborted"),
    }
    assert worker.get_transfer_results() == (set(), {"d1", "d2"}, {"d2"})
    assert worker.take_worker_meta().first_tokens == {"d1": 7}
    assert worker.take_worker_meta() is None
    assert worker._transfers == {}


def test_worker_tracks_both_sides_of_one_transfer_id():
    """A ``kv_both`` server may be P and D of the same transfer: two records, no collision."""
    worker = make_worker()
    bind(worker, produce_start=[ProduceStart("p", "t", 8)], receive_start=[receive_start("d", "t")])
    assert ("add", "t") in worker.sender.calls and ("expect", "t") in worker.receiver.calls
    bind(worker, produce_end=[ProduceEnd("p", "t", True)])
    worker.sender.released = {"t"}
    worker.receiver.outcomes = {"t": SimpleNamespace(ok=True, first_token=None, reason=None)}
    assert worker.get_transfer_results() == ({"p"}, {"d"}, set())
    assert worker._transfers == {}


def test_worker_stats_export_the_overlap_counters_as_deltas():
    """The overlap proof reaches vLLM's metrics: ``layers_posted_in_forward`` and
    ``layers_posted_at_step_end`` travel as deltas like every other counter."""
    from splitserve.connectors.vllm.stats import COUNTERS
    from splitserve.transfer.incoming import ReceiverStats
    from splitserve.transfer.outgoing import SenderStats
    from splitserve.transfer.side_channel import ChannelStats

    worker = make_worker()
    worker.sender.stats = SenderStats()
    worker.receiver.stats = ReceiverStats()
    worker.channel = SimpleNamespace(rejected=0, relayed=0, stats=ChannelStats())
    assert {"layers_posted_in_forward", "layers_posted_at_step_end"} <= set(COUNTERS)
    assert worker.stats() is None
    worker.sender.stats.layers_posted_in_forward = 6
    worker.sender.stats.layers_posted_at_step_end = 2
    data = worker.stats().data
    assert (data["layers_posted_in_forward"], data["layers_posted_at_step_end"]) == (6, 2)
    worker.sender.stats.layers_posted_in_forward = 10
    data = worker.stats().data
    assert (data["layers_posted_in_forward"], data["layers_posted_at_step_end"]) == (4, 0)


def test_worker_stats_export_each_forward_tail_once():
    """P's forward tails (last layer hook -> forward's end) travel as samples: each one in
    exactly one step's stats, aggregated by concatenation, summarized in ``reduce``."""
    from splitserve.connectors.vllm.stats import TAIL
    from splitserve.transfer.incoming import ReceiverStats
    from splitserve.transfer.outgoing import SenderStats
    from splitserve.transfer.side_channel import ChannelStats

    worker = make_worker()
    worker.sender.stats = SenderStats()
    worker.receiver.stats = ReceiverStats()
    worker.channel = SimpleNamespace(rejected=0, relayed=0, stats=ChannelStats())
    worker.sender.stats.forward_tails_s.extend([0.02, 0.03])
    first = worker.stats()
    assert first.data[TAIL] == [0.02, 0.03]
    assert worker.stats() is None  # drained: nothing new
    worker.sender.stats.forward_tails_s.append(0.04)
    merged = first.aggregate(worker.stats())
    assert merged.data[TAIL] == [0.02, 0.03, 0.04]
    assert merged.reduce()["avg forward tail (ms)"] == 30.0
