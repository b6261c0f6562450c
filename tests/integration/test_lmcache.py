"""LMCache composition on real servers (issue #19): two prefill servers sharing LMCache's own
cache server as the remote tier, each with vLLM's ``MultiConnector`` of
``SplitserveLMCacheConnector`` (LMCache, with splitserve's CPU shim) and ``SplitserveConnector``
(the handoff to D).

In ``make test`` since 2026-12-05. It was kept out while one run in four hung P1's worker
for about two minutes right after D registered (D then failed the request); the cause was
inductor compiling vLLM's log-prob helper at the first log-prob request (a cold cache), holding
the GIL, in P1 and D pinned to one core, past P1's 20 s lease. CPU servers now run that helper
eagerly (``splitserve.launch.engines.CPU_EAGER_ENV``) and D is not pinned beside P1
(docs/lmcache.md).

The proof that KV came from LMCache and not a silent recompute: vLLM's own counter of tokens a
KV connector supplied (``vllm:external_prefix_cache_hits``) rises on P2 by the shared prefix,
P2's computed tokens (``vllm:request_prefill_kv_computed_tokens``) are only the new suffix, and
D's greedy tokens and log-probs equal a colocated server's (garbage KV would change them).
"""

from __future__ import annotations

import time

import lmcache_fleet
import pytest
from lmcache_fleet import CHUNK
from metrics_text import fetch_metrics, metric_sum
from token_requests import body_for, concurrent_handoff, post, prompt_of, tokens

from splitserve.proxy import dispatch

DOC_TOKENS = 1500
QUESTION_TOKENS = 40

# The tier's log line for each PUT it stored (its debug level, LMCACHE_LOG_LEVEL=DEBUG).
PUT_MARK = "Time to receive data"


@pytest.fixture(scope="module")
def remote_tier(servers, tiny_model):
    """LMCache's own cache server (``lmcache_fleet.start_tier``): (port, process, log path).
    Its debug log counts the chunks put into it."""
    (key,) = lmcache_fleet.start_tier(servers, tiny_model)
    servers.group.wait(120, names=[key], stop_group_on_failure=False)
    tier = servers.group.servers[key]
    try:
        yield tier.port, tier.process, tier.process.log_path
    finally:
        servers.release(key)


@pytest.fixture(scope="module")
def fleet(servers, tiny_model, remote_tier):
    """P1 and P2 (MultiConnector, sharing ``remote_tier``) and D (SplitserveConnector)."""
    keys = lmcache_fleet.start_servers(servers, tiny_model)
    servers.wait_all(*keys)
    urls = {k: servers.group.servers[k].url for k in keys}
    return {**urls, "p2-side": servers.side_port(lmcache_fleet.P2)}


def ids(n: int, seed: int) -> list[int]:
    return prompt_of(n, seed, low=10)


def handoff(p_url: str, d_url: str, prompt: list[int]) -> dict:
    """The sequential flow: P prefills (LMCache may supply a prefix), D decodes from P's KV."""
    body = body_for(prompt)
    transfer_id = dispatch.new_transfer_id()
    p_answer = post(p_url, dispatch.vllm_sequential_prefill_request(body, transfer_id))
    assert p_answer.get("kv_transfer_params"), p_answer
    return post(d_url, dispatch.vllm_sequential_decode_request(body, p_answer, transfer_id))


def counters(url: str) -> dict[str, float]:
    text = fetch_metrics(url)
    return {
        "external_hits": metric_sum(text, "vllm:external_prefix_cache_hits_total"),
        "computed": metric_sum(text, "vllm:request_prefill_kv_computed_tokens_sum"),
        "prompt": metric_sum(text, "vllm:prompt_tokens_total"),
        "handoffs": metric_sum(text, "vllm:splitserve_exposed_handoff_seconds_count"),
        "exposed_s": metric_sum(text, "vllm:splitserve_exposed_handoff_seconds_sum"),
    }


def wait_for_puts(log_path, count: int, bound: float = 120.0) -> None:
    """The tier has stored ``count`` chunks (P1's puts are asynchronous: P2 may only look
    once they landed)."""
    end = time.monotonic() + bound
    while (puts := log_path.read_text(errors="replace").count(PUT_MARK)) < count:
        assert time.monotonic() < end, f"the tier stored {puts} of {count} chunks in {bound} s"
        time.sleep(0.2)


def test_p2_loads_the_shared_prefix_and_d_equals_colocated(fleet, remote_tier) -> None:
    doc = ids(DOC_TOKENS, 1)
    first, second = doc + ids(QUESTION_TOKENS, 2), doc + ids(QUESTION_TOKENS, 3)
    p1, p2, d = fleet["lmc-p1"], fleet["lmc-p2"], fleet["lmc-d"]

    got_first = tokens(handoff(p1, d, first))
    # P1's store reaches the remote tier asynchronously: P2 may only look once it is there
    # (every whole chunk of P1's prompt; the shared ones among them).
    wait_for_puts(remote_tier[2], len(first) // CHUNK)
    before, d_before = counters(p2), counters(d)
    got_second = tokens(concurrent_handoff(p2, fleet["p2-side"], d, second))
    after, d_after = counters(p2), counters(d)
    # D measured this handoff on our layer-wise path (what it waited beyond P2's compute).
    assert d_after["handoffs"] == d_before["handoffs"] + 1
    exposed = d_after["exposed_s"] - d_before["exposed_s"]
    print(f"P2 -> D exposed handoff: {exposed * 1000:.1f} ms")

    shared = DOC_TOKENS // CHUNK * CHUNK  # LMCache keeps whole chunks
    hits = after["external_hits"] - before["external_hits"]
    computed = after["computed"] - before["computed"]
    assert hits == shared, f"P2 loaded {hits} tokens from LMCache, want {shared}"
    assert computed == len(second) - shared, f"P2 computed {computed} of {len(second)} tokens"

    # Colocated references last, on D (a request without kv_transfer_params is local).
    for got, prompt, what in ((got_first, first, "P1"), (got_second, second, "P2")):
        ref_ids, ref_lp = tokens(post(d, body_for(prompt)))
        assert got[0] == ref_ids, f"{what}: tokens {got[0]} != colocated {ref_ids}"
        for a, b in zip(got[1], ref_lp, strict=True):
            assert abs(a - b) < 1e-2, f"{what}: logprobs {got[1]} != colocated {ref_lp}"


def test_remote_tier_killed_requests_still_succeed(fleet, remote_tier) -> None:
    """With LMCache's server gone, P2 recomputes: the request succeeds with D's output equal to
    colocated, and nothing waits on the dead tier beyond the request's own bound."""
    _, tier, _ = remote_tier
    tier.stop()
    p2, d = fleet["lmc-p2"], fleet["lmc-d"]
    prompt = ids(DOC_TOKENS, 4) + ids(QUESTION_TOKENS, 5)
    before = counters(p2)
    got = tokens(handoff(p2, d, prompt))
    after = counters(p2)
    assert after["external_hits"] == before["external_hits"]
    assert after["computed"] - before["computed"] == len(prompt)
    ref_ids, ref_lp = tokens(post(d, body_for(prompt)))
    assert got[0] == ref_ids
    for a, b in zip(got[1], ref_lp, strict=True):
        assert abs(a - b) < 1e-2
