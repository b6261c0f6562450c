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

The last test puts the adaptive budget where it belongs, on D: a third server of the pair
(``ss-c``, tests/integration/conftest.py; test_discovery and test_prefill_allowlist use it next)
runs ``AdaptiveChunkScheduler`` with an unreachable target, and D's own ``/metrics`` show its
budget at the minimum while a local prefill meets running decodes and at the maximum once they
ended.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from metrics_text import fetch_metrics, metric_sum, samples

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


# ------------------------------------------------ the adaptive budget on D, under local prefill

# The budget's bounds on that D: the pair's --max-num-batched-tokens, and ss-c's minimum.
MIN_CHUNK, MAX_CHUNK = 128, 512
HEAD_TOKENS, TAIL_TOKENS = 896, 640  # a follow-up: 7 of its 12 blocks held on D, the rest local
# Short prompts decoding on D while the follow-up arrives; they are cut by their client once it
# is served, so their length only has to outlast the follow-up, by a wide margin: this D takes
# the model's whole context (4096), so a stream runs ~4,000 decode steps, against the
# follow-up's few chunked steps. The colocated reference (ss-a, 2048) checks what fits there.
STREAMS, STREAM_TOKENS = 3, 4000
ADAPTIVE_D_MAX_LEN = 4096  # the tiny model's max_position_embeddings
REFERENCE_MAX_LEN = 2048  # ss-a's --max-model-len (the pair's extra_args)
BUDGET = "splitserve_scheduler_prefill_budget_tokens"
DECISIONS = "splitserve_scheduler_budget_decisions_total"
CHOSEN = "splitserve_scheduler_prefill_budget_chosen_tokens_bucket"


@pytest.fixture(scope="module")
def adaptive_decode(ss_third) -> str:
    """A third server of the pair, a D running the adaptive scheduler as ``splitserve up``
    deploys D (``ss-c``, tests/integration/conftest.py: shared with the next two modules) with
    an unreachable ITL target, so its budget is exactly ``MAX_CHUNK`` on a step without decodes
    and ``MIN_CHUNK`` on a step with decodes, and its own ``/metrics`` show it."""
    assert (ss_third.min_chunk, ss_third.max_model_len) == (MIN_CHUNK, ADAPTIVE_D_MAX_LEN)
    return ss_third.url


@pytest.fixture(scope="module")
def adaptive_proxy(ss_pair, adaptive_decode, tiny_model) -> Iterator[BackgroundProxy]:
    (p_url, p_side) = ss_pair["ss-a"]
    config = build_config(
        {
            "port": 0,
            "flow": "concurrent",
            "prefill": [{"url": p_url, "side_channel_port": p_side}],
            "decode": [{"url": adaptive_decode}],
            "decide": {
                "tokenizer": str(tiny_model),
                "threshold_tokens": THRESHOLD,
                "block_tokens": 128,
                "prefix_share": 0.5,  # a follow-up whose head is over half its prompt stays on D
            },
        }
    )
    with BackgroundProxy(config) as running:
        yield running


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(5, 1000) for _ in range(n)]


@dataclass(frozen=True)
class BudgetView:
    """The adaptive budget as D's ``/metrics`` shows it at one moment."""

    budget: float  # chosen for the latest step
    decisions: dict[str, float]  # steps so far, by reason
    chosen: dict[str, float]  # budgets chosen so far, cumulative by bucket bound ("le")

    def since(self, earlier: BudgetView) -> tuple[dict[str, float], dict[str, float]]:
        """Decisions by reason and budgets chosen by bucket, between ``earlier`` and this."""
        reasons = {r: v - earlier.decisions.get(r, 0.0) for r, v in self.decisions.items()}
        chosen = {le: v - earlier.chosen.get(le, 0.0) for le, v in self.chosen.items()}
        return reasons, chosen


