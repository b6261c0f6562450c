"""The SGLang backend's metrics and per-request timeline (splitserve.connectors.sglang.stats and
.timeline) and the timeline parser (benchmarks/sglang_timeline.py), without an SGLang server."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from splitserve.connectors.sglang.stats import (
    COUNTERS,
    SENDER_COUNTERS,
    BackendMetrics,
    Deltas,
    transport_totals,
)
from splitserve.connectors.sglang.timeline import EVENTS, Timeline, format_event, parse_line
from splitserve.transfer.state import TransferState

ROOT = Path(__file__).resolve().parents[2]
LABELS = {"model_name": "tiny", "engine_type": "prefill"}


def _sender_stats(**values):
    base = dict.fromkeys(SENDER_COUNTERS, 0)
    base["post_seconds"] = 0.0
    base.update(values)
    return SimpleNamespace(**base)


def _channel(rejected=0, dropped=None):
    return SimpleNamespace(
        rejected=rejected, stats=SimpleNamespace(dropped_peers=dict(dropped or {}))
    )


def test_totals_name_every_counter_and_mix_the_sides():
    sender = SimpleNamespace(stats=_sender_stats(bytes_sent=10, post_seconds=0.5))
    receiver = SimpleNamespace(
        stats=SimpleNamespace(
            transfers_completed=2,
            transfers_failed=1,
            done_timeouts=1,
            messages_rejected=3,
            post_seconds=0.25,
        )
    )
    totals = transport_totals(sender, receiver, _channel(4, {"idle": 9, "silent": 2}))
    assert set(totals) == set(COUNTERS)
    assert totals["bytes_sent"] == 10 and totals["loads_completed"] == 2
    assert totals["messages_rejected"] == 7, "the receiver's and the channel's refusals"
    assert totals["post_seconds"] == 0.75
    assert totals["peers_dropped"] == 2, "idle connections closed are not drops"
    assert transport_totals(None, None, None) == dict.fromkeys(COUNTERS, 0)


def test_deltas_count_each_increase_once():
    deltas = Deltas()
    assert deltas({"a": 3, "b": 0}) == {"a": 3}
    assert deltas({"a": 3, "b": 2}) == {"b": 2}
    assert deltas({"a": 5, "b": 2}) == {"a": 2}


def test_metrics_publish_counters_and_handoffs():
    registry = CollectorRegistry()
    metrics = BackendMetrics(LABELS, registry)
    totals = dict.fromkeys(COUNTERS, 0)
    totals.update(bytes_sent=100, layers_posted_in_forward=4, post_seconds=0.5)
    handoffs = [0.003, 0.2]
    metrics.publish(totals, handoffs)
    assert handoffs == [], "observed once"
    totals.update(bytes_sent=150, layers_posted_in_forward=8)
    metrics.publish(totals, handoffs)

    def value(name):
        return registry.get_sample_value(f"sglang:splitserve_{name}", LABELS)

    assert value("bytes_sent_total") == 150
    assert value("layers_posted_in_forward_total") == 8
    assert value("post_seconds_total") == 0.5
    assert value("transfers_failed_total") == 0
    assert value("exposed_handoff_seconds_count") == 2
    assert value("exposed_handoff_seconds_sum") == pytest.approx(0.203)


def test_metrics_reach_a_multiprocess_collector(tmp_path):
    """SGLang's /metrics reads the scheduler's metrics through prometheus_client's multiprocess
    files (``--enable-metrics`` sets ``PROMETHEUS_MULTIPROC_DIR`` before the scheduler starts):
    what a scheduler-like process publishes is there."""
    child = textwrap.dedent(
        """
        from splitserve.connectors.sglang.stats import COUNTERS, BackendMetrics
        metrics = BackendMetrics({"model_name": "tiny", "engine_type": "prefill"})
        totals = dict.fromkeys(COUNTERS, 0)
        totals["layers_posted_in_forward"] = 6
        metrics.publish(totals, [0.004])
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=120)
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    name = "sglang:splitserve_layers_posted_in_forward_total"
    assert registry.get_sample_value(name, LABELS) == 6
    count = "sglang:splitserve_exposed_handoff_seconds_count"
    assert registry.get_sample_value(count, LABELS) == 1


