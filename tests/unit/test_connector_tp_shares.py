"""The vLLM connector's workers with prefill and decode of different TP sizes, with fake senders
and receivers: which P ranks and ports each D rank dials and under which share ids, one share
per fed D rank on P and P's blocks reported free only once every share settled (D wider), a
D load complete only when every P rank's share arrived and failed as a whole when any failed
(P wider), and the start-up refusals of the size settings. The descriptors: test_tp_mapping.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitserve.connectors.vllm.config import ConnectorConfigError, parse_connector_config
from splitserve.connectors.vllm.metadata import (
    ProduceEnd,
    ProduceStart,
    ProduceStep,
    ReceiveAbort,
    ReceiveRelease,
    ReceiveStart,
    SplitserveConnectorMetadata,
)
from splitserve.connectors.vllm.ranks import Ranks, check_parallel
from splitserve.connectors.vllm.worker import SplitserveWorker


class _Sender:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.released: set[str] = set()

    def add_request(self, tid, n):
        self.calls.append(("add", tid, n))

    def finish_request(self, tid, token):
        self.calls.append(("finish", tid, token))

    def cancel(self, tid, reason):
        self.calls.append(("cancel", tid))

    def begin_step(self, steps):
        self.calls += [("step", s.transfer_id, s.computed_after_step) for s in steps]

    def end_step(self):
        pass

    def poll(self):
        out, self.released = self.released, set()
        return out


class _Receiver:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def expect(self, tid, host, port, *rest):
        self.calls.append(("expect", tid, port))

    def release_remote(self, tid, host, port):
        self.calls.append(("release", tid, port))

    def abort(self, tid, reason):
        self.calls.append(("abort", tid))

    def poll(self):
        out, self.settled = getattr(self, "settled", {}), {}
        return out


def _outcome(ok: bool, token: int | None = None, reason: str = ""):
    return SimpleNamespace(ok=ok, first_token=token, reason=reason)


def _worker(size: int, rank: int, heads: int = 0, **settings) -> SplitserveWorker:
    config = parse_connector_config({"side_channel_port": 5701, **settings})
    worker = SplitserveWorker(config, "e", 8, 4, Ranks(size, rank, total_kv_heads=heads))
    worker.channel = SimpleNamespace(check=lambda: None)
    worker.sender, worker.receiver = _Sender(), _Receiver()
    return worker


@pytest.mark.parametrize(
    ("p", "d", "ports"),
    [(2, 2, [6000, 6001]), (1, 2, [6000, 6000]), (2, 4, [6000, 6000, 6001, 6001])],
)
def test_each_decode_rank_dials_the_prefill_rank_holding_its_heads(p, d, ports):
    """D wider (or equal): one source per D rank."""
    seen = []
    for rank in range(d):
        worker = _worker(d, rank)
        worker.bind(
            SplitserveConnectorMetadata(
                receive_start=[ReceiveStart("r", "t", "h", 6000, [1], 0, remote_tp_size=p)],
                receive_release=[ReceiveRelease("u", "h", 6000, remote_tp_size=p)],
                receive_abort=[ReceiveAbort("r", "t")],
            )
        )
        seen.append(worker.receiver.calls)
    for rank, calls in enumerate(seen):
        share = "t" if p == d else f"t@d{rank}"
        released = "u" if p == d else f"u@d{rank}"
        assert calls == [
            ("expect", share, ports[rank]),
            ("release", released, ports[rank]),
            ("abort", share),
        ]


def test_a_prefill_rank_sends_one_share_per_fed_rank_and_frees_after_the_last():
    worker = _worker(2, 1, decode_tp_size=4)  # P rank 1 feeds D ranks 2 and 3
    sender = worker.sender
    worker.bind(
        SplitserveConnectorMetadata(
            produce_start=[ProduceStart("r", "t", 100)],
            produce_steps=[ProduceStep("r", "t", [3, 4], 64)],
        )
    )
    worker.wait_for_save()
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r", "t", True, None, 9)]))
    assert sender.calls == [
        ("add", "t@d2", 100),
        ("add", "t@d3", 100),
        ("step", "t@d2", 64),
        ("step", "t@d3", 64),
        ("finish", "t@d2", 9),
        ("finish", "t@d3", 9),
    ]
    sender.released = {"t@d3"}
    assert worker.get_transfer_results()[0] == set(), "one share still in flight: held"
    sender.released = {"t@d2"}
    assert worker.get_transfer_results()[0] == {"r"}, "the last share settled: free"


def test_equal_sizes_keep_the_plain_transfer_id():
    worker = _worker(2, 0)
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r", "t", 10)]))
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r", "t", True)]))
    assert [c[:2] for c in worker.sender.calls] == [("add", "t"), ("finish", "t")]
    worker.sender.released = {"t"}
    assert worker.get_transfer_results()[0] == {"r"}


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"tensor_parallel": 2, "decode_tp_size": 3}, "decode_tp_size"),
        ({"tensor_parallel": 3, "prefill_tp_size": 2}, "prefill_tp_size"),
        ({"tensor_parallel": 2, "decode_tp_size": 3}, "neither size"),
        ({"tensor_parallel": 1, "decode_tp_size": 4, "total_kv_heads": 6}, "6 KV heads"),
    ],
)
def test_sizes_the_settings_name_are_checked_at_start_up(kwargs, named):
    with pytest.raises(ConnectorConfigError, match=named) as caught:
        check_parallel(side_channel_port=5700, **kwargs)
    assert "prefill tensor parallel size" in str(caught.value)
    assert "decode tensor parallel size" in str(caught.value)


def test_supported_settings_pass_start_up():
    ranks = check_parallel(
        tensor_parallel=2, side_channel_port=5700, total_kv_heads=4, decode_tp_size=4
    )
    assert ranks == Ranks(2, 0, total_kv_heads=4)
    check_parallel(tensor_parallel=4, side_channel_port=5700, prefill_tp_size=2)
    check_parallel(tensor_parallel=1, side_channel_port=5700, prefill_tp_size=2)
    check_parallel(tensor_parallel=2, side_channel_port=5700, decode_tp_size=1)


# -- P wider: a D rank loads from several P ranks ------------------------------------------------


def _d_start(worker, p: int, first_token: bool = False) -> None:
    worker.bind(
        SplitserveConnectorMetadata(
            receive_start=[
                ReceiveStart("r", "t", "h", 6000, [1], 0, first_token, remote_tp_size=p)
            ],
        )
    )


def test_a_decode_rank_registers_one_share_with_each_of_its_prefill_ranks():
    worker = _worker(2, 1)  # D rank 1 of 2 from P TP 4: P ranks 2 and 3
    _d_start(worker, 4)
    worker.bind(
        SplitserveConnectorMetadata(
            receive_release=[ReceiveRelease("u", "h", 6000, remote_tp_size=4)],
            receive_abort=[ReceiveAbort("r", "t")],
        )
    )
    assert worker.receiver.calls == [
        ("expect", "t@p2", 6002),
        ("expect", "t@p3", 6003),
        ("release", "u@p2", 6002),
        ("release", "u@p3", 6003),
        ("abort", "t@p2"),
        ("abort", "t@p3"),
    ]


def test_a_load_from_several_prefill_ranks_completes_when_every_share_arrived():
    worker = _worker(1, 0)
    _d_start(worker, 2, first_token=True)
    worker.receiver.settled = {"t@p1": _outcome(True, 42)}
    assert worker.get_transfer_results()[1] == set(), "one share still loading"
    worker.receiver.settled = {"t@p0": _outcome(True, 42)}
    _, recving, failed = worker.get_transfer_results()
    assert recving == {"r"} and failed == set()
    assert worker.take_worker_meta().first_tokens == {"r": 42}


def test_one_failed_share_fails_the_load_as_a_whole_and_aborts_the_others(caplog):
    worker = _worker(1, 0)
    _d_start(worker, 4)
    worker.receiver.settled = {"t@p2": _outcome(False, reason="lost connection")}
    assert worker.get_transfer_results()[1] == set(), "the other shares settle first"
    aborted = sorted(c[1] for c in worker.receiver.calls if c[0] == "abort")
    assert aborted == ["t@p0", "t@p1", "t@p3"]
    worker.receiver.settled = {s: _outcome(False, reason="aborted") for s in aborted[:2]}
    assert worker.get_transfer_results()[1] == set()
    worker.receiver.settled = {"t@p3": _outcome(True)}
    _, recving, failed = worker.get_transfer_results()
    assert recving == {"r"} and failed == {"r"}
    assert "share t@p2: lost connection" in caplog.text


def test_a_prefill_rank_of_a_wider_prefill_sends_its_own_share():
    worker = _worker(2, 1, decode_tp_size=1)
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r", "t", 10)]))
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r", "t", True)]))
    assert [c[:2] for c in worker.sender.calls] == [("add", "t@p1"), ("finish", "t@p1")]
    worker.sender.released = {"t@p1"}
    assert worker.get_transfer_results()[0] == {"r"}


def test_a_prefill_rank_that_only_repeats_replicated_heads_frees_at_once():
    """2 KV heads on P TP 4: ranks 0/1 hold head 0, ranks 2/3 head 1; D TP 2 loads head 0
    from rank 0 and head 1 from rank 2, so ranks 1 and 3 send nothing and free at the end."""
    worker = _worker(4, 1, heads=2, decode_tp_size=2)
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r", "t", 10)]))
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r", "t", True)]))
    assert worker.sender.calls == []
    assert worker.get_transfer_results()[0] == {"r"}


def test_the_params_decode_size_beats_the_setting_and_ids_are_freed_after_the_last_share():
    """A P feeding D pools of two sizes learns each request's from its params (a proxy that
    knows the pools adds ``decode_tp_size``); its shares are fixed for the request."""
    from splitserve.connectors.vllm.params import KVParamsError, produce_params

    assert produce_params({"do_remote_decode": True, "transfer_id": "t"}).decode_tp_size is None
    params = produce_params({"do_remote_decode": True, "transfer_id": "t", "decode_tp_size": 2})
    assert params.decode_tp_size == 2
    with pytest.raises(KVParamsError, match="decode_tp_size"):
        produce_params({"do_remote_decode": True, "decode_tp_size": 0})
    worker = _worker(1, 0, decode_tp_size=1)
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r", "t", 10, 2)]))
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r", "t", True)]))
    assert [c[1] for c in worker.sender.calls] == ["t@d0", "t@d1", "t@d0", "t@d1"]
    worker.sender.released = {"t@d0", "t@d1"}
    assert worker.get_transfer_results()[0] == {"r"}
    assert worker.shares.is_idle()
    # the id is free again: a later request with it gets its own transfer
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r2", "t", 10)]))
    assert worker.sender.calls[-1] == ("add", "t", 10)


def test_a_reused_transfer_id_gets_no_second_transfer():
    worker = _worker(1, 0, decode_tp_size=2)
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r", "t", 10)]))
    worker.bind(SplitserveConnectorMetadata(produce_start=[ProduceStart("r2", "t", 10)]))
    assert [c[1] for c in worker.sender.calls] == ["t@d0", "t@d1"]
    worker.bind(SplitserveConnectorMetadata(produce_end=[ProduceEnd("r2", "t", True)]))
    assert worker.get_transfer_results()[0] == {"r2"}, "its blocks freed at once"
