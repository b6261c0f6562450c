"""SplitserveConnector between two real vLLM CPU servers: greedy tokens equal a colocated run.

Two servers, both ``kv_both`` with our connector and an auth key, one core each. Either can be
P or D; a request without ``kv_transfer_params`` makes a server an ordinary colocated server,
computing with its own KV, and that is the reference. Requests are dispatched through
``splitserve.proxy.dispatch`` (the proxy's own functions), in both flows.

Block size on CPU is 128; P's token budget is 512 tokens per step, so a 1300-token prompt is
prefilled in three chunks and streamed chunk by chunk.

Direction: on host memory over UCX ``cma`` (this machine) the pair pulls (P announces, D
reads); ``test_push_prefill_server`` covers the push path with a third server whose connector
sets ``"direction": "push"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import token_requests
import zmq
from cpu_placement import UNPINNED
from metrics_text import fetch_metrics, metric_sum
from server_logs import warnings_of
from token_requests import MAX_TOKENS, assert_same, body_for, prompt_of, tokens, wait_kv_usage_zero

from splitserve.netutil import free_ports
from splitserve.proxy import dispatch
from splitserve.transfer import messages

pytestmark = pytest.mark.integration

BLOCK = 128


@pytest.fixture(scope="module")
def pair(ss_pair):
    """The two connector servers (tests/integration/conftest.py, shared with the proxy tests)."""
    return ss_pair


# -- HTTP helpers --------------------------------------------------------------------------------


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    # CI shows a failure's one line: a 5xx says what the server logged
    return token_requests.post(url, body, timeout, lambda u: {"server_log": warnings_of(u)})


def reference(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    return tokens(post(url, body_for(prompt)))


def concurrent_flow(p, d, prompt) -> dict:
    (p_url, p_side), (d_url, _) = p, d
    return token_requests.concurrent_handoff(p_url, p_side, d_url, prompt, post)


def first_token_flow(p, d, prompt) -> dict:
    """The concurrent flow with ``first_token_from_prefill``: D continues from P's token. The
    answer is P's first token followed by D's (what the proxy stitches), as one answer."""
    (p_url, p_side), (d_url, _) = p, d
    prefill, decode = dispatch.vllm_concurrent_requests(
        body_for(prompt), dispatch.new_transfer_id(), "127.0.0.1", p_side, True
    )
    with ThreadPoolExecutor(2) as pool:
        p_future = pool.submit(post, p_url, prefill)
        d_future = pool.submit(post, d_url, decode)
        p_answer, d_answer = p_future.result(), d_future.result()
    assert "choices" in p_answer, p_answer
    if "choices" not in d_answer:
        return d_answer
    first, rest = p_answer["choices"][0], d_answer["choices"][0]
    assert len(first["token_ids"]) == 1 and len(rest["token_ids"]) == MAX_TOKENS - 1
    lp = first["logprobs"]["token_logprobs"] + rest["logprobs"]["token_logprobs"]
    choice = {"token_ids": first["token_ids"] + rest["token_ids"], "logprobs": {}}
    choice["logprobs"]["token_logprobs"] = lp
    return {"choices": [choice]}


def sequential_flow(p, d, prompt) -> dict:
    (p_url, _), (d_url, _) = p, d
    body = body_for(prompt)
    p_answer = post(p_url, dispatch.vllm_sequential_prefill_request(body))
    assert p_answer.get("kv_transfer_params"), p_answer
    return post(d_url, dispatch.vllm_sequential_decode_request(body, p_answer))


FLOWS = {
    "concurrent": concurrent_flow,
    "first-token": first_token_flow,
    "sequential": sequential_flow,
}


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples on ``url``'s ``/metrics`` (every label set)."""
    return metric_sum(fetch_metrics(url), name)


def wait_metric_at_least(url: str, name: str, want: float, bound: float = 30.0) -> None:
    """``name`` on ``url`` reaches ``want`` within ``bound`` s. A connector's counters reach
    ``/metrics`` with the engine's next step, so a count raised between steps (a side-channel
    refusal) shows only once more work has run: call this after some."""
    end = time.monotonic() + bound
    got = metric(url, name)
    while got < want:
        assert time.monotonic() < end, f"{url}: {name} {got} did not reach {want}"
        time.sleep(0.5)
        got = metric(url, name)


def roles(pair, flow: str):
    """P and D: a -> b for the concurrent flows, b -> a for the sequential one."""
    a, b = pair["ss-a"], pair["ss-b"]
    return (b, a) if flow == "sequential" else (a, b)


SEEDS = {"concurrent": 0, "first-token": 5000, "sequential": 100}


