"""One request per contender flow, timed at the client, with server figures read around it.

Each function returns one row's figures (the entry script's docstring defines them): a server
figure is the difference of the server's ``/metrics`` before and after the request.
"""

from __future__ import annotations

import time

from common.metrics import histogram, histogram_in, metrics_text, sample_sum

from handoffbench.client import post_json, token_times
from splitserve.proxy import dispatch

# Connector stats ride on the engines' step outputs to the API server: a pause after a request
# before reading them lets the last step's arrive.
STATS_SETTLE_S = 0.5
EXPOSED = "vllm:splitserve_exposed_handoff_seconds"
# D's "prefill time" (scheduled, i.e. KV loaded, to its first token): the one step D runs
# before its first token (first-token flow: the step that samples token 2).
D_STEP = "vllm:request_prefill_time_seconds"
# Time inside transfer posts (push, P's WRITEs: over cma the copy itself, on P's core; pull,
# P's ANNOUNCE sends and D's READs).
POSTS = "vllm:splitserve_post_seconds_total"
# D's loads completed on P's relayed FIRST_TOKEN instead of its DONE (pull, first token).
EARLY = "vllm:splitserve_loads_completed_on_first_token_total"
FALLBACKS = "splitserve_proxy_first_token_fallbacks_total"
PROXY_PREFILL = "splitserve_proxy_prefill_seconds"


def run_colocated(pair: dict, body: dict) -> dict:
    """A plain request to P. ``step_s``: the server's own mean decode step for this request
    (its decode time over its two decode steps), the figure a first-token flow's ``d_step_s``
    compares with."""
    decode = "vllm:request_decode_time_seconds"
    before = histogram(pair["p"], decode)
    start = time.perf_counter()
    first, second = token_times(pair["p"], body)
    after = histogram(pair["p"], decode)
    return {"ttft_s": first - start, "gap_s": second - first, "step_s": (after[0] - before[0]) / 2}


def run_proxied(pair: dict, body: dict, proxy_url: str) -> dict:
    """Through the splitserve proxy (concurrent flow), as a client sees it. ``after_p_s``: the
    client's TTFT minus P's answer time as the proxy measured it (its
    ``splitserve_proxy_prefill_seconds``): what the client waits beyond P's prefill, a figure
    that a slow or noisy prefill does not blur."""
    d_text, post_before = metrics_text(pair["d"]), sample_sum(metrics_text(pair["p"]), POSTS)
    before, d_before = histogram_in(d_text, EXPOSED), histogram_in(d_text, D_STEP)
    d_post_before, early_before = sample_sum(d_text, POSTS), sample_sum(d_text, EARLY)
    proxy_text = metrics_text(proxy_url)
    p_before = histogram_in(proxy_text, PROXY_PREFILL)
    fallbacks_before = sample_sum(proxy_text, FALLBACKS)
    start = time.perf_counter()
    first, second = token_times(proxy_url, body)
    proxy_text = metrics_text(proxy_url)
    p_after = histogram_in(proxy_text, PROXY_PREFILL)
    time.sleep(STATS_SETTLE_S)
    d_text = metrics_text(pair["d"])
    after, d_after = histogram_in(d_text, EXPOSED), histogram_in(d_text, D_STEP)
    p_post = sample_sum(metrics_text(pair["p"]), POSTS) - post_before
    d_post = sample_sum(d_text, POSTS) - d_post_before
    exposed = (after[0] - before[0]) / max(after[1] - before[1], 1)
    prefill = p_after[0] - p_before[0]
    return {
        "ttft_s": first - start,
        "gap_s": second - first,
        "after_p_s": first - start - prefill,
        "exposed_s": exposed,
        "d_step_s": d_after[0] - d_before[0],
        "p_post_s": p_post,
        "d_post_s": d_post,
        "on_first_token": sample_sum(d_text, EARLY) - early_before,
        "plain_fallback": sample_sum(proxy_text, FALLBACKS) - fallbacks_before,
    }


def run_sequential(pair: dict, body: dict, ours: bool) -> dict:
    """The stock sequential flow from the client: P (one token), then D with P's
    ``kv_transfer_params``. ``ours``: the pair runs our connector (its exposed handoff too)."""
    before = histogram(pair["d"], EXPOSED) if ours else None
    start = time.perf_counter()
    transfer_id = dispatch.new_transfer_id()  # also the request id on P and D (NixlPush)
    p_body = dispatch.vllm_sequential_prefill_request(body, transfer_id)
    p_answer, p_done = post_json(pair["p"], p_body)
    d_body = dispatch.vllm_sequential_decode_request(body, p_answer, transfer_id)
    first, second = token_times(pair["d"], d_body)
    out = {"ttft_s": first - start, "gap_s": second - first, "handoff_s": first - p_done}
    if ours:
        after = histogram(pair["d"], EXPOSED)
        out["exposed_s"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return out
