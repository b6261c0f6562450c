"""Per-request disaggregation (issue #18): the pure rule (``decide.py``), the prompt counter on
the model's own tokenizer, the decider's bookkeeping and metrics, the settings, and the relayed
auxiliary endpoints (``aux.py``) against a stand-in engine (an aiohttp app that answers
``/tokenize``, ``/detokenize`` and ``/version``: a fake, for the proxy's relay logic only; the
real engines answer in tests/integration/test_proxy_decide.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from splitserve.models import _build_tokenizer, resolve_spec
from splitserve.proxy.config import ConfigError, build_config
from splitserve.proxy.decide import (
    DecisionInputs,
    DecisionSettings,
    PrefixIndex,
    QueueEstimate,
    decide,
    local_prefill_threshold,
)
from splitserve.proxy.decider import Decider, PromptCounter
from splitserve.proxy.routing import Backend
from splitserve.proxy.server import ProxyServer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset's tokenizer (with its chat template), without the model's weights."""
    out = tmp_path_factory.mktemp("tok")
    _build_tokenizer(resolve_spec("tiny"), out)
    return out


# ---------------------------------------------------------------------- the pure rule


def test_rule_order_and_reasons() -> None:
    s = DecisionSettings(threshold_tokens=100, prefix_share=0.75)
    assert decide(s, DecisionInputs(1000, 800, 0)).reason == "prefix_on_decode"
    assert decide(s, DecisionInputs(100, 0, 0)).reason == "short"
    assert decide(s, DecisionInputs(101, 0, 0)).route == "disaggregate"
    # 950 of 1000 held is past the share; 700 of 1000 is not, but leaves 300 > 100 uncached
    assert decide(s, DecisionInputs(1000, 700, 0)).reason == "long"
    assert decide(s, DecisionInputs(1000, 950, 0)).uncached_tokens == 50
    # P's queue: 300 uncached tokens ahead of a 300-token prompt -> D
    assert decide(s, DecisionInputs(300, 0, 300)).reason == "prefill_busy"
    assert decide(s, DecisionInputs(300, 0, 299)).reason == "long"
    slow_d = DecisionSettings(threshold_tokens=100, decode_prefill_cost_ratio=2.0)
    assert decide(slow_d, DecisionInputs(300, 0, 300)).reason == "long"
    off = DecisionSettings(threshold_tokens=100, use_prefill_queue=False)
    assert decide(off, DecisionInputs(300, 0, 10_000)).reason == "long"


def test_prefill_busy_takes_no_prompt_over_its_limit() -> None:
    """D prefills in order: a long prompt taken from a busy P would hold D's short ones, so the
    queue rule stops at busy_max_tokens (default four thresholds)."""
    s = DecisionSettings(threshold_tokens=100)
    assert s.busy_limit() == 400
    assert decide(s, DecisionInputs(400, 0, 10_000)).reason == "prefill_busy"
    assert decide(s, DecisionInputs(401, 0, 10_000)).reason == "long"
    # counted in uncached tokens: a long prompt whose head D holds may still be taken
    assert decide(s, DecisionInputs(1000, 640, 10_000)).reason == "prefill_busy"
    wide = DecisionSettings(threshold_tokens=100, busy_max_tokens=5000)
    assert decide(wide, DecisionInputs(4000, 0, 10_000)).reason == "prefill_busy"
    none = DecisionSettings(threshold_tokens=100, busy_max_tokens=0)
    assert decide(none, DecisionInputs(300, 0, 10_000)).reason == "long"


def test_threshold_arithmetic() -> None:
    # 5 ms of handoff at 0.02 ms per token: 250 tokens break even; a 1000-token chunk fits a step
    assert local_prefill_threshold(5e-3, 2e-5, 1000) == 1000
    assert local_prefill_threshold(5e-3, 2e-5, None) == 250
    with pytest.raises(ValueError):
        local_prefill_threshold(1e-3, 0.0, 10)


def test_prefix_index_whole_blocks_bounded() -> None:
    idx = PrefixIndex(block_tokens=4, max_blocks=3)
    ids = list(range(14))
    assert idx.cached_tokens("d", ids) == 0
    idx.record("d", ids)  # 3 whole blocks (12 tokens), the last 2 tokens are no block
    assert idx.cached_tokens("d", ids) == 12
    assert idx.cached_tokens("d", ids[:12]) == 11  # never the last token
    assert idx.cached_tokens("d", [99, *ids[1:]]) == 0  # a block's key covers what precedes it
    assert idx.cached_tokens("other", ids) == 0
    idx.record("d", list(range(100, 108)))  # 2 more blocks: the 2 least recently used go
    assert idx.cached_tokens("d", ids) == 0  # its first block was dropped: nothing matches
    idx.forget("d")
    assert idx.cached_tokens("d", list(range(100, 108))) == 0


