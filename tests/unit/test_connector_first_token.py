"""SplitserveConnector's first-token-from-prefill decisions: params, block arithmetic and the
scheduler half's bookkeeping, against fakes.

``FakeRequest``, ``FakeBlocks`` and ``FakeOutput`` are fakes of vLLM's ``Request``,
``KVCacheBlocks`` and ``KVConnectorOutput`` holding only the fields the scheduler half reads.
The real engine path (vLLM's scheduler and model runner around it) is exercised between two
real servers in tests/integration/test_connector_vllm.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from splitserve.connectors.vllm.params import (
    KVParamsError,
    blocks_to_receive,
    receive_params,
    tokens_to_receive,
)

D_PARAMS = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 5}


def test_receive_params_first_token_flag():
    assert receive_params(D_PARAMS).first_token_from_prefill is False
    got = receive_params({**D_PARAMS, "first_token_from_prefill": True})
    assert got.first_token_from_prefill is True
    with pytest.raises(KVParamsError, match="first_token_from_prefill"):
        receive_params({**D_PARAMS, "first_token_from_prefill": "yes"})


@pytest.mark.parametrize(
    ("prompt", "first", "tokens", "blocks"),
    [
        (1, False, 0, range(0, 0)),
        (1, True, 1, range(0, 1)),  # even a one-token prompt is loaded
        (128, False, 127, range(0, 1)),
        (128, True, 128, range(0, 1)),
        (129, False, 128, range(0, 1)),
        (129, True, 129, range(0, 2)),  # the last token needs its own block
    ],
)
def test_tokens_and_blocks_with_the_first_token_from_prefill(prompt, first, tokens, blocks):
    assert tokens_to_receive(prompt, first) == tokens
    assert blocks_to_receive(prompt, 0, 128, first) == blocks


# -- scheduler half -----------------------------------------------------------------------------

vllm_request = pytest.importorskip("vllm.v1.request")
RequestStatus = vllm_request.RequestStatus


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict | None
    status: object = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    hashed: int = 0

    def __post_init__(self):
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)

    def update_block_hashes(self):
        self.hashed += 1


class FakeBlocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def FakeOutput(recving=(), failed=(), tokens=None):  # noqa: N802 - stands in for a class
    from splitserve.connectors.vllm.metadata import SplitserveWorkerMetadata

    meta = SplitserveWorkerMetadata(tokens) if tokens else None
    return SimpleNamespace(
        finished_sending=set(),
        finished_recving=set(recving),
        failed_recving=set(failed),
        kv_connector_worker_meta=meta,
    )


def make_scheduler():
    from splitserve.connectors.vllm.config import parse_connector_config
    from splitserve.connectors.vllm.scheduler import SplitserveScheduler

    return SplitserveScheduler(parse_connector_config({"side_channel_port": 5701}), 4)


def d_request(n=6, max_tokens=5, first=True, req_id="r"):
    params = {**D_PARAMS, "first_token_from_prefill": first}
    return FakeRequest(req_id, list(range(10, 10 + n)), max_tokens, params)


def admit(sched, request):
    """vLLM's order: matched tokens, allocation, connector hook, WAITING_FOR_REMOTE_KVS."""
    needed, load_async = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, FakeBlocks([30, 31]), needed)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    request.num_computed_tokens = needed
    return needed, load_async


def test_decode_side_loads_every_prompt_token_and_asks_for_the_token():
    sched = make_scheduler()
    request = d_request(n=6)
    assert admit(sched, request) == (6, True)
    (start,) = sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set())).receive_start
    assert start.first_token is True and start.block_ids == [30, 31] and start.token_offset == 0
    plain = d_request(n=6, first=False, req_id="other")
    assert sched.get_num_new_matched_tokens(plain, 0) == (5, True)


