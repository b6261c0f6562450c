"""The chaos soak (``benchmarks/soak.py``), short: ``splitserve up`` (1 P + 1 D) under 16
clients of mixed prompts (streamed and not, 10% leaving mid-request), P SIGKILLed and restarted
by the supervisor; the issue's targets must hold: errors < 1% outside the kill window, KV usage
back to 0 at idle, proxy RSS growth < 50 MB, engine RSS growth < 200 MB, every checked answer
equal to the colocated one.

Short for the suite (``SPLITSERVE_SOAK_MINUTES`` of load, 1.5 by default; the 10-minute run,
which also kills D, is in docs/benchmarks.md): a restart under this load takes a minute or
more on 2 cores, so one kill fits; D's kill is covered here by test_fault_matrix.py. Prompts
reach ~1,000 tokens and a quarter of the answers are checked, so that a short run checks some.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
SOAK_MINUTES = os.environ.get("SPLITSERVE_SOAK_MINUTES", "1.5")


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_soak_meets_the_targets(tmp_path) -> None:
    soak = _soak_module()
    args = soak.parse(
        [
            "--minutes", SOAK_MINUTES,
            "--max-words", "450",
            "--check", "0.25",
            "--kill-at", "0.15",
            "--warmup-s", "20",
            "--run-dir", str(tmp_path),
            "--out", str(tmp_path / "soak.json"),
        ]
    )  # fmt: skip
    summary = soak.run(args)
    met = summary["targets_met"]
    assert all(met.values()), {"targets": met, **summary}
    assert len(summary["kill_windows_s"]) == 1, summary  # P was killed and came back
    assert summary["errors_outside_windows"] <= summary["requests_outside_windows"] // 100
    assert summary["up_exit_code"] == 0, summary