def test_timeline_lines_parse_back():
    line = "[2026-12-02 11:00:00] INFO x: " + format_event(
        "42", "d_done", 1764673200.25, {"handoff": 0.0123, "pages": 3}
    )
    room, name, wall, fields = parse_line(line)
    assert (room, name, wall) == ("42", "d_done", 1764673200.25)
    assert fields == {"handoff": "0.012300", "pages": "3"}
    assert parse_line("INFO unrelated line") is None


def test_timeline_off_logs_nothing_and_on_one_line_per_chunk(caplog):
    caplog.set_level(logging.INFO, logger="splitserve.connectors.sglang.timeline")
    off = Timeline(False)
    off.event(1, "p_request")
    off.loaded(1)
    assert not caplog.records and not off.awaiting_decode
    on = Timeline(True)
    reqs = [
        SimpleNamespace(bootstrap_room=7, prefix_len=0, extend_end=64),
        SimpleNamespace(bootstrap_room=None, prefix_len=0, extend_end=10),  # not disaggregated
    ]
    on.forward_started(reqs)
    on.last_layer_wall = 123.5
    on.forward_ended(layerwise=True)
    assert on.forward_rooms == []
    on.loaded(7)
    on.decode_batch(reqs)
    on.decode_ended()
    on.decode_batch(reqs)  # the second decode step logs nothing
    on.decode_ended()
    events = [parse_line(r.getMessage()) for r in caplog.records]
    assert [(e[0], e[1]) for e in events] == [
        ("7", "p_forward_start"),
        ("7", "p_forward_end"),
        ("7", "d_first_decode"),
        ("7", "d_first_decode_end"),
    ]
    assert events[0][3] == {"tokens": "0-64"} and events[1][3] == {"last_layer": "123.500000"}
    assert {e[1] for e in events} <= set(EVENTS)