# -- correctness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flow", FLOWS)
def test_prompt_lengths(pair, flow):
    """1, block-1, block, block+1 and a prompt longer than P's token budget (chunked on P)."""
    p, d = roles(pair, flow)
    seed = 100 + SEEDS[flow]
    for i, length in enumerate([1, BLOCK - 1, BLOCK, BLOCK + 1, 1300]):
        prompt = prompt_of(length, seed + i)
        answer = FLOWS[flow](p, d, prompt)
        assert_same(answer, reference(p[0], prompt), f"{flow}, {length} tokens")


@pytest.mark.parametrize("flow", ["first-token", "sequential"])
def test_eight_concurrent_requests(pair, flow):
    p, d = roles(pair, flow)
    seed = 300 + SEEDS[flow]
    lengths = [5, 60, 127, 128, 129, 250, 400, 700]
    prompts = [prompt_of(n, seed + i) for i, n in enumerate(lengths)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: FLOWS[flow](p, d, prompt), prompts))
    for prompt, answer in zip(prompts, answers, strict=True):
        assert_same(answer, reference(p[0], prompt), f"{flow}, {len(prompt)} tokens, 8 at once")


@pytest.mark.parametrize("flow", ["first-token", "sequential"])
def test_prefix_cache_hits(pair, flow):
    """Same prompt twice (P hit, then D hit too); P alone holds it; D holds a prefix."""
    p, d = roles(pair, flow)
    seed = 500 + SEEDS[flow]
    twice = prompt_of(400, seed)
    for round_ in range(2):
        assert_same(FLOWS[flow](p, d, twice), reference(p[0], twice), f"{flow}, round {round_}")
    p_holds = prompt_of(300, seed + 1)
    reference(p[0], p_holds)  # now cached on P only: P sends blocks it did not recompute
    assert_same(FLOWS[flow](p, d, p_holds), reference(p[0], p_holds), f"{flow}, P prefix hit")
    prefix = prompt_of(2 * BLOCK + 20, seed + 2)
    reference(d[0], prefix)  # D holds the first two blocks: it registers only the rest
    full = prefix + prompt_of(200, seed + 3)
    assert_same(FLOWS[flow](p, d, full), reference(p[0], full), f"{flow}, D prefix hit")


# -- bad input and failures ----------------------------------------------------------------------


def test_malformed_kv_transfer_params_are_served_locally(pair):
    (a_url, _), (b_url, _) = pair["ss-a"], pair["ss-b"]
    prompt = prompt_of(150, 700)
    ref = reference(a_url, prompt)
    bad_d = dict(
        body_for(prompt), kv_transfer_params={"do_remote_prefill": True, "remote_port": "x"}
    )
    assert_same(post(b_url, bad_d), ref, "malformed D params")
    bad_p = dict(body_for(prompt), kv_transfer_params={"do_remote_decode": True, "transfer_id": 7})
    answer = post(b_url, bad_p)
    assert_same(answer, ref, "malformed P params")
    assert not answer.get("kv_transfer_params")


def test_forged_and_unannounced_registrations_are_refused(pair):
    """A peer without the key cannot even open a session (its REGISTER never reaches the
    decoder, the refusal is counted); a keyed one without HELLO gets an ABORT."""
    from splitserve.transfer.auth import CurveKeys

    a_url, a_side = pair["ss-a"]
    before = metric(a_url, "vllm:splitserve_messages_rejected_total")
    ctx = zmq.Context()
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    forger.connect(f"tcp://127.0.0.1:{a_side}")
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    CurveKeys.derive(pair.auth_key.encode()).apply_client(sock)
    sock.connect(f"tcp://127.0.0.1:{a_side}")
    try:
        reg = messages.Register(
            transfer_id="forged", agent_name="mallory", block_ids=[[0, 1, 2]], token_offset=0
        )
        # The handshake may be refused (plain client, CurveZMQ server) before this send: libzmq
        # then drops the DEALER's only pipe and a non-blocking send has no peer (zmq.Again, seen
        # once in CI under load). The frame never leaving is the point; the refusal is counted
        # either way (checked at the end).
        with contextlib.suppress(zmq.Again):
            forger.send(messages.encode(reg, b"wrong-key"), zmq.NOBLOCK)
        signed = messages.Register(
            transfer_id="unannounced", agent_name="mallory", block_ids=[[0]], token_offset=0
        )
        sock.send(messages.encode(signed, pair.auth_key.encode()))
        # An idle engine does not step; the worker reads its side channel when it does. Serve a
        # request (and check it is right) so that it steps.
        prompt = prompt_of(200, 800)
        answer = concurrent_flow(pair["ss-a"], pair["ss-b"], prompt)
        assert_same(answer, reference(a_url, prompt), "next to forged messages")
        assert sock.poll(90_000), "no answer to a signed registration without HELLO"
        answer = messages.decode(sock.recv(), pair.auth_key.encode())
        assert isinstance(answer, messages.Abort) and answer.transfer_id == "unannounced"
        assert "HELLO" in answer.reason
        assert not forger.poll(500), "the forger must get no answer"
    finally:
        sock.close()
        forger.close()
        ctx.term()
    end = time.monotonic() + 90  # generous: a clean-clone CI run stalled this test ~36 s
    while metric(a_url, "vllm:splitserve_messages_rejected_total") < before + 1:
        assert time.monotonic() < end, "refused handshake not counted in the metrics"
        time.sleep(0.5)