async def budget_view(session: aiohttp.ClientSession, url: str) -> BudgetView:
    async with session.get(url + "/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    (budget,) = samples(text, BUDGET)
    return BudgetView(
        budget.value,
        {s.labels["reason"]: s.value for s in samples(text, DECISIONS)},
        {s.labels["le"]: s.value for s in samples(text, CHOSEN)},
    )


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        return (await response.json())["choices"][0]["text"]


async def complete_ids(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(ignore_eos=True, return_token_ids=True)
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        return (await response.json())["choices"][0]["token_ids"]


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    decoding: asyncio.Event,
    cut: asyncio.Event,
) -> list[int]:
    """A streamed completion's token ids; ``decoding`` is set once its first token arrived. Its
    client disconnects once ``cut`` is set (the proxy then aborts it on D)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0}
    body.update(ignore_eos=True, stream=True, return_token_ids=True)
    tokens: list[int] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: ") :])["choices"]:
                    tokens += choice.get("token_ids") or []
                decoding.set()
            if cut.is_set():
                response.close()
                break
    return tokens


def _ending(task: asyncio.Task) -> str:
    """How a finished stream ended: its error, or how many tokens it got (it ran out)."""
    if task.cancelled():
        return "cancelled"
    if task.exception() is not None:
        return repr(task.exception())[:300]
    return f"finished after {len(task.result())} tokens"


async def wait_idle(session: aiohttp.ClientSession, url: str) -> None:
    """Until D runs and queues no request (bounded)."""
    for _ in range(600):
        async with session.get(url + "/metrics") as response:
            text = await response.text()
        if (
            metric_sum(text, "vllm:num_requests_running")
            + metric_sum(text, "vllm:num_requests_waiting")
            == 0
        ):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("D still has requests 120 s after its streams were cut")


async def budget_scenario(proxy: str, d_url: str, ref_url: str) -> None:
    heads = [token_prompt(HEAD_TOKENS, 8500 + i) for i in range(2)]
    follow_ups = [h + token_prompt(TAIL_TOKENS, 8510 + i) for i, h in enumerate(heads)]
    shorts = [token_prompt(32 + 4 * i, 8520 + i) for i in range(STREAMS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        # Two earlier turns, disaggregated: D receives their KV and the proxy records it there.
        got_heads = [await complete(session, proxy, h, 4) for h in heads]

        # While decodes run: short prompts go straight to D and decode there; a follow-up whose
        # head D holds arrives and D prefills its tail locally, chunk by chunk.
        events, cut = [asyncio.Event() for _ in shorts], asyncio.Event()
        streams = [
            asyncio.create_task(stream(session, proxy, p, e, cut))
            for p, e in zip(shorts, events, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=300)
        ended = [_ending(s) for s in streams if s.done()]
        assert not ended, f"a stream ended before the follow-up came: {ended}"
        decoding = await budget_view(session, d_url)
        got_during = await complete(session, proxy, follow_ups[0], 8)
        after_follow_up = await budget_view(session, d_url)
        ended = [_ending(s) for s in streams if s.done()]
        assert not ended, f"a stream ended before the follow-up did: {ended}"
        cut.set()
        got_streams = await asyncio.gather(*streams)
        await wait_idle(session, d_url)

        # After the decodes ended: the same kind of follow-up on a D with no decodes.
        idle = await budget_view(session, d_url)
        got_idle = await complete(session, proxy, follow_ups[1], 1)
        after_idle = await budget_view(session, d_url)

        want = [await complete(session, ref_url, h, 4) for h in heads]
        # what of each stream fits the reference's context (usually all of it: a stream is cut
        # after a few hundred tokens)
        room = [REFERENCE_MAX_LEN - len(p) - 1 for p in shorts]
        got_streams = [t[:n] for n, t in zip(room, got_streams, strict=True)]
        want_streams = await asyncio.gather(
            *(
                complete_ids(session, ref_url, p, len(t))
                for p, t in zip(shorts, got_streams, strict=True)
            )
        )
        want_during = await complete(session, ref_url, follow_ups[0], 8)
        want_idle = await complete(session, ref_url, follow_ups[1], 1)

    assert got_heads == want and got_streams == want_streams
    assert (got_during, got_idle) == (want_during, want_idle)

    # Every step while the streams decoded (the follow-up's chunks included) had decodes: the
    # budget fell to its minimum and stayed there.
    reasons, chosen = after_follow_up.since(decoding)
    assert after_follow_up.budget == MIN_CHUNK, after_follow_up
    assert reasons.get("no_decodes", 0) == 0, reasons
    assert reasons.get("min_chunk", 0) >= TAIL_TOKENS // MIN_CHUNK, reasons
    assert chosen[f"{float(MIN_CHUNK)}"] == chosen["+Inf"] > 0, chosen
    # With the decodes over, the next local prefill's steps got the whole budget again. (The
    # gauge is usually back at the maximum before it: vLLM runs one empty step after the last
    # request finished, to tell its workers, and that step has no decodes either.)
    reasons, chosen = after_idle.since(idle)
    assert after_idle.budget == MAX_CHUNK, after_idle
    assert reasons.get("no_decodes", 0) >= 1 and reasons.get("min_chunk", 0) == 0, reasons
    assert chosen[f"{float(MAX_CHUNK // 2)}"] == 0 < chosen[f"{float(MAX_CHUNK)}"], chosen


def test_budget_on_decode_falls_while_it_decodes_and_rises_after(
    ss_pair, adaptive_decode, adaptive_proxy
) -> None:
    """Issue #18: with the adaptive budget on D, a long local prefill (a follow-up whose head D
    holds) arriving while D decodes is chunked at the minimum; once the decodes end the budget
    is back at the maximum. Answers equal colocated (ss-a served directly)."""
    before = counts(adaptive_proxy)
    asyncio.run(budget_scenario(adaptive_proxy.url, adaptive_decode, ss_pair["ss-a"][0]))
    after = counts(adaptive_proxy)
    assert after["long"] - before["long"] == 2  # the two heads, through P
    assert after["prefill_calls"] - before["prefill_calls"] == 2
    assert after["short"] - before["short"] == STREAMS
    assert after["prefix_on_decode"] - before["prefix_on_decode"] == 2  # the follow-ups, on D
    assert after["error"] == 0
