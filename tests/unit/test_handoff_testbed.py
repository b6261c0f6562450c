"""benchmarks/handoff.py --testbed without engines: the planner's prediction per point, the
predicted and measured crossover, ours against stock, the tables, and the sweep's settings."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.planner.handoff import exposed_streaming_seconds

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
L, KV, BLOCK = 16, 256 * 1024, 128  # the bench preset: 16 layers, 256 KiB fp32 KV per token


@pytest.fixture(scope="module")
def vb():
    sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("handoffbench.viability")


def test_slice_is_whole_blocks_of_one_layer(vb) -> None:
    assert vb.layer_slice_bytes(512, KV, L, BLOCK) == 512 * KV // L
    assert vb.layer_slice_bytes(513, KV, L, BLOCK) == 640 * KV // L


def test_prediction_is_the_planner_formula(vb) -> None:
    s = vb.layer_slice_bytes(512, KV, L, BLOCK)  # 8 MiB
    hidden = vb.predict(L, s, 1e9, 0.001, 0.130)
    assert hidden["t_x_s"] == pytest.approx(0.001 + s / 1e9)
    assert hidden["predicted_s"] == pytest.approx(hidden["t_x_s"])  # t_x < t_c: one slice
    slow = vb.predict(L, s, 30e6, 0.0, 0.130)
    assert slow["predicted_s"] == pytest.approx(exposed_streaming_seconds(L, s / 30e6, 0.130))
    assert slow["predicted_s"] == pytest.approx(s / 30e6 + 15 * (s / 30e6 - 0.130))


def test_within_is_25_percent_or_2_ms(vb) -> None:
    assert vb.within(0.0030, 0.0012)  # 1.8 ms off: the 2 ms floor
    assert not vb.within(0.0040, 0.0012)
    assert vb.within(1.24, 1.0) and vb.within(0.76, 1.0)
    assert not vb.within(1.26, 1.0)


def _point(vb, bps: float, t_c: float, exposed: float | None = None) -> dict:
    s = vb.layer_slice_bytes(512, KV, L, BLOCK)
    p = {"goodput_bps": bps, "slice_bytes": s, "fixed_s": 0.0} | vb.predict(L, s, bps, 0.0, t_c)
    p["exposed_s"] = p["predicted_s"] if exposed is None else exposed
    return p


def test_crossovers_of_model_points_agree_with_the_prediction(vb) -> None:
    s, t_c = vb.layer_slice_bytes(512, KV, L, BLOCK), 0.130
    assert vb.predicted_crossover_bps(s, t_c, 0.0) == pytest.approx(s / t_c)
    assert vb.predicted_crossover_bps(s, 0.001, 0.002) == float("inf")
    points = [_point(vb, bps, t_c) for bps in (25e6, 40e6, 55e6, 120e6, 600e6)]
    measured = vb.measured_crossover_bps(points, L, s)
    assert measured["bps"] == pytest.approx(s / t_c)
    assert "3 clear points" in measured["how"]
    one = vb.measured_crossover_bps([points[2], points[3]], L, s)  # one clear point: model slope
    assert one["bps"] == pytest.approx(s / t_c)


def test_measured_crossover_edges(vb) -> None:
    s = vb.layer_slice_bytes(512, KV, L, BLOCK)
    hidden = [_point(vb, bps, 0.130) for bps in (120e6, 600e6)]
    assert vb.measured_crossover_bps(hidden, L, s)["bps"] is None
    assert "hidden at every rate" in vb.measured_crossover_bps(hidden, L, s)["how"]
    assert vb.measured_crossover_bps([], L, s)["bps"] is None
    # A slower compute in the measurement: the crossover moves down, as the line through the
    # measured excess says (exposed of t_c = 0.2 s, predicted with 0.13 s).
    slow = [_point(vb, bps, 0.130, _point(vb, bps, 0.2)["predicted_s"]) for bps in (20e6, 30e6)]
    assert vb.measured_crossover_bps(slow, L, s)["bps"] == pytest.approx(s / 0.2)


def _rows() -> tuple[list[dict], list[dict]]:
    rows, links = [], []
    for kind in ("push", "pull", "nixl"):
        rows.append({"kind": kind, "flow": "colocated", "rate": "-", "length": 512,
                     "p_prefill_s": 2.0})  # fmt: skip
        for rate, bps, exposed in (
            ("250", 30e6, 3.0),
            ("1000", 120e6, 0.07),
            ("unshaped", 6e8, 0.015),
        ):
            links.append({"kind": kind, "rate": rate, "goodput_bps": bps, "rtt_s": 1e-4})
            row = {"kind": kind, "flow": "transfer", "rate": rate, "length": 512,
                   "p_prefill_s": 2.08}  # fmt: skip
            if kind == "nixl":
                row |= {"handoff_s": 16 * 8.4e6 / bps + 0.06, "d_step_s": 0.06}
            else:
                row |= {"exposed_s": exposed, "after_p_s": exposed + 0.06}
            rows.append(row)
    return rows, links


def test_summary_tables_and_verdict(vb) -> None:
    rows, links = _rows()
    summary = vb.summarize(rows, links, L, KV, BLOCK)
    points = {(p["kind"], p["rate"]): p for p in summary["points"]}
    push = points[("push", "1000")]
    assert push["t_c_s"] == pytest.approx(2.08 / L)
    assert push["p_prefill_vs_colocated"] == pytest.approx(0.04)
    assert push["predicted_s"] == pytest.approx(5e-5 + 8 * 2**20 / 120e6)
    assert push["ratio"] == pytest.approx(0.07 / push["predicted_s"])
    assert points[("nixl", "250")]["stock_transfer_s"] == pytest.approx(16 * 8.4e6 / 30e6)
    assert [p["rate"] for p in summary["points"] if p["kind"] == "pull"] == [
        "250", "1000", "unshaped"
    ]  # fmt: skip
    cross = {c["kind"]: c for c in summary["crossovers"]}
    assert cross["push"]["predicted_bps"] == pytest.approx(8 * 2**20 / (2.08 / L - 5e-5))
    assert cross["push"]["measured_bps"] is not None
    stock = {(v["kind"], v["rate"]): v for v in summary["vs_stock"]}
    assert stock[("push", "1000")]["ratio"] == pytest.approx(0.13 / (16 * 8.4e6 / 120e6 + 0.06))
    assert stock[("push", "1000")]["within"]
    table = vb.markdown(summary)
    assert "| push | 1000 | 0.960 | 512 |" in table
    assert "predicted crossover Gbit/s" in table
    lines = vb.verdict(summary)
    assert lines[2].startswith("ours <= 0.25x stock (beyond P's answer): ")
    assert all(" of " in line for line in lines)


def test_prediction_with_the_forward_tail(vb) -> None:
    """The tail comes off the plain prediction (down to DONE's delivery, half the round trip),
    also for a backlog; without a measured tail only the plain figure is there."""
    s = vb.layer_slice_bytes(512, KV, L, BLOCK)
    plain = vb.predict(L, s, 1e9, 0.001, 0.130)
    assert "predicted_tail_s" not in plain
    assert plain["bulk_s"] == pytest.approx(0.001 + L * s / 1e9)
    hidden = vb.predict(L, s, 1e9, 0.001, 0.130, tail_s=0.004)
    assert hidden["predicted_s"] == plain["predicted_s"]
    assert hidden["predicted_tail_s"] == pytest.approx(plain["t_x_s"] - 0.004 + 0.001)
    gone = vb.predict(L, s, 1e9, 0.001, 0.130, tail_s=0.5)
    assert gone["predicted_tail_s"] == pytest.approx(0.001)  # only DONE's delivery is left
    slow = vb.predict(L, s, 30e6, 0.0, 0.130, tail_s=0.03)
    assert slow["predicted_tail_s"] == pytest.approx(slow["predicted_s"] - 0.03)


def test_summary_with_tails_judges_both_predictions(vb) -> None:
    """Rows that carry P's forward tail get the with-tail prediction, its ratio and verdict,
    and the arithmetic bound against stock; the crossover is judged as without."""
    rows, links = _rows()
    for row in rows:
        if row["kind"] in ("push", "pull") and row["flow"] == "transfer":
            row["tail_s"] = 0.03
    summary = vb.summarize(rows, links, L, KV, BLOCK)
    points = {(p["kind"], p["rate"]): p for p in summary["points"]}
    push = points[("push", "1000")]
    # DONE: push's carrier WRITE (one layer of one block, 2 MiB) after the completions' way
    # back; pull's message beside the READs, half the round trip
    carrier = BLOCK * KV // L
    assert push["tail_s"] == 0.03
    assert push["done_s"] == pytest.approx(2 * 5e-5 + carrier / 120e6)
    assert push["predicted_tail_s"] == pytest.approx(push["t_x_s"] - 0.03 + push["done_s"])
    pull = points[("pull", "1000")]
    assert pull["done_s"] == pytest.approx(5e-5)
    assert pull["predicted_tail_s"] == pytest.approx(pull["t_x_s"] - 0.03 + 5e-5)
    assert push["ratio_tail"] == pytest.approx(0.07 / push["predicted_tail_s"])
    assert push["within_tail"] is vb.within(0.07, push["predicted_tail_s"])
    cross = {c["kind"]: c for c in summary["crossovers"]}
    assert cross["push"]["tail_s"] == 0.03
    # ours <= 0.25x stock needs t_x <= (15 t_c + t_tail) / 12: at that goodput the bound is 0.25
    target = cross["push"]["stock_target_bps"]
    c = cross["push"]
    at = vb.predict(L, c["slice_bytes"], target, c["fixed_s"], c["t_c_s"], 0.03, 0.0)
    assert at["predicted_tail_s"] / (L * at["t_x_s"]) == pytest.approx(0.25)
    plain_cross = vb.summarize(*_rows(), L, KV, BLOCK)["crossovers"][0]
    assert cross["push"]["measured_bps"] == plain_cross["measured_bps"]
    stock = {(v["kind"], v["rate"]): v for v in summary["vs_stock"]}
    slow = points[("push", "250")]
    assert stock[("push", "250")]["bound"] == pytest.approx(
        slow["predicted_tail_s"] / slow["bulk_s"]
    )
    table = vb.markdown(summary)
    assert "| with tail ms |" in table and "| 30.0 |" in table
    lines = vb.verdict(summary)
    assert lines[3].startswith("exposed within 25% (or 2 ms) of predicted with the tail: ")
    assert len(lines) == 4
    plain = vb.verdict(vb.summarize(*_rows(), L, KV, BLOCK))
    assert len(plain) == 3  # no tail measured: no with-tail verdict


def test_plot_without_matplotlib_is_skipped(vb, tmp_path) -> None:
    rows, links = _rows()
    summary = vb.summarize(rows, links, L, KV, BLOCK)
    assert vb.plot(summary, tmp_path / "x.png", lambda: None) is False


def test_sweep_settings_quick_full_and_overrides() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    tbm = importlib.import_module("handoffbench.testbed")
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--repeats", type=int)
    tbm.add_arguments(parser)
    quick = parser.parse_args(["--testbed", "--quick"])
    sweep = tbm.settings(quick, False, False)
    assert sweep["rates"][-1] is None and sweep["lengths"] == tbm.QUICK["lengths"]
    args = parser.parse_args(["--testbed", "--rates", "900", "100", "--no-unshaped",
                              "--lengths", "256", "--repeats", "4", "--delay-ms", "2"])  # fmt: skip
    sweep = tbm.settings(args, True, True)
    assert sweep["rates"] == [100.0, 900.0] and sweep["lengths"] == [256]
    assert sweep["repeats"] == 4 and args.delay_ms == 2.0


def test_help_lists_the_testbed_options() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "handoff.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for option in ("--testbed", "--quick", "--rates", "--delay-ms", "--kinds", "--no-unshaped"):
        assert option in done.stdout, option