def test_queue_estimate() -> None:
    q = QueueEstimate(weight=0.5)
    assert q.tokens_ahead(3) == 0
    q.observe(1000)
    q.observe(2000)
    assert q.mean_tokens == 1500 and q.tokens_ahead(2) == 3000


# ---------------------------------------------------------------------- counting


def test_counts_match_the_models_tokenizer(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    c = PromptCounter(str(tokenizer_dir))
    text = "hello world the quick brown fox " * 20
    assert c.completion_ids(text) == hf(text)["input_ids"]
    assert c.completion_ids([5, 6, 7]) == [5, 6, 7]
    assert c.completion_ids([text, text]) == 2 * len(hf(text)["input_ids"])
    assert c.completion_ids({"not": "a prompt"}) is None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    assert c.chat_ids(msgs) == want


def test_chat_without_a_template_counts_the_text(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    c = PromptCounter(str(tmp_path / "tokenizer.json"))
    assert c.template is None
    parts = [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {}}]
    msgs = [{"role": "user", "content": "world"}, {"role": "user", "content": parts}]
    assert c.chat_ids(msgs) == c.tokenizer.encode("world\nhello").ids


def test_a_missing_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="decide.tokenizer: .*tokenizer.json"):
        PromptCounter(str(tmp_path))
    with pytest.raises(ConfigError, match="decide.tokenizer"):
        Decider(DecisionSettings(), CollectorRegistry())


# ---------------------------------------------------------------------- the decider


def _metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


def test_decider_routes_records_and_reports(tokenizer_dir: Path) -> None:
    reg = CollectorRegistry()
    settings = DecisionSettings(
        tokenizer=str(tokenizer_dir), threshold_tokens=64, block_tokens=16, busy_max_tokens=4096
    )
    dec = Decider(settings, reg)
    p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")

    async def ask(body: dict[str, Any], route: str = "completions") -> bool:
        return await dec.straight_to_decode(body, route, p, d)

    short = {"prompt": "hello world"}
    long = {"prompt": "the quick brown fox jumps " * 40}
    assert asyncio.run(ask(short)) is True
    assert asyncio.run(ask(long)) is False
    # the same head plus a short tail: D holds most of it now
    assert asyncio.run(ask({"prompt": long["prompt"] + "and more"})) is True
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert asyncio.run(ask(chat, "chat")) is True
    # P busy: three long prompts in flight ahead of another long one
    p.outstanding = 3
    assert asyncio.run(ask({"prompt": "a lazy dog sleeps all day " * 40})) is True
    m = "splitserve_proxy_decisions_total"
    assert _metric(reg, m, route="decode", reason="short") == 2
    assert _metric(reg, m, route="disaggregate", reason="long") == 1
    assert _metric(reg, m, route="decode", reason="prefix_on_decode") == 1
    assert _metric(reg, m, route="decode", reason="prefill_busy") == 1
    assert _metric(reg, "splitserve_proxy_decision_prompt_tokens_count", route="decode") == 4
    # a body without a prompt is never refused here: it goes through P (the engine answers it)
    assert asyncio.run(ask({"prompt": None})) is False
    assert _metric(reg, m, route="disaggregate", reason="error") == 1


def test_long_prompts_are_counted_on_a_thread_with_the_same_answer(tokenizer_dir: Path) -> None:
    body = {"prompt": "the quick brown fox jumps " * 400}
    answers = []
    for chars in (0, 1 << 20):  # on a thread, then on the loop
        dec = Decider(
            DecisionSettings(tokenizer=str(tokenizer_dir), thread_chars=chars), CollectorRegistry()
        )
        p, d = Backend("prefill", "http://p"), Backend("decode", "http://d")
        answers.append(asyncio.run(dec.straight_to_decode(body, "completions", p, d)))
        assert dec.index.cached_tokens("http://d", dec.count(body, "completions")) > 0
    assert answers == [False, False]


# ---------------------------------------------------------------------- settings


def _proxy(**kw: Any) -> dict[str, Any]:
    return {
        "engine": "vllm",
        "flow": "concurrent",
        "prefill": [{"url": "http://127.0.0.1:1", "side_channel_port": 5}],
        "decode": [{"url": "http://127.0.0.1:2"}],
        **kw,
    }


