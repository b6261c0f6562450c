"""The proxy in front of two real vLLM servers running our SplitserveConnector: the concurrent
flow (one transfer id, P and D at the same time, KV streamed layer by layer) and the sequential
flow, with the official ``openai`` client; greedy output equals a colocated run.

The concurrent proxy runs with ``first_token_from_prefill`` (its default): the client's first
token is P's and D continues from it; the tests compare text, finish reasons and usage with a
colocated server, for completions and chat, streamed and not, and the first token that ends the
request (``max_tokens=1``, a stop token), and a stop string across the seam. Prompts are
text, as clients send: the first-token flow's only documented difference is the text of a token
at the seam when a token-id prompt ends inside a multi-byte character (docs/proxy.md), which
random token ids hit.

Shares the connector tests' servers (the ``ss_pair`` fixture of tests/integration/conftest.py,
keys ``ss-a`` / ``ss-b``). Only successful flows run here, so the connector tests' "no failed
transfer" check on those servers still holds.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Iterator

import openai
import pytest
from metrics_text import fetch_metrics, metric_sum

from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def concurrent_proxy(ss_pair) -> Iterator[BackgroundProxy]:
    (p_url, p_side), (d_url, _) = ss_pair["ss-a"], ss_pair["ss-b"]
    config = build_config(
        {
            "port": 0,
            "flow": "concurrent",
            "prefill": [{"url": p_url, "side_channel_port": p_side}],
            "decode": [{"url": d_url}],
        }
    )
    assert config.first_token_from_prefill, "on by default for the concurrent flow"
    with BackgroundProxy(config) as running:
        yield running


@pytest.fixture(scope="module")
def plain_concurrent_proxy(ss_pair) -> Iterator[BackgroundProxy]:
    """The concurrent flow without the first token from P (D samples every token): the flow
    for prompts of random token ids, whose text at the seam would differ (see above)."""
    (p_url, p_side), (d_url, _) = ss_pair["ss-a"], ss_pair["ss-b"]
    config = build_config(
        {
            "port": 0,
            "flow": "concurrent",
            "first_token_from_prefill": False,
            "prefill": [{"url": p_url, "side_channel_port": p_side}],
            "decode": [{"url": d_url}],
        }
    )
    with BackgroundProxy(config) as running:
        yield running


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(length)]


def colocated(url: str, prompt: list[int], max_tokens: int = 8) -> str:
    out = client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


def test_concurrent_flow_through_proxy_matches_colocated(ss_pair, plain_concurrent_proxy) -> None:
    p_url = ss_pair["ss-a"][0]
    c = client(plain_concurrent_proxy.url)
    for i, length in enumerate([1, 129, 1300]):  # one token, past a block, chunked on P
        prompt = prompt_of(length, 7100 + i)
        ref = colocated(p_url, prompt)
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == ref, f"{length} tokens"
        assert got.usage.prompt_tokens == length
        stream = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == ref


def test_concurrent_flow_parallel_streams(ss_pair, plain_concurrent_proxy) -> None:
    p_url = ss_pair["ss-a"][0]
    prompts = [prompt_of(n, 7200 + n) for n in (40, 200, 333, 600)]
    refs = [colocated(p_url, pr) for pr in prompts]

    def one(prompt: list[int]) -> str:
        stream = client(plain_concurrent_proxy.url).completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == refs
    text = plain_concurrent_proxy.state.metrics.render().decode()
    assert 'splitserve_proxy_requests_total{route="completions",status="200"}' in text


def test_sequential_flow_with_our_connector(ss_pair) -> None:
    (d_url, _), (p_url, _) = ss_pair["ss-a"], ss_pair["ss-b"]  # roles swapped: b prefills
    config = build_config({"port": 0, "prefill": [{"url": p_url}], "decode": [{"url": d_url}]})
    with BackgroundProxy(config) as running:
        prompt = prompt_of(300, 7300)
        got = client(running.url).completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0
        )
        assert got.choices[0].text == colocated(p_url, prompt)


# -- first token from the prefill server ---------------------------------------------------------


def text_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "now"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def _kv_usage(url: str) -> float:
    return metric_sum(fetch_metrics(url), "vllm:kv_cache_usage_perc")


def wait_kv_usage_zero(url: str, bound: float = 60.0) -> None:
    end = time.monotonic() + bound
    while _kv_usage(url) != 0.0:
        assert time.monotonic() < end, f"{url}: KV cache not freed"
        time.sleep(0.5)


def test_first_token_flow_completions_and_chat_match_colocated(ss_pair, concurrent_proxy) -> None:
    p_url = ss_pair["ss-a"][0]
    c, ref = client(concurrent_proxy.url), client(p_url)
    for i, words in enumerate([3, 150, 700]):  # under a block; past one; chunked on P
        prompt = text_prompt(words, 7400 + i)
        want = ref.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.choices[0].text, f"{words} words"
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.model_dump() == want.usage.model_dump()
        chunks = list(
            c.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.choices[0].text
        assert len({ch.id for ch in chunks}) == 1
        assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens == 8
        messages = [{"role": "user", "content": prompt}]
        want_chat = ref.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0
        )
        got_chat = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0
        )
        assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
        assert got_chat.usage.model_dump() == want_chat.usage.model_dump()
        chat_chunks = list(
            c.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
            )
        )
        deltas = [ch.choices[0].delta for ch in chat_chunks if ch.choices]
        assert [d.role for d in deltas if d.role] == ["assistant"]
        assert "".join(d.content or "" for d in deltas) == want_chat.choices[0].message.content


def test_first_token_that_ends_the_request(ss_pair, concurrent_proxy) -> None:
    """max_tokens=1 (P alone), and a stop token on the first token (D cancelled, nothing
    leaks on either server); the same answer as a colocated server."""
    (p_url, _), (d_url, _) = ss_pair["ss-a"], ss_pair["ss-b"]
    c, ref = client(concurrent_proxy.url), client(p_url)
    prompt = text_prompt(60, 7500)
    for stream in (False, True):
        one = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, stream=stream
        )
        text = "".join(ch.choices[0].text for ch in one if ch.choices) if stream else None
        want = ref.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
        assert (text if stream else one.choices[0].text) == want.choices[0].text
    first = (
        ref.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"][0]
    )
    stop = {"stop_token_ids": [first]}
    want = ref.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=stop
    )
    assert want.choices[0].finish_reason == "stop"
    got = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=stop
    )
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == want.usage.completion_tokens == 1
    chunks = list(
        c.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body=stop
        )
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    wait_kv_usage_zero(d_url)  # D's request was aborted: its blocks are free
    wait_kv_usage_zero(p_url)  # and P released the KV it held for D


def _fallbacks(proxy_url: str) -> float:
    text = fetch_metrics(proxy_url)
    return metric_sum(
        text, "splitserve_proxy_first_token_fallbacks_total", reason="stop_string_at_seam"
    )


def test_stop_string_across_the_seam_matches_colocated(ss_pair, concurrent_proxy) -> None:
    """A stop string made of the first token's last character and the second token's first:
    a colocated server stops there; so must the proxy (it sees the stop may span P's token and
    D's, and serves the request in the plain flow)."""
    p_url = ss_pair["ss-a"][0]
    c, ref = client(concurrent_proxy.url), client(p_url)
    for seed in range(7700, 7760):
        prompt = text_prompt(30, seed)
        kw = {"model": "tiny", "prompt": prompt, "temperature": 0}
        one = ref.completions.create(max_tokens=1, **kw).choices[0].text
        two = ref.completions.create(max_tokens=2, **kw).choices[0].text
        second = two[len(one) :]
        if one and second and two.startswith(one) and (one[-1] + second[0]) not in one:
            break
    else:
        pytest.fail("no prompt whose first two tokens both have text")
    stop = one[-1] + second[0]
    before = _fallbacks(concurrent_proxy.url)
    for include in (False, True):
        kw = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "stop": [stop],
            "extra_body": {"include_stop_str_in_output": include},
        }
        want = ref.completions.create(**kw)
        assert want.choices[0].finish_reason == "stop", "the colocated server stops at the seam"
        got = c.completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text, repr(stop)
        assert got.choices[0].finish_reason == "stop"
        assert got.choices[0].model_extra.get("stop_reason") == stop
        assert got.usage.model_dump() == want.usage.model_dump()
        chunks = list(c.completions.create(stream=True, **kw))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.choices[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert _fallbacks(concurrent_proxy.url) - before == 4


def test_request_outside_the_first_token_flow_still_matches(ss_pair, concurrent_proxy) -> None:
    """A request with logprobs takes the plain concurrent flow (D samples every token)."""
    p_url = ss_pair["ss-a"][0]
    prompt = text_prompt(40, 7600)
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    want = client(p_url).completions.create(**kw)
    got = client(concurrent_proxy.url).completions.create(**kw)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