def test_abort_on_decode_side_tells_prefill_and_frees(pair):
    """D waits for a P that never got the request; the client goes away: D aborts (ABORT to P),
    frees its blocks once P acknowledged or the ack timeout passed, and both keep serving."""
    (a_url, a_side), (b_url, _) = pair["ss-a"], pair["ss-b"]
    prompt = prompt_of(300, 900)
    _, decode = dispatch.vllm_concurrent_requests(
        dict(body_for(prompt), stream=True), dispatch.new_transfer_id(), "127.0.0.1", a_side
    )
    request = urllib.request.Request(
        b_url + "/v1/completions",
        data=json.dumps(decode).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=3)
    try:
        with pytest.raises(TimeoutError):  # no token can come: P never got the request
            response.read()
    finally:
        response.close()  # the client goes away: the server aborts the request
    wait_kv_usage_zero(b_url)
    wait_kv_usage_zero(a_url)
    assert_same(
        concurrent_flow(pair["ss-a"], pair["ss-b"], prompt), reference(a_url, prompt), "after"
    )


def test_no_leak_and_metrics(pair):
    """After everything above: no blocks held anywhere, transfers counted, none failed; the
    pair pulled (announces and READs counted, no WRITE posted)."""
    urls = [url for url, _ in pair.servers.values()]
    prompt = prompt_of(300, 950)  # at least one transfer, also when run on its own
    assert_same(concurrent_flow(pair["ss-a"], pair["ss-b"], prompt), reference(urls[0], prompt), "")
    for url in urls:
        wait_kv_usage_zero(url)
        assert metric(url, "vllm:splitserve_transfers_failed_total") == 0
    assert sum(metric(url, "vllm:splitserve_transfers_completed_total") for url in urls) > 0
    assert sum(metric(url, "vllm:splitserve_loads_completed_total") for url in urls) > 0
    assert sum(metric(url, "vllm:splitserve_exposed_handoff_seconds_count") for url in urls) > 0
    assert sum(metric(url, "vllm:splitserve_announces_sent_total") for url in urls) > 0
    assert sum(metric(url, "vllm:splitserve_reads_posted_total") for url in urls) > 0
    assert sum(metric(url, "vllm:splitserve_writes_posted_total") for url in urls) == 0


def test_layers_are_posted_during_the_forward(pair, tiny_model):
    """The overlap proof on a real server: a chunked prefill through the pair has P post every
    layer from the per-layer hook while its forward runs (``layers_posted_in_forward`` rises by
    at least the model's layer count) and none after it (``layers_posted_at_step_end`` stays), and
    records one forward tail (``forward_tail_seconds``: the prompt's last chunk).
    Were the hook to stop firing (an engine upgrade renaming what we hook), the tokens would
    still match, every layer going out after the forward as one bulk transfer: this fails then."""
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    p, d = pair["ss-a"], pair["ss-b"]
    p_url = p[0]
    names = [
        "vllm:splitserve_transfers_completed_total",
        "vllm:splitserve_layers_posted_in_forward_total",
        "vllm:splitserve_layers_posted_at_step_end_total",
    ]
    completed, in_forward, at_step_end = (metric(p_url, name) for name in names)
    tails = metric(p_url, "vllm:splitserve_forward_tail_seconds_count")
    prompt = prompt_of(1300, 1400)  # three chunks on P
    assert_same(concurrent_flow(p, d, prompt), reference(p_url, prompt), "overlap")
    # P's stats reach /metrics with its step outputs; the transfer's completion comes last.
    end = time.monotonic() + 60
    while metric(p_url, names[0]) <= completed:
        assert time.monotonic() < end, "P's transfer never counted as completed"
        time.sleep(0.2)
    assert metric(p_url, names[1]) >= in_forward + layers, "layers not posted in the forward"
    assert metric(p_url, names[2]) == at_step_end, "layers posted after the forward"
    # one forward tail (last layer's hook -> forward's end): the chunk that completed the prompt
    assert metric(p_url, "vllm:splitserve_forward_tail_seconds_count") == tails + 1


