"""SplitserveConnector with tensor parallelism on real vLLM CPU servers (issue #17).

Three servers of one tiny model with 4 KV heads (so TP 1, 2 and 4 divide them), all
``kv_both`` with our connector and the test key, started once for this module:

- ``tp-p`` and ``tp-d``: tensor parallel 2 (vLLM's multiprocessing executor: two worker
  processes each). Rank r binds its side channel on base + r; D's rank r dials P's rank r.
- ``tp-ref``: tensor parallel 1. Without ``kv_transfer_params`` it is a colocated server, the
  reference every disaggregated answer must equal (greedy tokens and logprobs); with them it
  is the other size: P TP 1 -> D TP 2 (``decode_tp_size: 2``: each P rank sends one share per
  D rank it feeds, D rank j dials P rank j // 2; D learns P's size from ``remote_tp_size``,
  which P's answer carries in the sequential flow and the test adds to D's params in the
  concurrent one, as a proxy that knows the pools would), and P TP 2 -> D TP 1 (P's
  params say ``decode_tp_size: 1``: ``tp-p`` also feeds ``tp-d`` of its own size; D rank 0
  loads one share from each P rank, each a sub-run of D's blocks).
- Refused: a size that cannot pair (D told P has TP 3) fails at D's scheduler half at once,
  naming both sizes.

On our 2 cores the five engine processes run unpinned with one OpenMP thread each (two
engines pinned to one core missed the side channel's bounds: docs/connector-protocol.md).
A D waiting for KV steps every millisecond, and with TP 2 every step is a broadcast through
vLLM's shared-memory ring: with vLLM's own 1 s spin after each read, D's engine and both
workers took a core each (py-spy: ``sched_yield``) and starved the P they waited for (rows of
20-40 s, shares expired past a 60 s lease, the module 440 s). Our launcher's CPU servers poll
their rings every 1 ms instead (``SPLITSERVE_VLLM_SHM_SPIN_S=0``,
``splitserve.connectors.vllm.shm_spin``): rows of about 2 s, the module about 150 s.
What vLLM CPU needs for TP 2 here is in docs/connector-protocol.md, "Ranks".

In ``make test``: on our 2 cores it passes with the settings above (``TORCHDYNAMO_DISABLE``,
``peer_liveness_s`` 180: docs/connector-protocol.md, "Ranks"; polled rings: docs/environment.md,
"Scheduling stalls"). The last test kills a rank of
``tp-d``, so it runs last and nothing after it may need ``tp-d``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import token_requests
from cpu_placement import UNPINNED
from metrics_text import fetch_metrics, metric_sum
from session_keys import TEST_KEY
from session_keys import test_key_file as key_file
from token_requests import assert_same, body_for, prompt_of, tokens

from splitserve.models import build_model, resolve_spec
from splitserve.netutil import free_port_run
from splitserve.proxy import dispatch
from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

pytestmark = pytest.mark.integration
logger = logging.getLogger(__name__)

BLOCK = 128
BUDGET = 512  # P's --max-num-batched-tokens: a 1300-token prompt is three chunks
# VLLM_SERVER_DEV_MODE: /reset_prefix_cache, so a reference computed on the D it is compared
# with is not then served from D's own prefix cache instead of loaded (reset_prefix_cache).
# TORCHDYNAMO_DISABLE: with TP > 1 vLLM's embedding calls a torch.compile'd function
# (get_masked_input_and_mask, inductor on CPU) that compiles at a server's first forward: 60-70
# s here, holding the GIL, so the side channel's handshakes time out meanwhile (py-spy;
# docs/connector-protocol.md, "Ranks"). Eager is what every other server here runs.
TP_ENV = {
    **UNPINNED,
    "VLLM_SERVER_DEV_MODE": "1",
    "TORCHDYNAMO_DISABLE": "1",
}
# The five TP processes on 2 cores stall whole seconds at a time (docs/connector-protocol.md,
# "Ranks": 40-68 runnable threads), past the 5 s default; a silent peer is then still
# detected, within this bound. 60 s was passed twice (2026-12-05): every process on the machine,
# the servers' own 10 s stats loggers included, logged nothing for 55-64 s, and D then gave up
# on P's ranks ("lost connection to prefill side"); no test here depends on this bound (the
# rank-kill test is bounded by P's lease and vLLM's executor)
PEER_LIVENESS_S = 180
REQUEST_TIMEOUT = 300.0
# P's hold on a share: DONE waiting for D's PULLED, an early registration waiting for P's request.
# 20 s was passed twice in CI (2026-12-06) while D's spinning ring readers starved P (see the
# module docstring): D's API server, engine and both workers silent for 20-25 s. A lease is a
# tolerance here, not what a test measures; the rank-kill test waits one out.
LEASE_S = 30


def _kv_config(side_port: int, **settings) -> dict:
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "side_channel_port": side_port,
            "auth_key_file": key_file(TEST_KEY),
            "lease_s": LEASE_S,
            "done_timeout_s": 300,
            "peer_liveness_s": PEER_LIVENESS_S,
            **settings,
        },
    }


@pytest.fixture(scope="module")
def tp(servers, tmp_path_factory) -> dict[str, tuple[str, int]]:
    """key -> (url, side channel base port) for ``tp-p``, ``tp-d`` and ``tp-ref``; ``logs``
    -> each key's server log."""
    model = build_model(
        resolve_spec("tiny", num_kv_heads=4), tmp_path_factory.mktemp("models") / "tiny-kv4"
    )
    sizes = {"tp-p": 2, "tp-d": 2, "tp-ref": 1}
    sides: dict[str, int] = {}
    for key, size in sizes.items():
        sides[key] = free_port_run(size)
        servers.vllm(
            key,
            Path(model),
            # tp-ref feeds tp-d as P: one share per D rank (D's size twice its own)
            kv_transfer_config=_kv_config(
                sides[key], **({"decode_tp_size": 2} if key == "tp-ref" else {})
            ),
            extra_args=[
                "--max-model-len",
                "2048",
                "--max-num-batched-tokens",
                str(BUDGET),
                "--tensor-parallel-size",
                str(size),
                "--distributed-executor-backend",
                "mp",
            ],
            env=TP_ENV,
            wait=False,
        )
    servers.wait_all(*sizes)
    out: dict = {"logs": {}}
    for key in sizes:
        server = servers.group.servers[key]
        out["logs"][key] = Path(server.process.log_path)
        out[key] = (server.url, servers.side_port(key))
    return out