def test_decode_side_continues_from_the_token_when_the_load_completes():
    sched = make_scheduler()
    request = d_request(n=6, max_tokens=5)
    admit(sched, request)
    sched.update_connector_output(FakeOutput(tokens={"r": 99}))  # token before completion
    assert request.prompt_token_ids[-1] != 99
    sched.update_connector_output(FakeOutput(recving={"r"}))
    assert request.prompt_token_ids == [*range(10, 16), 99]
    assert request._all_token_ids[-1] == 99 and request.num_prompt_tokens == 7
    assert request.num_computed_tokens == 6, "one token left to compute: token 1's position"
    assert request.max_tokens == 4, "P's token counts against the client's limit"
    assert request.hashed == 1


def test_decode_side_does_not_continue_a_failed_or_finished_load():
    sched = make_scheduler()
    failed = d_request(n=6)
    admit(sched, failed)
    sched.update_connector_output(FakeOutput(recving={"r"}, failed={"r"}, tokens={"r": 99}))
    assert len(failed.prompt_token_ids) == 6 and failed.max_tokens == 5
    sched = make_scheduler()
    aborted = d_request(n=6)
    admit(sched, aborted)
    aborted.status = RequestStatus.FINISHED_ABORTED
    sched.update_connector_output(FakeOutput(recving={"r"}, tokens={"r": 99}))
    assert len(aborted.prompt_token_ids) == 6


def test_decode_side_fails_a_request_without_room_for_a_second_token():
    sched = make_scheduler()
    request = d_request(n=6, max_tokens=1)
    admit(sched, request)
    meta = sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
    assert meta.receive_fail == ["r"] and meta.receive_start == []
    assert [r.transfer_id for r in meta.receive_release] == ["t"], "P frees at once"


def test_prefill_side_puts_the_sampled_token_in_produce_end():
    sched = make_scheduler()
    request = FakeRequest("p", [1, 2, 3], 1, {"do_remote_decode": True, "transfer_id": "t"})
    sched.update_state_after_alloc(request, FakeBlocks([0]), 0)
    request.output_token_ids = [77]
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(request)
    assert delay is True and params["transfer_id"] == "t"
    meta = sched.build_connector_meta(
        SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={})
    )
    (end,) = meta.produce_end
    assert end.first_token == 77 and end.cancel_reason is None


def test_prefill_side_sends_the_token_to_its_own_side_channel_at_once(monkeypatch):
    """FIRST_TOKEN goes from the scheduler half to this server's side channel (a real one on
    loopback here), which relays it to the D routed for the transfer: no engine step between."""
    import time as _time

    from splitserve.connectors.vllm.config import parse_connector_config
    from splitserve.connectors.vllm.scheduler import SplitserveScheduler
    from splitserve.transfer import messages
    from splitserve.transfer.side_channel import Inbound, PeerRef, SideChannel

    key = b"k" * 16
    worker = SideChannel("127.0.0.1", 0, key, name="test-worker")
    d = SideChannel(None, None, key, name="test-d")
    monkeypatch.setenv("SPLITSERVE_AUTH_KEY", "k" * 16)
    config = {"side_channel_port": worker.bound_port}
    sched = SplitserveScheduler(parse_connector_config(config), 4)
    try:
        d.send(PeerRef(host="127.0.0.1", port=worker.bound_port), messages.Pulled(transfer_id="x"))
        end = _time.monotonic() + 10
        inbound: list = []
        while not inbound and _time.monotonic() < end:
            inbound = worker.receive_bound()
            _time.sleep(0.005)
        worker.relay_first_token("t", inbound[0].peer)
        request = FakeRequest("p", [1, 2, 3], 1, {"do_remote_decode": True, "transfer_id": "t"})
        sched.update_state_after_alloc(request, FakeBlocks([0]), 0)
        request.output_token_ids = [77]
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        sched.request_finished(request)
        got: list = []
        while not got and _time.monotonic() < end:
            got = [e for e in d.receive_connected() if isinstance(e, Inbound)]
            _time.sleep(0.005)
        assert got, "no FIRST_TOKEN relayed within 10 s"
        message = got[0].message
        assert isinstance(message, messages.FirstToken)
        assert (message.transfer_id, message.token) == ("t", 77)
    finally:
        sched.shutdown()
        worker.close()
        d.close()