def test_settings_errors_name_the_field() -> None:
    assert build_config(_proxy()).decide is None
    assert build_config(_proxy(decide={})).decide == DecisionSettings()
    with pytest.raises(ConfigError, match="decide.threshold_tokens"):
        build_config(_proxy(decide={"threshold_tokens": -1}))
    with pytest.raises(ConfigError, match="decide.thresold"):
        build_config(_proxy(decide={"thresold": 5}))
    sglang = _proxy(engine="sglang", decide={})
    sglang["prefill"] = [{"url": "http://127.0.0.1:1", "bootstrap_port": 5}]
    with pytest.raises(ConfigError, match="decide: SGLang's decode servers cannot prefill"):
        build_config(sglang)


# ---------------------------------------------------------------------- aux endpoints


class StandInEngine:
    """A fake engine (aiohttp) answering the auxiliary endpoints; records what it got."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._version)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/model_info", self._version)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append((request.path, body))
        if "prompt" not in body and "tokens" not in body:
            return web.json_response({"error": {"message": "no prompt"}}, status=400)
        return web.json_response({"path": request.path, "got": body})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "stand-in"})


async def _get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, json.loads(await r.read())


async def _post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, json.loads(await r.read())


async def test_aux_endpoints_are_relayed_unchanged() -> None:
    engine = StandInEngine()
    server = TestServer(engine.app(), host="127.0.0.1")
    await server.start_server()
    url = f"http://127.0.0.1:{server.port}"
    config = build_config(
        {
            "host": "127.0.0.1",
            "port": 0,
            "prefill": [{"url": "http://127.0.0.1:9", "side_channel_port": 5}],  # down
            "decode": [{"url": url}],
            "flow": "concurrent",
        }
    )
    proxy = await ProxyServer(config).start()
    try:
        status, body = await _post(proxy.url + "/tokenize", {"prompt": "hi"})
        assert (status, body) == (200, {"path": "/tokenize", "got": {"prompt": "hi"}})
        status, body = await _post(proxy.url + "/detokenize", {"tokens": [1, 2]})
        assert status == 200 and body["path"] == "/detokenize"
        assert await _get(proxy.url + "/version") == (200, {"version": "stand-in"})
        status, body = await _post(proxy.url + "/tokenize", {"nothing": 1})
        assert status == 400 and body["error"]["message"] == "no prompt"  # the engine's own
        status, _ = await _get(proxy.url + "/model_info")
        assert status == 404  # an SGLang route, not served for vLLM
    finally:
        await proxy.close()
        await server.close()


def test_plan_prints_the_threshold_it_derives() -> None:
    from click.testing import CliRunner

    from splitserve.cli import cli
    from splitserve.planner.catalog import get_accelerator, get_link, get_model
    from splitserve.planner.plan import make_plan

    plan = make_plan(get_model("Llama-3.1-8B"), get_accelerator("H100"), get_link("NVLink4"))
    d = plan.decide
    assert d is not None and d.tokens == max(d.break_even_tokens, d.one_step_chunk or 0)
    assert d.break_even_tokens == local_prefill_threshold(d.handoff_s, d.prefill_s_per_token, None)
    out = CliRunner().invoke(cli, ["plan", "--model", "Llama-3.1-8B", "--gpu", "H100"]).output
    assert f"threshold_tokens: {d.tokens} = max(break-even {d.break_even_tokens}" in out


def test_up_names_the_served_model_as_the_tokenizer(tmp_path: Path) -> None:
    import yaml

    from splitserve.config import parse_deployment
    from splitserve.launch.deployment import plan_servers, write_proxy_config

    data = {
        "model": {"preset": "tiny", "served_name": "tiny"},
        "prefill": {"base_port": 9100, "side_channel_base_port": 9600},
        "decode": {"base_port": 9200, "scheduler": {}},
        "connector": {"name": "splitserve"},
        "proxy": {"port": 9000, "flow": "concurrent", "decide": {"threshold_tokens": 300}},
    }
    dep = parse_deployment(data, "dep.yaml")
    out = write_proxy_config(dep, plan_servers(dep, tmp_path), tmp_path / "p.yaml", None, "/m")
    written = yaml.safe_load(out.read_text())["decide"]
    assert written["tokenizer"] == "/m" and written["threshold_tokens"] == 300
    data["proxy"]["decide"] = {"threshold_tokens": "many"}
    with pytest.raises(Exception, match="proxy.decide.threshold_tokens"):
        parse_deployment(data, "dep.yaml")
