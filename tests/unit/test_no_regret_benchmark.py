"""benchmarks/no_regret.py without servers: the verdict's arithmetic (within 5% of the best fixed
setting everywhere; every fixed setting >= 20% short somewhere), goodput under a cell's SLO, the
eight cells and the run plan (baselines shared by a pair's two ITL targets), each contender's
flags, the seeded workloads, and ``--help`` / ``--dry-run``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "no_regret.py"


@pytest.fixture(scope="module")
def nr():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_no_regret", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_no_regret"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _cell(nr, **goodputs: float) -> dict[str, float]:
    """A cell where every baseline has goodput 1.0 unless named (``fixed_256=...``)."""
    row = {b: 1.0 for b in nr.BASELINES}
    row.update({k.replace("_", "-"): v for k, v in goodputs.items()})
    return row


def test_target_met_when_adaptive_keeps_up_and_every_fixed_setting_regrets(nr) -> None:
    # Each baseline is 0.8 x the best in one cell (exactly 20% short counts), adaptive 0.95 x.
    cells = {}
    for k, b in enumerate(nr.BASELINES):
        row = _cell(nr, adaptive=0.95)
        row[b] = 0.8
        cells[f"c{k}"] = row
    v = nr.verdict(cells)
    assert v["adaptive_within_everywhere"] and v["every_fixed_falls_short_somewhere"]
    assert v["target_met"] and v["incomplete_cells"] == []
    assert v["worst_ratio"] == {b: pytest.approx(0.8) for b in nr.BASELINES}
    assert v["cells"]["c0"]["adaptive_ratio"] == pytest.approx(0.95)


def test_adaptive_just_past_five_percent_misses(nr) -> None:
    cells = {"a": _cell(nr, adaptive=0.949, fixed_256=0.5), "b": _cell(nr, adaptive=2.0)}
    v = nr.verdict(cells)
    assert not v["cells"]["a"]["adaptive_within"] and v["cells"]["b"]["adaptive_within"]
    assert not v["adaptive_within_everywhere"] and not v["target_met"]
    # Only fixed-256 is ever short; the others tie the best everywhere.
    assert v["falls_short"]["fixed-256"] and not v["falls_short"]["fixed-4096"]
    assert not v["every_fixed_falls_short_somewhere"]


def test_best_is_the_best_baseline_not_the_adaptive_budget(nr) -> None:
    row = _cell(nr, fixed_1024=2.0, adaptive=3.0)
    c = nr.verdict({"x": row})["cells"]["x"]
    assert c["best"] == "fixed-1024" and c["best_goodput"] == 2.0
    assert c["adaptive_ratio"] == pytest.approx(1.5)
    assert c["ratios"]["fixed-256"] == pytest.approx(0.5)


def test_a_fixed_setting_only_19_percent_short_does_not_regret(nr) -> None:
    v = nr.verdict({"x": _cell(nr, adaptive=1.0, lpt_256=0.81)})
    assert not v["falls_short"]["lpt-256"]


def test_a_cell_nobody_serves_blames_nobody(nr) -> None:
    zero = {b: 0.0 for b in nr.BASELINES} | {"adaptive": 0.0}
    v = nr.verdict({"z": zero})
    assert v["cells"]["z"]["adaptive_within"] and v["cells"]["z"]["adaptive_ratio"] is None
    assert v["worst_ratio"]["fixed-256"] is None and not v["falls_short"]["fixed-256"]


def test_incomplete_cells_are_left_out_of_the_verdict(nr) -> None:
    partial = _cell(nr)  # no adaptive run
    v = nr.verdict({"p": partial, "q": _cell(nr, adaptive=1.0)})
    assert v["complete_cells"] == ["q"] and v["incomplete_cells"] == ["p"]
    assert not nr.verdict({"p": partial})["target_met"]  # nothing complete: nothing shown
    text = nr.markdown({"p": partial}, nr.verdict({"p": partial}))
    assert "(incomplete)" in text and "Target met (over the complete cells): no" in text


def test_goodput_counts_requests_meeting_the_cells_slo(nr) -> None:
    tight, loose = nr.Cell("tiny", "mixed", 50.0), nr.Cell("tiny", "mixed", 150.0)
    m = nr.MODELS["tiny"]

    def rec(kind="chat", ttft=0.1, gap=0.04, error=None):
        return {"kind": kind, "ttft_s": ttft, "gap_p99_s": gap, "tokens": 9, "error": error}

    run = {
        "duration_s": 4.0,
        "requests": [
            rec(),  # good in both
            rec(gap=0.1),  # a 100 ms p99 gap: only under the 150 ms target
            rec(ttft=m.ttft_short_s + 0.01),  # a late chat
            rec(kind="doc", ttft=m.ttft_short_s + 0.01, gap=None),  # a document may wait longer
            rec(ttft=None, error="boom"),
        ],
    }
    assert nr.goodput(run, tight) == pytest.approx(2 / 4.0)
    assert nr.goodput(run, loose) == pytest.approx(3 / 4.0)


def test_table_maps_each_cell_to_its_own_adaptive_run(nr) -> None:
    runs = {f"tiny-mixed-{b}": {"duration_s": 1.0, "requests": []} for b in nr.BASELINES} | {
        "tiny-mixed-adaptive-30ms": {
            "duration_s": 1.0,
            "requests": [{"kind": "chat", "ttft_s": 0.1, "gap_p99_s": 0.01, "error": None}],
        },
        "tiny-mixed-adaptive-90ms": {"duration_s": 1.0, "requests": []},
    }
    t = nr.table(runs, [nr.Cell("tiny", "mixed", 50.0), nr.Cell("tiny", "mixed", 150.0)])
    assert t["tiny-mixed-50"]["adaptive"] == 1.0 and t["tiny-mixed-150"]["adaptive"] == 0.0
    assert set(t["tiny-mixed-50"]) == {*nr.BASELINES, "adaptive"}


def test_eight_cells_and_a_plan_that_shares_the_baselines(nr) -> None:
    assert len(nr.CELLS) == 8 and len({c.name for c in nr.CELLS}) == 8
    p = nr.plan(nr.CELLS)
    assert len(p) == 4  # (model, workload) pairs
    for _, _, runs in p:
        assert len(runs) == len(nr.BASELINES) + 2 == len(set(runs))
    assert p[0][2][0] != p[1][2][0]  # order rotated from one pair to the next
    one = nr.plan([nr.Cell("mid", "phased", 400.0)])
    assert one[0][:2] == ("mid", "phased") and "adaptive-240ms" in one[0][2]


def test_server_args_per_contender(nr) -> None:
    a = nr.server_args("fixed-512")
    assert a[a.index("--max-num-batched-tokens") + 1] == "512"
    assert "--no-enable-prefix-caching" in a and "--enable-chunked-prefill" in a
    lpt = nr.server_args("lpt-256")
    assert lpt[lpt.index("--long-prefill-token-threshold") + 1] == "256"
    ad = nr.server_args("adaptive-90ms")
    assert ad[ad.index("--scheduler-cls") + 1] == nr.SCHEDULER_CLS
    assert '"target_itl_ms": 90.0' in ad[ad.index("--additional-config") + 1]
    assert ad[ad.index("--max-num-batched-tokens") + 1] == str(nr.LARGE_BUDGET)


def test_workloads_are_seeded_and_the_same_for_every_contender(nr) -> None:
    for wl in nr.WORKLOADS:
        a, b = nr.arrivals("tiny", wl, 24.0), nr.arrivals("tiny", wl, 24.0)
        assert a == b and a != nr.arrivals("tiny", wl, 24.0, seed=1)
        assert {x.kind for x in a} == {"chat", "doc"}
        assert all(len(x.prompt) + x.max_tokens <= nr.MAX_MODEL_LEN for x in a)
    longs = [x for x in nr.arrivals("mid", "phased", 40.0) if x.kind == "doc"]
    assert len(longs) == 2 * (1 + nr.PHASED["quiet_longs"])  # two periods


def test_cli_help_and_dry_run() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for option in ("--cells", "--quick", "--out", "--from-json", "--dry-run"):
        assert option in done.stdout
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dry-run", "--cells", "mid-phased-1200"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "cells: mid-phased-1200" in done.stdout and "adaptive-720ms" in done.stdout
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--cells", "huge-mixed-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "unknown cell" in bad.stderr


def test_time_scale_stretches_times_and_bounds_not_the_requests(nr) -> None:
    """--time-scale S: the same requests S x later, every bound S x looser, the adaptive target
    S x larger; the cell keeps its stated name (its runs and merges are found by it)."""
    stated, slow = nr.Cell("mid", "mixed", 400.0), nr.Cell("mid", "mixed", 400.0, scale=1.6)
    assert slow.name == stated.name == "mid-mixed-400"
    assert slow.itl_s == pytest.approx(0.64)
    assert slow.ttft_bounds_s == pytest.approx((1.5 * 1.6, 8.0 * 1.6))
    assert slow.adaptive_run == "adaptive-384ms" and stated.adaptive_run == "adaptive-240ms"
    a, b = nr.arrivals("mid", "mixed", 40.0), nr.arrivals("mid", "mixed", 40.0, scale=1.6)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert [x.at_s * 1.6 for x in a] == pytest.approx([x.at_s for x in b])

    rec = {"kind": "chat", "ttft_s": 2.0, "gap_p99_s": 0.5, "tokens": 9, "error": None}
    run = {"duration_s": 1.0, "requests": [rec]}
    assert nr.goodput(run, stated) == 0.0 and nr.goodput(run, slow) == 1.0


def test_reports_at_different_time_scales_do_not_merge(nr) -> None:
    one = {"definition": "d", "runs": {"tiny-mixed-fixed-256": {}}, "time_scale": 1.6}
    other = {"definition": "d", "runs": {"tiny-mixed-fixed-512": {}}}  # written before: scale 1
    with pytest.raises(SystemExit, match="different time scales"):
        nr.merge([one, other])
    merged = nr.merge([one, {**other, "time_scale": 1.6}])
    assert merged["time_scale"] == 1.6 and len(merged["runs"]) == 2


def test_plot_of_the_complete_cells(nr, tmp_path) -> None:
    g = {
        "tiny-mixed-50": _cell(nr, adaptive=0.97, fixed_256=0.7),
        "tiny-mixed-150": {"fixed-256": 1.0},  # incomplete: not drawn
    }
    out = tmp_path / "nr.png"
    assert nr.plot(g, nr.verdict(g), out) and out.stat().st_size > 1000
    assert not nr.plot({}, nr.verdict({}), tmp_path / "none.png")


def test_only_adaptive_or_baselines_and_a_merge_that_replaces(nr) -> None:
    cells = [nr.Cell("mid", "phased", 400.0), nr.Cell("mid", "phased", 1200.0)]
    ((_, _, adaptive),) = nr.plan(cells, "adaptive")
    ((_, _, baselines),) = nr.plan(cells, "baselines")
    assert sorted(adaptive) == ["adaptive-240ms", "adaptive-720ms"]
    assert sorted(baselines) == sorted(nr.BASELINES)
    first = {"definition": "d", "runs": {"k": {"v": 1}, "j": {"v": 0}}}
    later = {"definition": "d", "runs": {"k": {"v": 2}}}
    with pytest.raises(SystemExit, match="measured twice"):
        nr.merge([first, later])
    merged = nr.merge([first, later], replace_runs=True)
    assert merged["runs"] == {"k": {"v": 2}, "j": {"v": 0}}
    assert merged["args"]["replaced"] == ["k"]


def test_scheduler_set_reaches_only_the_adaptive_runs(nr) -> None:
    try:
        nr.parse_args(["--scheduler-set", "share_prefill=true", "--cells", "mid-mixed-400"])
        adaptive = " ".join(nr.server_args("adaptive-384ms"))
        assert '"share_prefill": true' in adaptive and '"target_itl_ms": 384.0' in adaptive
        assert "share_prefill" not in " ".join(nr.server_args("lpt-256"))
        for bad in ("share_prefill", "no_such_setting=1", "share_prefill=[1, 2]"):
            with pytest.raises(SystemExit):
                nr.parse_args(["--scheduler-set", bad])
    finally:
        nr.parse_args([])
    assert "share_prefill" not in " ".join(nr.server_args("adaptive-384ms"))
