"""Per-request disaggregation through the proxy, on real vLLM servers with our connector (issue
#18): short prompts go straight to D, long ones through P, a prompt whose head D already holds
goes to D; every answer, streamed or not, completions and chat, equals a colocated server's
(greedy). Which way each request went is read from the proxy's own metrics (decisions by route
and reason, and P's request count), as an operator would. The relayed auxiliary endpoints
(``/tokenize``, ``/detokenize``, ``/version``) answer what the engine answers, and the proxy's
own count of a prompt equals the engine's ``/tokenize``.

Shares the connector tests' pair (``ss_pair``: ss-a prefills, ss-b decodes) through an
in-process proxy, like tests/integration/test_proxy_splitserve.py; ss-a served directly is the
colocated reference (a ``kv_both`` server asked without transfer params serves a request whole).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from metrics_text import fetch_metrics, metric_sum

from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

pytestmark = pytest.mark.integration

THRESHOLD = 256  # uncached tokens; the pair's budget is 512, its KV block 128 tokens
VOCAB = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "now"]


@pytest.fixture(scope="module")
def deciding_proxy(ss_pair, tiny_model) -> Iterator[BackgroundProxy]:
    (p_url, p_side), (d_url, _) = ss_pair["ss-a"], ss_pair["ss-b"]
    config = build_config(
        {
            "port": 0,
            "flow": "concurrent",  # with the first token from P (its default)
            "prefill": [{"url": p_url, "side_channel_port": p_side}],
            "decode": [{"url": d_url}],
            "decide": {
                "tokenizer": str(tiny_model),
                "threshold_tokens": THRESHOLD,
                "block_tokens": 128,
            },
        }
    )
    with BackgroundProxy(config) as running:
        yield running


def text_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(words))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)


def counts(proxy: BackgroundProxy) -> dict[str, float]:
    text = proxy.state.metrics.render().decode()
    out = {
        reason: metric_sum(text, "splitserve_proxy_decisions_total", reason=reason)
        for reason in ("short", "long", "prefix_on_decode", "prefill_busy", "error")
    }
    out["prefill_calls"] = metric_sum(text, "splitserve_proxy_prefill_seconds_count")
    return out


def tokens_of(proxy: BackgroundProxy, body: dict[str, Any], route: str) -> int:
    ids = proxy.state.forwarder.decider.count(body, route)  # type: ignore[union-attr]
    return ids if isinstance(ids, int) else len(ids)


def same_as_colocated(proxy: BackgroundProxy, ref_url: str, prompt: str, chat: bool) -> None:
    """One request through the proxy, streamed and not, equals ss-a served directly."""
    c, ref = client(proxy.url), client(ref_url)
    if chat:
        messages = [{"role": "user", "content": prompt}]
        want = ref.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0
        )
        got = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0
        )
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.model_dump() == want.usage.model_dump()
        stream = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == want.choices[0].message.content
        return
    want = ref.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    got = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.model_dump() == want.usage.model_dump()
    stream = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want.choices[0].text


def test_short_prompts_go_straight_to_decode(ss_pair, deciding_proxy) -> None:
    ref_url = ss_pair["ss-a"][0]
    before = counts(deciding_proxy)
    for i, chat in enumerate((False, True)):
        prompt = text_prompt(40, 8100 + i)
        route = "chat" if chat else "completions"
        body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        assert tokens_of(deciding_proxy, body, route) <= THRESHOLD
        same_as_colocated(deciding_proxy, ref_url, prompt, chat)
    after = counts(deciding_proxy)
    # streamed and not, each: under one 128-token block, so never a prefix decision
    assert after["short"] - before["short"] == 4
    assert after["prefill_calls"] == before["prefill_calls"], "P was never asked"


def test_long_prompts_go_through_prefill(ss_pair, deciding_proxy) -> None:
    ref_url = ss_pair["ss-a"][0]
    c, ref = client(deciding_proxy.url), client(ref_url)
    before = counts(deciding_proxy)
    for i, stream in enumerate((False, True)):
        prompt = text_prompt(600, 8200 + i)  # distinct prompts: no prefix held on D
        assert tokens_of(deciding_proxy, {"prompt": prompt}, "completions") > THRESHOLD
        want = ref.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        got = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=stream
        )
        text = "".join(ch.choices[0].text for ch in got if ch.choices) if stream else None
        assert (text if stream else got.choices[0].text) == want.choices[0].text
    messages = [{"role": "user", "content": text_prompt(600, 8210)}]
    want_chat = ref.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    got_chat = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    after = counts(deciding_proxy)
    assert after["long"] - before["long"] == 3
    assert after["prefill_calls"] - before["prefill_calls"] == 3


def test_prompt_whose_head_decode_holds_goes_to_decode(ss_pair, deciding_proxy) -> None:
    ref_url = ss_pair["ss-a"][0]
    head = text_prompt(700, 8300)
    before = counts(deciding_proxy)
    same_as_colocated(deciding_proxy, ref_url, head, chat=False)  # through P, then held on D
    mid = counts(deciding_proxy)
    assert mid["long"] - before["long"] == 1
    assert mid["prefix_on_decode"] - before["prefix_on_decode"] == 1  # the streamed repeat
    follow_up = head + " " + text_prompt(60, 8301)  # past the threshold, mostly held on D
    assert tokens_of(deciding_proxy, {"prompt": follow_up}, "completions") > THRESHOLD
    same_as_colocated(deciding_proxy, ref_url, follow_up, chat=False)
    after = counts(deciding_proxy)
    assert after["prefix_on_decode"] - mid["prefix_on_decode"] == 2
    assert after["prefill_calls"] - before["prefill_calls"] == 1, "P served only the head"
    assert after["error"] == 0


def _http(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


def test_aux_endpoints_answer_as_the_engine(ss_pair, deciding_proxy) -> None:
    d_url = ss_pair["ss-b"][0]
    proxy = deciding_proxy.url
    prompt = text_prompt(50, 8400)
    status, tok = _http(proxy + "/tokenize", {"model": "tiny", "prompt": prompt})
    assert (
        status == 200 and tok == _http(d_url + "/tokenize", {"model": "tiny", "prompt": prompt})[1]
    )
    # the proxy's own count (its tokenizer) is the engine's
    assert tok["count"] == tokens_of(deciding_proxy, {"prompt": prompt}, "completions")
    messages = [{"role": "user", "content": prompt}]
    _, chat_tok = _http(proxy + "/tokenize", {"model": "tiny", "messages": messages})
    assert chat_tok["count"] == tokens_of(deciding_proxy, {"messages": messages}, "chat")
    status, detok = _http(proxy + "/detokenize", {"model": "tiny", "tokens": tok["tokens"]})
    assert status == 200 and prompt in detok["prompt"]
    assert _http(proxy + "/version") == _http(d_url + "/version")
    assert metric_sum(fetch_metrics(proxy), "splitserve_proxy_decisions_total") > 0