# -- helpers ------------------------------------------------------------------------------------


def post(url: str, body: dict, timeout: float = REQUEST_TIMEOUT) -> dict:
    return token_requests.post(url, body, timeout)


def concurrent(
    p, d, prompt, first_token: bool = False, remote_tp_size=None, decode_tp_size=None
) -> dict:
    """The proxy's concurrent flow by its own dispatch functions; with ``first_token`` the
    answer is P's token followed by D's, as the proxy stitches them; ``remote_tp_size`` /
    ``decode_tp_size``: P's size in D's params, D's in P's (what a proxy that knows the pools
    would add)."""
    (p_url, p_side), (d_url, _) = p, d
    prefill, decode = dispatch.vllm_concurrent_requests(
        body_for(prompt), dispatch.new_transfer_id(), "127.0.0.1", p_side, first_token
    )
    if remote_tp_size is not None:
        decode["kv_transfer_params"]["remote_tp_size"] = remote_tp_size
    if decode_tp_size is not None:
        prefill["kv_transfer_params"]["decode_tp_size"] = decode_tp_size
    with ThreadPoolExecutor(2) as pool:
        p_future = pool.submit(post, p_url, prefill)
        d_future = pool.submit(post, d_url, decode)
        p_answer, d_answer = p_future.result(), d_future.result()
    assert "choices" in p_answer, p_answer
    if not first_token or "choices" not in d_answer:
        return d_answer
    head, rest = p_answer["choices"][0], d_answer["choices"][0]
    lp = head["logprobs"]["token_logprobs"] + rest["logprobs"]["token_logprobs"]
    choice = {"token_ids": head["token_ids"] + rest["token_ids"], "logprobs": {}}
    choice["logprobs"]["token_logprobs"] = lp
    return {"choices": [choice]}


def wait_kv_usage_zero(url: str) -> None:
    token_requests.wait_kv_usage_zero(url, bound=3.0 * LEASE_S)


def reset_prefix_cache(url: str) -> None:
    """Empty a server's prefix cache (dev mode), so its next load of a prompt it computed as
    the reference is a real load."""
    request = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, response.status


def failed_loads(url: str) -> float:
    return metric_sum(fetch_metrics(url), "vllm:splitserve_loads_failed_total")


