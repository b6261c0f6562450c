"""benchmarks/handoff.py's SGLang summary compares each contender with the colocated requests of
its own round (issue #25: colocated requests beside a spinning pair are not our reference)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def handoff(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("handoff")


def _row(contender, ttft, transport="default", length=512):
    return {"transport": transport, "contender": contender, "length": length, "ttft_s": ttft}


def test_each_sglang_contender_is_compared_with_its_own_rounds_colocated(handoff):
    from handoffbench.summary import summarize

    rows = [
        _row("sglang-splitserve", 1.1),
        _row("sglang-colocated", 1.0),
        _row("sglang-splitserve", 1.1),
        _row("sglang-colocated", 1.0),
        _row("sglang-nixl", 8.0),
        _row("sglang-colocated", 4.0),  # beside the spinning nixl pair
        _row("sglang-nixl", 8.0),
        _row("sglang-colocated", 4.0),
        _row("sglang-splitserve", 2.0, transport="tcp"),
        _row("sglang-colocated", 1.0, transport="tcp"),
    ]
    import handoff_sglang

    summary = handoff.relative_to_round(
        handoff_sglang.relative_to_colocated(summarize(handoff.sglang_rounds(rows)))
    )
    by = {(e["transport"], e["contender"]): e for e in summary}
    assert by[("default", "sglang-splitserve")]["ttft_vs_colocated"] == pytest.approx(0.1)
    assert by[("default", "sglang-nixl")]["ttft_vs_colocated"] == pytest.approx(1.0)
    assert by[("tcp", "sglang-splitserve")]["ttft_vs_colocated"] == pytest.approx(1.0)
    assert ("default", "sglang-colocated/sglang-nixl") in by
    assert ("default", "sglang-colocated") not in by, "no colocated row left without a round"


def test_an_explicit_round_wins_and_a_lone_colocated_row_keeps_its_name(handoff):
    rows = [
        _row("sglang-colocated", 1.0),  # before any contender: no round
        _row("sglang-nixl", 3.0),
        _row("sglang-colocated", 1.0) | {"round": "sglang-splitserve"},
    ]
    names = [r["contender"] for r in handoff.sglang_rounds(rows)]
    assert names == ["sglang-colocated", "sglang-nixl", "sglang-colocated/sglang-splitserve"]
    assert rows[2]["contender"] == "sglang-colocated", "the input rows are not changed"


def test_placement_gives_each_server_a_core_of_its_own_unless_shared(monkeypatch):
    """SPLITSERVE_SGLANG_BENCH_PLACEMENT: ``cores`` (default) pins the colocated server and P to
    core 0 and D to core 1 with one OpenMP thread each; ``shared`` pins nothing; anything else
    stops the run."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import handoff_sglang

    monkeypatch.delenv("SPLITSERVE_SGLANG_BENCH_PLACEMENT", raising=False)
    assert handoff_sglang.placement() == "cores"
    colocated, p, d = handoff_sglang.CORES["cores"]
    assert colocated == p == [0] and d == [1]
    assert handoff_sglang.pinned_env({"A": "1"}, d) == {"A": "1", "OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("SPLITSERVE_SGLANG_BENCH_PLACEMENT", "shared")
    assert handoff_sglang.placement() == "shared"
    assert handoff_sglang.CORES["shared"] == (None, None, None)
    assert handoff_sglang.pinned_env({"A": "1"}, None) == {"A": "1"}
    monkeypatch.setenv("SPLITSERVE_SGLANG_BENCH_PLACEMENT", "both")
    with pytest.raises(SystemExit, match="cores, shared"):
        handoff_sglang.placement()


def test_the_sglang_targets_table_compares_each_contender_with_its_own_round(handoff):
    """Issue #25's targets: TTFT <= 1.1x the colocated requests of the contender's own round,
    our exposed handoff against bulk / layers + 2 ms, the decode steps beside them."""
    import handoff_sglang
    from handoffbench.summary import summarize

    def row(contender, ttft, gap2, **extra):
        return _row(contender, ttft) | {"gap_s": 0.1, "gap2_s": gap2} | extra

    rows = [
        row("sglang-splitserve", 1.05, 0.09, exposed_s=0.003),
        row("sglang-colocated", 1.0, 0.08),
        row("sglang-nixl", 5.0, 0.2),
        row("sglang-colocated", 4.0, 0.2),  # nixl's round: 1.25x
    ]
    rounds = handoff.sglang_rounds(rows)
    summary = summarize(rounds)
    link = {"fixed_s": 0.0, "bytes_per_s": 4.5e9}
    goals = handoff_sglang.targets(summary, {"default": link}, rounds)
    by = {g["contender"]: g for g in goals}
    assert set(by) == {"sglang-splitserve", "sglang-nixl"}
    ours, nixl = by["sglang-splitserve"], by["sglang-nixl"]
    assert ours["ttft_ratio"] == pytest.approx(1.05) and ours["ttft_ok"]
    assert nixl["ttft_ratio"] == pytest.approx(1.25) and not nixl["ttft_ok"]
    # bench: 16 layers, 256 KiB per token -> 512 tokens: 128 MiB / 4.5 GB/s / 16 + 2 ms
    assert ours["bound_s"] == pytest.approx(512 * 256 * 1024 / 4.5e9 / 16 + 0.002)
    assert ours["exposed_ok"] and "exposed_s" not in nixl
    assert ours["colocated_gap2_s"] == pytest.approx(0.08) and ours["pair_gap2_s"] == 0.09
    table = handoff_sglang.targets_markdown(goals)
    assert "| default | sglang-nixl | 512 | 4.00 | 5.00 | 1.25x | no |" in table
    assert "| 3.0 | 3.9 | yes |" in table


def test_a_stream_whose_last_two_tokens_came_in_one_chunk_has_no_second_gap(handoff):
    import handoff_sglang

    assert handoff_sglang._gaps([1.0, 1.5, 1.75]) == {"gap_s": 0.5, "gap2_s": 0.25}
    assert handoff_sglang._gaps([1.0, 1.5]) == {"gap_s": 0.5}
