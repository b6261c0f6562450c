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