def test_run_batch_hook_closes_what_it_opened_even_when_the_forward_raises(monkeypatch):
    from splitserve.connectors.sglang import layerwise

    calls = []
    mgr = SimpleNamespace(
        begin_forward=lambda scheduler, batch: calls.append("begin") or True,
        end_forward=lambda opened: calls.append(("end", opened)),
    )
    monkeypatch.setattr(layerwise, "ACTIVE", mgr)

    def forward(scheduler, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        layerwise.around_run_batch(forward, None, SimpleNamespace())
    assert calls == ["begin", ("end", True)]
    monkeypatch.setattr(layerwise, "ACTIVE", None)
    assert layerwise.around_run_batch(lambda s, b: "ran", None, SimpleNamespace()) == "ran"


def _manager(metrics):
    conn = pytest.importorskip("splitserve.connectors.sglang.conn")
    mgr = conn.SplitserveKVManager.__new__(conn.SplitserveKVManager)
    mgr.lock = threading.RLock()
    settled: dict = {}
    mgr.sender = SimpleNamespace(
        stats=_sender_stats(),
        poll_settled=lambda: {k: settled.pop(k) for k in list(settled)},
    )
    mgr.receiver, mgr.channel = None, _channel()
    mgr.transfers, mgr.layers_hooked, mgr.handoffs_s = {}, 0, []
    mgr.timeline, mgr.metrics, mgr.published = Timeline(False), metrics, 0.0
    mgr.request_status = {}
    mgr.update_status = mgr.request_status.__setitem__
    return conn, mgr, settled


def test_manager_publishes_when_a_transfer_settles_and_at_most_once_a_second_else():
    registry = CollectorRegistry()
    conn, mgr, settled = _manager(BackendMetrics(LABELS, registry))

    def completed():
        return registry.get_sample_value("sglang:splitserve_transfers_completed_total", LABELS)

    mgr.sender.stats.layers_posted_in_forward = 4
    mgr.drive()  # the first poll publishes (nothing published yet)
    mgr.sender.stats.transfers_completed = 1
    mgr.drive()  # within the interval, nothing settled: not published yet
    assert completed() == 0
    settled["5"] = SimpleNamespace(state=TransferState.COMPLETED)
    mgr.drive()
    assert completed() == 1
    name = "sglang:splitserve_layers_posted_in_forward_total"
    assert registry.get_sample_value(name, LABELS) == 4


def _load_timeline_script():
    path = ROOT / "benchmarks" / "sglang_timeline.py"
    spec = importlib.util.spec_from_file_location("sglang_timeline_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_timeline_script_joins_two_logs_into_one_row_per_request(tmp_path, capsys):
    script = _load_timeline_script()
    t = 1000.0
    p_events = [
        ("9", "p_request", t + 0.010, {}),
        ("9", "p_registered", t + 0.030, {"prefix": 0}),
        ("9", "p_init", t + 0.040, {}),
        ("9", "p_forward_start", t + 0.050, {"tokens": "0-64"}),
        ("9", "p_forward_end", t + 0.150, {"last_layer": t + 0.149}),
        ("9", "p_forward_start", t + 0.170, {"tokens": "64-100"}),
        ("9", "p_forward_end", t + 0.250, {"last_layer": t + 0.249}),
        ("9", "p_last_chunk", t + 0.251, {}),
        ("9", "p_sent", t + 0.260, {}),
    ]
    d_events = [
        ("9", "d_request", t, {}),
        ("9", "d_bootstrapped", t + 0.005, {}),
        ("9", "d_registered", t + 0.020, {"pages": 2}),
        ("9", "d_done", t + 0.255, {"handoff": 0.005}),
        ("9", "d_first_decode", t + 0.300, {}),
        ("9", "d_first_decode_end", t + 0.340, {}),
    ]
    p_log, d_log = tmp_path / "p.log", tmp_path / "d.log"
    for path, events in ((p_log, p_events), (d_log, d_events)):
        lines = [f"[ts] INFO conn: {format_event(*e)}\n" for e in events]
        path.write_text("noise\n" + "".join(lines))
    csv_path = tmp_path / "t.csv"
    argv = ["--prefill-log", str(p_log), "--decode-log", str(d_log), "--csv", str(csv_path)]
    assert script.main(argv) == 0
    rows = script.table(script.read_logs([p_log, d_log]))
    row, median = rows
    assert row["room"] == "9" and median["room"] == "median"
    assert row["d_request"] == 0 and row["p_request"] == 10
    assert row["chunks"] == 2 and row["forward"] == pytest.approx(180)
    assert row["gaps"] == pytest.approx(20) and row["queue"] == pytest.approx(10)
    assert row["wait_reg"] == pytest.approx(20) and row["tail"] == pytest.approx(5)
    assert row["to_decode"] == pytest.approx(45) and row["handoff"] == pytest.approx(5)
    assert row["p_result"] == pytest.approx(1) and row["to_done"] == pytest.approx(4)
    assert row["decode1"] == pytest.approx(40)
    assert row["last_layer"] == pytest.approx(249)
    out = capsys.readouterr().out
    assert out.startswith("| room |") and "| median |" in out
    assert csv_path.read_text().startswith("room,")


def _write_logs(tmp_path, rooms):
    """A P and a D log with one minimal request per (room, start) in ``rooms``."""
    p_lines, d_lines = [], []
    for room, t in rooms:
        p_lines += [
            format_event(room, "p_request", t + 0.010, {}),
            format_event(room, "p_init", t + 0.040, {}),
            format_event(room, "p_forward_start", t + 0.050, {}),
            format_event(room, "p_forward_end", t + 0.250, {"last_layer": t + 0.249}),
        ]
        d_lines += [
            format_event(room, "d_request", t + 0.002, {}),
            format_event(room, "d_done", t + 0.255, {"handoff": 0.005}),
            format_event(room, "d_first_decode", t + 0.300, {}),
        ]
    p_log, d_log = tmp_path / "p.log", tmp_path / "d.log"
    p_log.write_text("".join(f"[ts] INFO conn: {line}\n" for line in p_lines))
    d_log.write_text("".join(f"[ts] INFO conn: {line}\n" for line in d_lines))
    return p_log, d_log


def test_timeline_script_adds_the_clients_points_and_medians_per_length(tmp_path, capsys):
    """--rows: the benchmark's rows (room, send_wall, first_wall, length) add the client's points
    and spans to each request they name, leave out the requests they do not (warm-ups), and
    give a median row per prompt length."""
    script = _load_timeline_script()
    rooms = [("1", 1000.0), ("2", 2000.0), ("3", 3000.0), ("warm", 500.0)]
    p_log, d_log = _write_logs(tmp_path, rooms)
    with p_log.open("a") as f:  # P's registered point, for the plot's consecutive spans
        for room, t in rooms:
            f.write(f"[ts] INFO conn: {format_event(room, 'p_registered', t + 0.03, {})}\n")
    run_rows = [
        {"room": "1", "length": 512, "send_wall": 1000.0, "first_wall": 1000.280},
        {"room": "2", "length": 512, "send_wall": 2000.0, "first_wall": 2000.260},
        {"room": "3", "length": 2048, "send_wall": 3000.0, "first_wall": 3000.400},
        {"contender": "sglang-colocated", "length": 512, "ttft_s": 0.2},  # no room
    ]
    for row in run_rows[:3]:
        row["contender"] = "sglang-splitserve"
    run_rows += [
        {"contender": "sglang-colocated", "round": "sglang-splitserve", "length": 512, "ttft_s": t}
        for t in (0.25, 0.27, 0.30)
    ] + [{"contender": "sglang-colocated", "round": "sglang-nixl", "length": 512, "ttft_s": 9.0}]
    (tmp_path / "run.json").write_text(json.dumps({"rows": run_rows}))
    argv = ["--prefill-log", str(p_log), "--decode-log", str(d_log)]
    assert script.main([*argv, "--rows", str(tmp_path / "run.json")]) == 0
    requests = script.read_logs([p_log, d_log])
    reference = script.colocated_ttft_ms(run_rows, requests)
    assert reference == {512: pytest.approx(270)}  # its own round's colocated requests only
    assert script.add_client_rows(requests, run_rows) == 3
    rows = script.table(requests)
    assert [r["room"] for r in rows] == ["1", "2", "3", "median 512", "median 2048", "median"]
    first = rows[0]
    assert first["length"] == 512 and first["client_send"] == 0 and first["d_request"] == 2
    assert first["to_servers"] == pytest.approx(2) and first["ttft"] == pytest.approx(280)
    assert first["to_client"] == pytest.approx(25)
    assert rows[3]["ttft"] == pytest.approx(270) and rows[4]["ttft"] == pytest.approx(400)
    assert rows[5]["ttft"] == pytest.approx(280)
    out = capsys.readouterr().out
    assert "| median 2048 |" in out and "warm" not in out
    pytest.importorskip("matplotlib")
    assert script.plot(rows, tmp_path / "spans.png", reference_ms=reference) is True
    assert (tmp_path / "spans.png").read_bytes().startswith(b"\x89PNG")
    assert script.plot(rows[:3], tmp_path / "none.png") is False  # no median rows


def test_timeline_script_without_rows_keeps_every_request_and_no_client_columns(tmp_path):
    script = _load_timeline_script()
    p_log, d_log = _write_logs(tmp_path, [("1", 1000.0), ("warm", 500.0)])
    rows = script.table(script.read_logs([p_log, d_log]))
    assert [r["room"] for r in rows] == ["warm", "1", "median"]
    assert not set(script.CLIENT_POINTS + script.CLIENT_SPANS) & set(rows[0])
