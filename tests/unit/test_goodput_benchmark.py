"""benchmarks/goodput.py without servers: the workload is seeded and the same for every
contender, the SLO and capacity arithmetic, the rotated order, each contender's flags and proxy
settings (valid proxy configs), and ``--quick --dry-run`` printing the plan."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.proxy.config import build_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "goodput.py"


@pytest.fixture(scope="module")
def goodput():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_goodput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_goodput"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_workload_is_seeded_and_within_the_stated_ranges(goodput) -> None:
    a, b = goodput.workload(1.0, 200.0), goodput.workload(1.0, 200.0)
    assert a == b and a != goodput.workload(1.0, 200.0, seed=1)
    assert 150 < len(a) < 250  # Poisson at 1/s over 200 s
    for x in a:
        lo, hi = goodput.DOC_PROMPT if x.kind == "doc" else goodput.CHAT_PROMPT
        olo, ohi = goodput.DOC_OUTPUT if x.kind == "doc" else goodput.CHAT_OUTPUT
        assert lo <= len(x.prompt) <= hi and olo <= x.max_tokens <= ohi
        assert len(x.prompt) + x.max_tokens <= goodput.MAX_MODEL_LEN
    docs = sum(x.kind == "doc" for x in a) / len(a)
    assert 0.1 < docs < 0.3


def test_slo_attainment_and_capacity(goodput) -> None:
    R = goodput.Result
    ok = R("chat", 0.0, 1.0, [1.0, 1.1, 1.2])
    slow = R("chat", 0.0, goodput.SLO_TTFT_CHAT_S + 0.1, [2.0])
    stall = R("doc", 0.0, 1.0, [1.0, 1.0 + goodput.SLO_GAP_P99_S + 0.01])
    failed = R("doc", 0.0, error="boom")
    assert [goodput.meets_slo(r) for r in (ok, slow, stall, failed)] == [True, False, False, False]
    s = goodput.summarize([ok, slow, stall, failed])
    assert s["attainment"] == 0.25 and s["errors"] == 1 and s["chat"]["attainment"] == 0.5
    assert goodput.capacity({0.5: 1.0, 1.0: 0.95, 1.5: 0.5, 2.0: 0.92}) == 1.0
    assert goodput.capacity({0.5: 0.5}) == 0.0


def test_order_rotates_and_keeps_shared_servers_together(goodput) -> None:
    names = [[c.name for c in goodput.order_for(i)] for i in range(4)]
    assert names[0][0] == "colocated" and names[1][0] == "colocated-lpt"
    assert names[3][:2] == ["pd", "pd-decide"]
    for order in names:
        assert sorted(order) == sorted(c.name for c in goodput.CONTENDERS)
        i = order.index("pd")
        assert order[i + 1] == "pd-decide"


def test_contender_settings_are_valid_proxy_configs(goodput) -> None:
    urls = {"s0": "http://127.0.0.1:1", "s1": "http://127.0.0.1:2"}
    urls |= {"p": "http://127.0.0.1:3", "d": "http://127.0.0.1:4"}
    for c in goodput.CONTENDERS:
        cfg = build_config(goodput._with_tokenizer(goodput.proxy_settings(c, urls, 5), Path("/m")))
        assert (cfg.decide is not None) == (c.name != "pd")
        if c.group != "pd":
            assert cfg.decide.threshold_tokens >= goodput.MAX_MODEL_LEN  # all straight to D
    assert "--long-prefill-token-threshold" in goodput.server_args("colocated-lpt", "s0")
    assert goodput.SCHEDULER_CLS in goodput.server_args("colocated-adaptive", "s1")
    assert goodput.SCHEDULER_CLS in goodput.server_args("pd", "d")
    assert goodput.SCHEDULER_CLS not in goodput.server_args("pd", "p")  # P never decodes


def test_quick_dry_run_prints_the_plan() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "SLO (fixed before the run)" in done.stdout
    assert done.stdout.count("order:") == 2 and "(e) 1 P + 1 D" in done.stdout
