"""Token-level requests to vLLM servers, for the connector modules that compare a
disaggregated answer with a colocated one token by token and logprob by logprob.

Shared by ``test_connector_vllm.py``, ``test_tensor_parallel.py`` and ``test_lmcache.py``:
prompts are token ids (no tokenizer in the way), greedy, with ``return_token_ids`` and one
logprob per token, so a wrong KV that happens to pick the same tokens still shows.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from metrics_text import fetch_metrics, metric_sum

from splitserve.proxy import dispatch

MAX_TOKENS = 6
LOGPROB_TOLERANCE = 1e-2


def post(
    url: str,
    body: dict,
    timeout: float = 300.0,
    on_server_error: Callable[[str], dict] | None = None,
) -> dict:
    """The server's answer; an HTTP error or a dropped connection (a server that died with
    the request) as a dict without ``choices``. ``on_server_error(url)``: more to say about a
    5xx (e.g. what the server logged), merged into the answer."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        answer = {"http_error": exc.code, "body": exc.read().decode(errors="replace")}
        if exc.code >= 500 and on_server_error is not None:
            answer |= on_server_error(url)
        return answer
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:
        return {"connection_error": repr(exc)}


def body_for(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }


def prompt_of(length: int, seed: int, low: int = 5) -> list[int]:
    """``length`` random token ids from ``seed`` (fresh per test: no prefix-cache hits)."""
    rng = random.Random(seed)
    return [rng.randrange(low, 1000) for _ in range(length)]


def tokens(answer: dict) -> tuple[list[int], list[float]]:
    assert "choices" in answer, f"no completion: {answer}"
    choice = answer["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_same(answer: dict, ref: tuple[list[int], list[float]], what: str) -> None:
    """Tokens equal and logprobs within ``LOGPROB_TOLERANCE`` of the colocated reference:
    greedy tokens of a random model repeat a lot, logprobs catch a wrong KV that happens to
    pick the same tokens."""
    got_ids, got_lp = tokens(answer)
    ref_ids, ref_lp = ref
    assert got_ids == ref_ids, f"{what}: tokens {got_ids} != colocated {ref_ids}"
    for got, want in zip(got_lp, ref_lp, strict=True):
        assert abs(got - want) < LOGPROB_TOLERANCE, (
            f"{what}: logprobs {got_lp} != colocated {ref_lp}"
        )


def wait_kv_usage_zero(url: str, bound: float = 60.0) -> None:
    """``url``'s KV cache usage returns to 0 within ``bound`` s (else: a leak)."""
    end = time.monotonic() + bound
    usage = None
    while time.monotonic() < end:
        usage = metric_sum(fetch_metrics(url), "vllm:kv_cache_usage_perc")
        if usage == 0.0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{url}: KV cache usage {usage} did not return to 0 (leak)")


def concurrent_handoff(
    p_url: str,
    p_side: int,
    d_url: str,
    prompt: list[int],
    send: Callable[[str, dict], dict] = post,
) -> dict:
    """The proxy's concurrent flow by its own dispatch functions: P and D at once, D registers
    while P computes (layer-wise); D's answer (P's must have succeeded). ``send``: how to post
    (e.g. with the server's log on a 5xx)."""
    prefill, decode = dispatch.vllm_concurrent_requests(
        body_for(prompt), dispatch.new_transfer_id(), "127.0.0.1", p_side
    )
    with ThreadPoolExecutor(2) as pool:
        p_answer = pool.submit(send, p_url, prefill)
        d_answer = pool.submit(send, d_url, decode)
        assert "choices" in p_answer.result(), p_answer.result()
        return d_answer.result()