@pytest.fixture(scope="module")
def push_p(pair, servers, tiny_model):
    """A third server of the pair whose connector sets ``"direction": "push"``. It prefills
    with pushes, then is the D that test_decode_killed_mid_transfer_prefill_frees_and_serves
    kills (a D follows its P's direction, so it pulls from ss-a there): one start for both."""
    kv = pair.kv_config(free_ports(1)[0])
    kv["kv_connector_extra_config"]["direction"] = "push"
    return servers.vllm(
        "ss-push-p",
        tiny_model,
        kv_transfer_config=kv,
        extra_args=pair.extra_args,
        cpu_core=None,  # it prefills beside ss-b's decode, then decodes beside ss-a's prefill
        env=UNPINNED,
    )


def test_push_prefill_server(pair, servers, push_p):
    """A P whose connector sets ``"direction": "push"`` (WRITEs into D) serving the pair's D
    (which follows P's direction): greedy tokens equal colocated, chunked and first-token."""
    p, d = (push_p.url, servers.side_port("ss-push-p")), pair["ss-b"]
    for i, length in enumerate([BLOCK + 1, 1300]):
        prompt = prompt_of(length, 1500 + i)
        ref = reference(push_p.url, prompt)
        assert_same(concurrent_flow(p, d, prompt), ref, f"push, concurrent, {length} tokens")
        assert_same(first_token_flow(p, d, prompt), ref, f"push, first token, {length} tokens")
    wait_kv_usage_zero(push_p.url)
    assert metric(push_p.url, "vllm:splitserve_writes_posted_total") > 0
    assert metric(push_p.url, "vllm:splitserve_announces_sent_total") == 0
    assert metric(push_p.url, "vllm:splitserve_transfers_failed_total") == 0


# -- dead peers (run last: they stop processes) --------------------------------------------------

FAKE_PREFILL = """
import os, sys, zmq, zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from splitserve.transfer.auth import CurveKeys
ctx = zmq.Context()
auth = ThreadAuthenticator(ctx)
auth.start()
auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
sock = ctx.socket(zmq.ROUTER)
CurveKeys.derive(os.environ["FAKE_KEY"].encode()).apply_server(sock)  # a keyed peer
sock.bind("tcp://127.0.0.1:" + sys.argv[1])
while True:
    frames = sock.recv_multipart()
    print("got", len(frames[-1]), flush=True)
"""


def test_prefill_killed_before_done_fails_the_decode_request_fast(pair):
    """P (a real process on the side channel that never writes) dies: D's request ends with
    an error well within done_timeout_s, D frees its blocks and keeps serving."""
    import subprocess
    import sys

    (b_url, _) = pair["ss-b"]
    port = free_ports(1)[0]
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_PREFILL, str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FAKE_KEY": pair.auth_key},
    )
    try:
        prompt = prompt_of(300, 1000)
        _, decode = dispatch.vllm_concurrent_requests(
            body_for(prompt), dispatch.new_transfer_id(), "127.0.0.1", port
        )
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, b_url, decode, 120.0)
            assert fake.stdout.readline().startswith("got")  # HELLO arrived
            assert fake.stdout.readline().startswith("got")  # REGISTER arrived
            started = time.monotonic()
            fake.kill()
            result = answer.result()
        assert time.monotonic() - started < 30, "D must notice the lost peer, not time out"
        assert "choices" not in result or result["choices"][0].get("finish_reason") == "error", (
            result
        )
    finally:
        fake.kill()
        fake.wait()
    wait_kv_usage_zero(b_url)
    assert_same(
        concurrent_flow(pair["ss-a"], pair["ss-b"], prompt), reference(b_url, prompt), "after"
    )


def test_decode_killed_mid_transfer_prefill_frees_and_serves(pair, servers, push_p):
    """D registers, then dies while P computes a chunked prompt for it: whatever P had written,
    P frees the request's blocks within the lease (KV usage back to zero) and keeps serving."""
    (a_url, _) = pair["ss-a"]
    victim = push_p
    received = metric(a_url, "vllm:splitserve_registrations_received_total")
    prompt = prompt_of(1300, 1100)  # three chunks on P
    prefill, decode = dispatch.vllm_concurrent_requests(
        body_for(prompt), dispatch.new_transfer_id(), "127.0.0.1", pair["ss-a"][1]
    )
    with ThreadPoolExecutor(2) as pool:
        pool.submit(post, victim.url, decode, 120.0)
        p_answer = pool.submit(post, a_url, prefill)
        # P steps while it computes, then while it holds the blocks: its metrics move.
        end = time.monotonic() + 120
        while metric(a_url, "vllm:splitserve_registrations_received_total") <= received:
            assert time.monotonic() < end, "D's registration never reached P"
            time.sleep(0.1)
        victim.process.stop(grace=0)
        servers.release("ss-push-p")  # dead: out of the pool
        assert "choices" in p_answer.result()
    wait_kv_usage_zero(a_url, bound=20 + 30)  # the lease, plus slack for a loaded machine
    other = prompt_of(200, 1200)
    assert_same(
        concurrent_flow(pair["ss-a"], pair["ss-b"], other), reference(a_url, other), "after"
    )