def wait_metric(url: str, name: str, want: float, bound: float = 30.0) -> None:
    """``name`` on ``url`` reaches ``want`` (stats arrive with the engine's next steps)."""
    end = time.monotonic() + bound
    got = None
    while time.monotonic() < end:
        got = metric_sum(fetch_metrics(url), name)
        if got >= want:
            break
        time.sleep(0.5)
    assert got == want, f"{url}: {name} {got} != {want}"


def log_text(tp, key: str) -> str:
    return tp["logs"][key].read_text(errors="replace")


LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 1300]


def assert_rows_equal_colocated(
    tp, p_key: str, d_key: str, seed: int, first_token: bool, reset_d: bool = False, **sizes
) -> None:
    """Every prompt of ``LENGTHS`` from P to D in the concurrent flow equals ``tp-ref``'s
    colocated answer (tokens and logprobs); D counts two loads per request (one per D rank,
    or one per P rank's share when D is narrower), fails none, and both free every block.
    ``reset_d``: D is the reference server itself, so its prefix cache is emptied before each
    load (else it would serve the prompt it just computed instead of loading it)."""
    p, d, what = tp[p_key], tp[d_key], f"{p_key} -> {d_key}"
    loads = "vllm:splitserve_loads_completed_total"
    before, loaded = failed_loads(d[0]), metric_sum(fetch_metrics(d[0]), loads)
    for i, length in enumerate(LENGTHS):
        prompt = prompt_of(length, seed + i)
        want = tokens(post(tp["tp-ref"][0], body_for(prompt)))
        if reset_d:
            reset_prefix_cache(d[0])
        assert_same(concurrent(p, d, prompt, first_token, **sizes), want, f"{what}, {length}")
    # A one-token prompt has nothing to load unless P's first token comes with the KV.
    requests_loaded = len(LENGTHS) - (0 if first_token else 1)
    wait_metric(d[0], loads, loaded + 2 * requests_loaded)
    assert failed_loads(d[0]) == before
    wait_kv_usage_zero(p[0])
    wait_kv_usage_zero(d[0])


def test_every_engine_process_polls_its_rings(tp):
    """The launcher's ``SPLITSERVE_VLLM_SHM_SPIN_S=0`` took effect in each server's engine and
    every worker (each logs it once), through our vLLM plugin: what keeps
    this module's waiting D from starving its P (module docstring)."""
    line = re.compile(r"readers spin 0 s after a read \(SPLITSERVE_VLLM_SHM_SPIN_S; pid (\d+)\)")
    for key, engine_processes in (("tp-p", 3), ("tp-d", 3), ("tp-ref", 2)):
        pids = set(line.findall(log_text(tp, key)))
        assert len(pids) >= engine_processes, f"{key}: the ring setting logged by {pids}"


# -- P TP 2 -> D TP 2 ----------------------------------------------------------------------------


@pytest.mark.parametrize("first_token", [False, True], ids=["concurrent", "first-token"])
def test_tp2_to_tp2_equals_colocated_tp1(tp, first_token):
    """Every rank moves its own heads: a wrong or missing rank shows in tokens and logprobs;
    each load is counted once per rank (two per request), so both ranks transferred."""
    assert_rows_equal_colocated(tp, "tp-p", "tp-d", 9000 + 100 * first_token, first_token)
    text = log_text(tp, "tp-d")
    assert "tensor parallel rank 0 of 2" in text and "tensor parallel rank 1 of 2" in text


def test_sequential_flow_names_the_prefill_tp_size(tp):
    """P's answer carries ``remote_tp_size``; D of the same size registers on both ranks."""
    (p_url, _), (d_url, _), (ref_url, _) = tp["tp-p"], tp["tp-d"], tp["tp-ref"]
    prompt = prompt_of(300, 9300)
    body = body_for(prompt)
    p_answer = post(p_url, dispatch.vllm_sequential_prefill_request(body))
    params = p_answer.get("kv_transfer_params")
    assert params and params["remote_tp_size"] == 2, p_answer
    answer = post(d_url, dispatch.vllm_sequential_decode_request(body, p_answer))
    assert_same(answer, tokens(post(ref_url, body)), "sequential")


