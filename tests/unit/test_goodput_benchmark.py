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


def test_slo_scale_multiplies_every_bound_and_the_target(goodput) -> None:
    base = (goodput.SLO_TTFT_CHAT_S, goodput.SLO_TTFT_DOC_S, goodput.SLO_GAP_P99_S)
    target = goodput.ADAPTIVE_TARGET_MS
    try:
        goodput.scale_slo(1.6)
        scaled = (goodput.SLO_TTFT_CHAT_S, goodput.SLO_TTFT_DOC_S, goodput.SLO_GAP_P99_S)
        assert scaled == pytest.approx(tuple(1.6 * b for b in base))
        assert pytest.approx(1.6 * target) == goodput.ADAPTIVE_TARGET_MS
        assert "scaled 1.6x" in goodput.slo_text()
        assert '"target_itl_ms": 240' in " ".join(goodput.server_args("colocated-adaptive", "s0"))
        with pytest.raises(ValueError, match="positive"):
            goodput.scale_slo(0)
    finally:
        goodput.scale_slo(1.0)
    assert (base[0], base[2]) == (goodput.SLO_TTFT_CHAT_S, goodput.SLO_GAP_P99_S)
    assert "scaled" not in goodput.slo_text()


def test_scheduler_set_reaches_the_adaptive_servers_only(goodput) -> None:
    try:
        goodput.parse_args(
            ["--scheduler-set", "share_prefill=true", "--scheduler-set", "floor_below_block=no"]
        )
        adaptive = " ".join(goodput.server_args("pd", "d"))
        assert '"share_prefill": true' in adaptive
        assert '"floor_below_block": false' in adaptive
        assert "share_prefill" not in " ".join(goodput.server_args("pd", "p"))
        for bad in (["--scheduler-set", "no_such_setting=1"], ["--scheduler-set", "novalue"]):
            with pytest.raises(SystemExit):
                goodput.parse_args(bad)
    finally:
        goodput.parse_args([])
    assert "share_prefill" not in " ".join(goodput.server_args("pd", "d"))


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


class StandInEngine:
    """A fake engine (aiohttp): streams ``max_tokens`` tokens at once; for the script's run
    path only (the measurement itself needs real servers)."""

    def __init__(self) -> None:
        self.prompts: list[int] = []

    def app(self):
        from aiohttp import web

        async def health(request):
            return web.Response()

        async def metrics(request):
            return web.Response(text="")

        async def complete(request):
            body = await request.json()
            self.prompts.append(len(body["prompt"]))
            if not body.get("stream"):  # a prefill request: one token, as P answers
                choice = {"index": 0, "text": "a", "finish_reason": "length"}
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
                return web.json_response({"id": "x", "choices": [choice], "usage": usage})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for _ in range(body["max_tokens"]):
                await out.write(b'data: {"choices": [{"text": "a", "index": 0}]}\n\n')
            await out.write(b"data: [DONE]\n\n")
            return out

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", complete)
        return app


def test_run_path_against_stand_in_engines(goodput, tmp_path, monkeypatch) -> None:
    """Every contender's proxy, the driver and the report, with fake engines for servers."""
    import asyncio
    import threading

    from aiohttp.test_utils import TestServer

    from splitserve.models import _build_tokenizer, resolve_spec

    _build_tokenizer(resolve_spec("tiny"), tmp_path)
    engines = [StandInEngine(), StandInEngine()]
    loop = asyncio.new_event_loop()
    servers = [TestServer(e.app(), host="127.0.0.1") for e in engines]
    threading.Thread(target=loop.run_forever, daemon=True).start()
    for s in servers:
        asyncio.run_coroutine_threadsafe(s.start_server(), loop).result(30)
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]

    class NoServers:
        def stop(self) -> None:
            pass

    def start_group(group, model, log_dir):
        roles = ("p", "d") if group == "pd" else ("s0", "s1")
        got = dict(zip(roles, urls, strict=True))
        got |= {f"{r}-scheduler": u for r, u in zip(roles, urls, strict=True)}
        return NoServers(), got, 5

    monkeypatch.setattr(goodput, "build_model", lambda spec, out: tmp_path)
    monkeypatch.setattr(goodput, "_start_group", start_group)
    args = goodput.parse_args(
        ["--rates", "2,4", "--duration", "2", "--only", "colocated,pd-decide"]
    )
    report = goodput.run(args)
    try:
        rows = report["rows"]
        assert {(r["contender"], r["rate"]) for r in rows} == {
            (c, r) for c in ("colocated", "pd-decide") for r in (2.0, 4.0)
        }
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in rows)
        # the decision sent every request straight to the "decode" stand-in (no P behind it)
        decided = [r["decisions"] for r in rows if r["contender"] == "pd-decide"]
        assert all(sum(d.values()) > 0 for d in decided)
        assert "capacity under SLO" in goodput.markdown(report)
    finally:
        for s in servers:
            asyncio.run_coroutine_threadsafe(s.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)


def test_merge_joins_sweeps_and_recomputes_capacity(goodput) -> None:
    def report(rates: dict[float, float], duration: float = 40.0) -> dict:
        args = {"preset": "mid", "duration": duration, "seed": 18, "rates": list(rates)}
        rows = [{"contender": "pd", "rate": r, "attainment": a} for r, a in rates.items()]
        return {"slo": "s", "args": args, "rows": rows, "capacity": {}}

    merged = goodput.merge([report({0.3: 1.0, 1.0: 0.2}), report({0.6: 0.95})])
    assert merged["capacity"] == {"pd": 0.6} and merged["args"]["rates"] == [0.3, 0.6, 1.0]
    # 0.6 below the goal caps the first sweep's 0.3 there; a rate measured twice is refused
    assert goodput.merge([report({0.3: 1.0}), report({0.6: 0.5})])["capacity"] == {"pd": 0.3}
    with pytest.raises(SystemExit):
        goodput.merge([report({0.3: 1.0}), report({0.3: 1.0})])
    with pytest.raises(SystemExit):
        goodput.merge([report({0.3: 1.0}), report({0.6: 1.0}, duration=60.0)])
