"""SplitserveConnector under tensor parallelism: the port of each rank, what is refused (with
both sizes named), the layouts' shard check at HELLO, and both halves' per-rank behaviour,
against fakes. Real servers (P TP 2 -> D TP 2): tests/integration/test_tensor_parallel.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitserve.connectors.vllm.config import ConnectorConfigError, parse_connector_config
from splitserve.connectors.vllm.params import KVParamsError, receive_params
from splitserve.connectors.vllm.ranks import Ranks, check_parallel
from splitserve.transfer.layout import KVLayout, LayerLayout, tp_mismatch


def test_each_rank_has_its_own_port_from_the_base():
    ranks = check_parallel(tensor_parallel=4, side_channel_port=5700)
    assert ranks == Ranks(4, 0)
    assert ranks.all_ports(5700) == [5700, 5701, 5702, 5703]
    assert Ranks(4, 3).port(5700) == 5703 and Ranks(4, 3).port(5700, rank=1) == 5701


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"pipeline_parallel": 2}, "pipeline parallel size 2"),
        ({"data_parallel": 2}, "data parallel size 2"),
        ({"decode_context_parallel": 2}, "decode context parallel size 2"),
    ],
)
def test_other_parallelism_is_refused_at_start_up(kwargs, named):
    with pytest.raises(ConnectorConfigError, match=named):
        check_parallel(tensor_parallel=2, side_channel_port=5700, **kwargs)


def test_a_rank_port_past_the_range_is_refused():
    with pytest.raises(ConnectorConfigError, match="65536"):
        check_parallel(tensor_parallel=2, side_channel_port=65535)


def test_tp_mismatch_names_both_sizes():
    assert tp_mismatch(2, 2) is None and tp_mismatch(1, 2) is None and tp_mismatch(2, 1) is None
    message = tp_mismatch(2, 3)
    assert "prefill tensor parallel size 2" in message
    assert "decode tensor parallel size 3" in message


def _layout(tp_size=1, tp_rank=0, run=1024):
    layer = LayerLayout(base_addr=4096, block_stride=run, num_blocks=8, runs=((0, run),))
    return KVLayout(block_size=16, layers=(layer, layer), tp_size=tp_size, tp_rank=tp_rank)


def test_layouts_of_different_shards_are_refused_at_hello_with_both_sizes():
    # Half the heads at TP 2: the run length alone would also differ; the TP check comes first.
    problem = _layout(2, 0, run=512).incompatibility(_layout(1, 0))
    assert "tensor parallel size 2 here, 1 at the peer" in problem
    problem = _layout(2, 1).incompatibility(_layout(2, 0))
    assert "rank 1 here, 0 at the peer" in problem
    assert _layout(2, 1).incompatibility(_layout(2, 1)) is None
    with pytest.raises(ValueError, match="tp_rank 2"):
        _layout(2, 2)


def test_the_wire_layout_leaves_tp_out_without_tp():
    """A peer that predates the fields (``extra="forbid"``) still accepts a TP 1 layout."""
    plain = _layout().wire()
    assert "tp_size" not in plain and "tp_rank" not in plain
    assert KVLayout.model_validate(plain) == _layout()
    sharded = _layout(2, 1).wire()
    assert sharded["tp_size"] == 2 and sharded["tp_rank"] == 1
    assert KVLayout.model_validate(sharded) == _layout(2, 1)


D_PARAMS = {"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 5}


def test_receive_params_read_the_prefill_tp_size():
    assert receive_params(D_PARAMS).remote_tp_size is None
    assert receive_params({**D_PARAMS, "remote_tp_size": 2}).remote_tp_size == 2
    for bad in (0, "2", True, 4096):
        with pytest.raises(KVParamsError, match="remote_tp_size"):
            receive_params({**D_PARAMS, "remote_tp_size": bad})


# -- scheduler half -----------------------------------------------------------------------------

vllm_request = pytest.importorskip("vllm.v1.request")
RequestStatus = vllm_request.RequestStatus


class _Request(SimpleNamespace):
    pass


class _Blocks:
    def get_block_ids(self):
        return ([30, 31],)


def _scheduler(tp):
    from splitserve.connectors.vllm.scheduler import SplitserveScheduler

    return SplitserveScheduler(parse_connector_config({"side_channel_port": 5701}), 4, Ranks(tp))


def _d_request(params):
    return _Request(
        request_id="r",
        prompt_token_ids=list(range(6)),
        num_prompt_tokens=6,
        max_tokens=5,
        kv_transfer_params=params,
        status=RequestStatus.WAITING,
        num_computed_tokens=0,
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 3), (3, 2), (4, 6)])
def test_decode_fails_a_request_from_a_prefill_of_another_size_at_once(p_tp, d_tp, caplog):
    sched = _scheduler(d_tp)
    request = _d_request({**D_PARAMS, "remote_tp_size": p_tp})
    needed, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, _Blocks(), needed)
    meta = sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
    assert meta.receive_start == [], "nothing registered with P"
    assert meta.receive_fail == ["r"], "failed as a whole, no hang, no local answer"
    assert [r.transfer_id for r in meta.receive_release] == ["t"], "P frees at once"
    assert f"prefill tensor parallel size {p_tp}" in caplog.text
    assert f"decode tensor parallel size {d_tp}" in caplog.text


def test_decode_of_the_same_size_registers():
    sched = _scheduler(2)
    request = _d_request({**D_PARAMS, "remote_tp_size": 2})
    needed, _ = sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, _Blocks(), needed)
    meta = sched.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
    assert [s.req_id for s in meta.receive_start] == ["r"] and meta.receive_fail == []


def test_prefill_answer_names_its_tp_size_and_first_token_goes_to_every_rank():
    sched = _scheduler(2)
    sent = []
    sched._relay = SimpleNamespace(  # the side channel to our own workers
        receive_connected=lambda: None, send=lambda peer, msg: sent.append((peer.port, msg))
    )
    from splitserve.transfer.side_channel import PeerRef

    sched._relay_peers = [PeerRef(host="127.0.0.1", port=p) for p in (5701, 5702)]
    request = _Request(
        request_id="p",
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"},
        num_prompt_tokens=6,
        num_computed_tokens=0,
        status=RequestStatus.WAITING,
        output_token_ids=[],
    )
    sched.update_state_after_alloc(request, _Blocks(), 0)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.output_token_ids = [42]
    delay_free, params = sched.request_finished(request)
    assert delay_free and params["remote_tp_size"] == 2 and params["remote_port"] == 5701
    assert [(port, msg.token) for port, msg in sent] == [(5701, 42), (5702, 42)]


# -- worker half --------------------------------------------------------------------------------


def test_each_worker_dials_the_same_rank_of_the_prefill_server():
    from splitserve.connectors.vllm.metadata import (
        ReceiveRelease,
        ReceiveStart,
        SplitserveConnectorMetadata,
    )
    from splitserve.connectors.vllm.worker import SplitserveWorker

    dialled = []
    for rank in (0, 1):
        config = parse_connector_config({"side_channel_port": 5701})
        worker = SplitserveWorker(config, "e", 8, 4, Ranks(2, rank))
        worker.channel = SimpleNamespace(check=lambda: None)
        worker.sender = SimpleNamespace(begin_step=lambda steps: list(steps), end_step=lambda: 0)
        worker.receiver = SimpleNamespace(
            expect=lambda tid, host, port, *rest: dialled.append(("expect", port)),
            release_remote=lambda tid, host, port: dialled.append(("release", port)),
        )
        worker.bind(
            SplitserveConnectorMetadata(
                receive_start=[ReceiveStart("d", "t", "127.0.0.1", 6000, [1], 0)],
                receive_release=[ReceiveRelease("u", "127.0.0.1", 6000)],
            )
        )
    assert dialled == [("expect", 6000), ("release", 6000), ("expect", 6001), ("release", 6001)]


# -- deployment files ---------------------------------------------------------------------------


def _deployment(prefill_tp: int, decode_tp: int) -> dict:
    return {
        "model": {"preset": "tiny", "served_name": "tiny"},
        "prefill": {
            "count": 2,
            "base_port": 9100,
            "side_channel_base_port": 9600,
            "args": ["--tensor-parallel-size", str(prefill_tp)],
        },
        "decode": {"base_port": 9200, "args": [f"--tensor-parallel-size={decode_tp}"]},
        "connector": {"name": "splitserve"},
        "proxy": {"port": 9000},
    }


def test_a_deployment_of_different_tp_sizes_is_refused_at_start_up():
    from splitserve.config import DeploymentError, parse_deployment

    with pytest.raises(DeploymentError, match="prefill tensor parallel size 2, decode tensor"):
        parse_deployment(_deployment(2, 3), "dep.yaml")
    parse_deployment(_deployment(1, 2), "dep.yaml")  # one a multiple of the other: served
    parse_deployment(_deployment(2, 1), "dep.yaml")


def test_a_deployment_spaces_side_channels_by_tp_size():
    """Rank r of prefill server i binds base + i * tp + r: two TP 2 servers use 4 ports."""
    from splitserve.config import DeploymentError, parse_deployment, placeholder_side_ports

    dep = parse_deployment(_deployment(2, 2), "dep.yaml")
    assert placeholder_side_ports(dep) == [9600, 9602]
    clash = _deployment(2, 2)
    clash["decode"]["side_channel_base_port"] = 9603
    with pytest.raises(DeploymentError, match="ports overlap: \\[9603\\]"):
        parse_deployment(clash, "dep.yaml")


# -- what we rely on: vLLM's aggregation across ranks -------------------------------------------


def test_vllm_reports_a_load_finished_when_every_rank_did_and_failed_when_any_did():
    """The connector counts no ranks: vLLM's ``KVOutputAggregator`` (the multiprocessing
    executor's) does. Checked here against the installed vLLM, not a fake."""
    from copy import deepcopy

    utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.utils")
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from splitserve.connectors.vllm.metadata import SplitserveWorkerMetadata

    aggregator = utils.KVOutputAggregator(expected_finished_count=2)

    def step(*per_rank: KVConnectorOutput) -> KVConnectorOutput:
        outputs = []
        for kv in per_rank:
            out = deepcopy(ModelRunnerOutput(req_ids=[], req_id_to_index={}))
            out.kv_connector_output = kv
            outputs.append(out)
        return aggregator.aggregate(outputs).kv_connector_output

    # rank 0 settles both loads (one of them failed), rank 1 has not yet: nothing reported
    got = step(
        KVConnectorOutput(finished_recving={"ok", "bad"}, failed_recving={"bad"}),
        KVConnectorOutput(kv_connector_worker_meta=SplitserveWorkerMetadata({"ok": 7})),
    )
    assert not got.finished_recving and not got.failed_recving
    assert got.kv_connector_worker_meta.first_tokens == {"ok": 7}
    # rank 1 settles both, successfully: "bad" still fails as a whole
    got = step(KVConnectorOutput(), KVConnectorOutput(finished_recving={"ok", "bad"}))
    assert got.finished_recving == {"ok", "bad"} and got.failed_recving == {"bad"}
    # P: blocks are freed only when both ranks' transfers settled
    assert not step(KVConnectorOutput(finished_sending={"p"}), KVConnectorOutput()).finished_sending
    got = step(KVConnectorOutput(), KVConnectorOutput(finished_sending={"p"}))
    assert got.finished_sending == {"p"}