def test_through_the_proxy_both_concurrent_flows(tp):
    (p_url, p_side), (d_url, _), (ref_url, _) = tp["tp-p"], tp["tp-d"], tp["tp-ref"]
    for first in (False, True):
        config = build_config(
            {
                "port": 0,
                "flow": "concurrent",
                "first_token_from_prefill": first,
                "prefill": [{"url": p_url, "side_channel_port": p_side}],
                "decode": [{"url": d_url}],
            }
        )
        with BackgroundProxy(config) as proxy:
            for i, length in enumerate([129, 1300]):
                prompt = prompt_of(length, 9400 + 10 * first + i)
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
                want = post(ref_url, body)["choices"][0]["text"]
                got = post(proxy.url, body)
                assert got["choices"][0]["text"] == want, f"first_token={first}, {length}"
    wait_kv_usage_zero(p_url)
    wait_kv_usage_zero(d_url)


# -- P TP 1 -> D TP 2 (D wider) --------------------------------------------------------------------


@pytest.mark.parametrize("first_token", [False, True], ids=["concurrent", "first-token"])
def test_tp1_to_tp2_equals_colocated_tp1(tp, first_token):
    """Each D rank gets its two of P's four heads (a sub-run of P's blocks): a wrong slice
    shows in tokens and logprobs; each load counts once per D rank; P frees every share."""
    seed = 9700 + 100 * first_token
    assert_rows_equal_colocated(tp, "tp-ref", "tp-d", seed, first_token, remote_tp_size=1)


def test_tp1_to_tp2_sequential_flow(tp):
    """P TP 1's answer says its size; both D ranks load from P's rank 0."""
    (p_url, _), (d_url, _) = tp["tp-ref"], tp["tp-d"]
    body = body_for(prompt_of(300, 9900))
    want = tokens(post(p_url, body))
    p_answer = post(p_url, dispatch.vllm_sequential_prefill_request(body))
    assert p_answer["kv_transfer_params"]["remote_tp_size"] == 1, p_answer
    answer = post(d_url, dispatch.vllm_sequential_decode_request(body, p_answer))
    assert_same(answer, want, "P TP 1 -> D TP 2, sequential")
    wait_kv_usage_zero(p_url)


# -- P TP 2 -> D TP 1 (P wider) -------------------------------------------------------------------


@pytest.mark.parametrize("first_token", [False, True], ids=["concurrent", "first-token"])
def test_tp2_to_tp1_equals_colocated_tp1(tp, first_token):
    """D's one rank loads two shares, one from each P rank (its heads 0-1 and 2-3, each a
    sub-run of D's blocks): a missing share shows in tokens and logprobs; P frees on both."""
    seed = 10100 + 100 * first_token
    assert_rows_equal_colocated(
        tp, "tp-p", "tp-ref", seed, first_token, reset_d=True, remote_tp_size=2, decode_tp_size=1
    )


def test_tp2_to_tp1_sequential_flow(tp):
    """P TP 2's answer says its size; D TP 1 registers one share with each P rank."""
    (p_url, _), (d_url, _) = tp["tp-p"], tp["tp-ref"]
    body = body_for(prompt_of(300, 10300))
    want = tokens(post(d_url, body))
    reset_prefix_cache(d_url)  # D computed the reference: load it, not hit it
    prefill = dispatch.vllm_sequential_prefill_request(body)
    prefill["kv_transfer_params"]["decode_tp_size"] = 1
    p_answer = post(p_url, prefill)
    assert p_answer["kv_transfer_params"]["remote_tp_size"] == 2, p_answer
    answer = post(d_url, dispatch.vllm_sequential_decode_request(body, p_answer))
    assert_same(answer, want, "P TP 2 -> D TP 1, sequential")
    wait_kv_usage_zero(p_url)


# -- refusals ------------------------------------------------------------------------------------


def test_a_size_that_cannot_pair_fails_the_request_naming_both_sizes(tp):
    """D TP 2 told that P has TP 3 (neither a multiple of the other) fails the request at once
    at its scheduler half (an error, never a hang or a local answer); P frees after its lease."""
    (p_url, _), (d_url, _) = tp["tp-p"], tp["tp-d"]
    start = time.monotonic()
    answer = concurrent(tp["tp-p"], tp["tp-d"], prompt_of(200, 9500), remote_tp_size=3)
    assert "choices" not in answer, answer
    assert time.monotonic() - start < 60
    text = log_text(tp, "tp-d")
    assert "prefill tensor parallel size 3, decode tensor parallel size 2" in text
    wait_kv_usage_zero(d_url)
    wait_kv_usage_zero(p_url)


# -- a D rank killed mid-transfer (last: it ends tp-d) -------------------------------------------


def rank_process(server_pid: int, rank: int) -> psutil.Process:
    """The server's TP worker of ``rank`` (vLLM titles it ``VLLM::Worker_TP<rank>``)."""
    title = f"Worker_TP{rank}"
    for proc in psutil.Process(server_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(title in part for part in proc.cmdline()):
                return proc
    raise AssertionError(f"no process titled {title} under server pid {server_pid}")


# D's first registration waits at most P's lease for P's request: seeing D hold the request
# (its /metrics) can take longer than that here, when D's idle engine spins both cores while it
# waits (docs/environment.md, "Scheduling stalls"). D then fails the request ("unknown transfer
# id") before the kill: that attempt proves nothing, and a fresh request is sent.
HOLD_ATTEMPTS = 3


def hold_on_d(d_url: str, decode: dict, pool: ThreadPoolExecutor) -> Future | None:
    """Send ``decode`` to D and return its future once D's scheduler holds the request (waiting
    for its KV, registered on P's ranks); None if D ended the request first."""
    d_future = pool.submit(post, d_url, decode)
    end = time.monotonic() + 120
    while not d_future.done():
        if metric_sum(fetch_metrics(d_url), "vllm:num_requests_waiting") >= 1:
            return d_future
        assert time.monotonic() < end, "D never held the request"
        time.sleep(0.05)
    logger.warning("D ended the request before it was seen held: %s", d_future.result())
    return None


def test_a_d_rank_killed_mid_transfer_fails_the_request_and_p_frees_every_rank(tp, servers):
    """D TP 2's rank 1 is killed as P TP 2 starts a four-chunk prompt for it: D's request
    fails as a whole (vLLM's executor ends the server with its rank; the client gets an
    error, never tokens), P's answer is unharmed, P frees the request's blocks on both ranks
    (vLLM frees them only when every rank has finished sending: KV usage back to 0), the P rank
    whose share was for the killed rank logs it failed or expired, and P then serves P TP 2 ->
    D TP 1 right."""
    (p_url, p_side), (d_url, _) = tp["tp-p"], tp["tp-d"]
    victim = rank_process(servers.group.servers["tp-d"].process.pid, 1)
    with ThreadPoolExecutor(2) as pool:
        for attempt in range(HOLD_ATTEMPTS):
            transfer_id = dispatch.new_transfer_id()
            # 40 tokens: D decodes long after its KV is in, so no answer can beat the kill; a
            # prompt of its own per attempt (a failed load's blocks are never a prefix hit)
            body = body_for(prompt_of(2000, 10500 + attempt), max_tokens=40)
            prefill, decode = dispatch.vllm_concurrent_requests(
                body, transfer_id, "127.0.0.1", p_side
            )
            d_future = hold_on_d(d_url, decode, pool)
            if d_future is not None:
                break
        else:
            pytest.fail(f"D never held a request for P's lease in {HOLD_ATTEMPTS} attempts")
        # The kill follows P's request at once: D's executor ends the server within a second
        # or so, while P's ranks compute and send their shares (rank 0's may land, rank 1's
        # cannot); however that interleaves, no share may complete D's request
        p_future = pool.submit(post, p_url, prefill)
        victim.kill()
        d_answer, p_answer = d_future.result(), p_future.result()
    assert "choices" not in d_answer, f"D answered without its rank 1: {d_answer}"
    assert "choices" in p_answer, p_answer
    wait_kv_usage_zero(p_url)
    shares = [
        line
        for line in log_text(tp, "tp-p").splitlines()
        if transfer_id in line and ("-> failed" in line or "-> expired" in line)
    ]
    # P rank 1's share was for the killed D rank 1: it cannot have been read. P rank 0's share
    # may have been (D rank 0 read it before its server went down) or not: either way P freed
    # it, as the KV usage above says.
    assert any("Worker_TP1" in line for line in shares), (
        f"P rank 1 logged no failed share of {transfer_id}: {shares}"
    )
    body = body_for(prompt_of(300, 10600))
    want = tokens(post(tp["tp-ref"][0], body))
    reset_prefix_cache(tp["tp-ref"][0])
    answer = concurrent(
        tp["tp-p"], tp["tp-ref"], body["prompt"], remote_tp_size=2, decode_tp_size=1
    )
    assert_same(answer, want, "P TP 2 -> D TP 1 after D TP 2's rank died")
