"""A real SGLang PD pair on CPU behind our proxy (``splitserve proxy --engine sglang``) and behind
``sglang_router``: greedy tokens equal a single SGLang server's for prompts shorter than, equal to
and longer than the chunk (so prefill chunks), concurrent requests and a repeated prompt (a
radix-cache hit on the prefill side); the prefill server posts every layer during its forward
(the layer-wise hook fired), read from the totals its backend logs per transfer.

The pair (the shared ``sglang_pd`` fixture, tests/integration/conftest.py) runs splitserve's own
transfer backend (``--disaggregation-transfer-backend splitserve``, docs/sglang.md); SGLang's
``nixl`` backend appears only in benchmarks/handoff.py.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

import sglang_servers  # noqa: E402

from splitserve.netutil import free_port  # noqa: E402

pytestmark = pytest.mark.integration

CHUNK = sglang_servers.CHUNK  # the single server chunks like the shared pair
START_TIMEOUT = 600.0
MAX_TOKENS = 8


def _post(url: str, path: str, body: dict, attempts: int = 30) -> dict:
    """POST JSON; retried (bounded) while the front answers 503 at start (the router does)."""
    data = json.dumps(body).encode()
    for attempt in range(attempts):
        req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == attempts - 1:
                raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
            time.sleep(2)
    raise AssertionError("unreachable")


def completion_text(url: str, prompt: list[int]) -> str:
    """OpenAI completion (what our proxy serves): greedy text of MAX_TOKENS tokens."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    body["ignore_eos"] = True
    return _post(url, "/v1/completions", body)["choices"][0]["text"]


def generate_ids(url: str, prompt: list[int]) -> list[int]:
    """SGLang's native /generate (what the router serves; it takes no token-id prompt on its
    OpenAI route): greedy output token ids."""
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return _post(url, "/generate", {"input_ids": prompt, "sampling_params": params})["output_ids"]


def ask(front: str, url: str, prompt: list[int]):
    return completion_text(url, prompt) if front == "proxy" else generate_ids(url, prompt)


def prompt_of(length: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def single_starting(servers, tiny_model) -> None:
    """``sglang-single`` started (or marked as used), not waited for: requested before
    ``sglang_pd`` (``fronts``), it starts beside the pair instead of after it (three start-ups
    share the two cores; one wait fewer in a row)."""
    sglang_servers.start_single(servers, tiny_model)


@pytest.fixture(scope="module")
def fronts(servers, single_starting, sglang_pd):
    """(single server URL, proxy URL, router URL), started once per session."""
    group = servers.group
    if "sglang-proxy" not in group.servers:
        proxy_port = free_port()
        argv = [sys.executable, "-m", "splitserve.cli", "proxy", "--engine", "sglang"]
        argv += ["--prefill", sglang_pd.prefill_url]
        argv += ["--bootstrap-port", str(sglang_pd.bootstrap_port)]
        argv += ["--decode", sglang_pd.decode_url, "--port", str(proxy_port)]
        group.add("sglang-proxy", argv, port=proxy_port)
    names = ["sglang-single", "sglang-proxy"]
    group.wait(START_TIMEOUT, names=names, stop_group_on_failure=False)
    single, proxy = group.servers["sglang-single"].url, group.servers["sglang-proxy"].url
    return single, proxy, sglang_pd.router_url


LENGTHS = [20, CHUNK, 3 * CHUNK + 5]


@pytest.mark.parametrize("front", ["proxy", "router"])
def test_greedy_equal_to_single_server(fronts, front):
    single, proxy, router = fronts
    url = proxy if front == "proxy" else router
    for seed, length in enumerate(LENGTHS):
        prompt = prompt_of(length, seed)
        assert ask(front, url, prompt) == ask(front, single, prompt), (front, length)


@pytest.mark.parametrize("front", ["proxy", "router"])
def test_concurrent_and_repeated_prompts(fronts, front):
    single, proxy, router = fronts
    url = proxy if front == "proxy" else router
    prompts = [prompt_of(CHUNK + 10 * i, 100 + i) for i in range(4)]
    expected = [ask(front, single, p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: ask(front, url, p), prompts))
    assert got == expected
    # The same prompt again: the prefill server's radix cache now holds it.
    assert ask(front, url, prompts[0]) == expected[0]


# P's backend logs its sender's totals with every transfer it completed (SGLang has no metrics
# hook for a transfer backend): splitserve.connectors.sglang.conn.
SENT = re.compile(
    r"splitserve: transfer \S+ sent \(totals: .*layers_posted_in_forward=(\d+) "
    r"layers_posted_at_step_end=(\d+)\)"
)


def overlap_totals(log) -> tuple[int, int, int]:
    """(transfers logged as sent, layers posted in the forward, layers posted at step end)."""
    found = SENT.findall(log.read_text(errors="replace"))
    if not found:
        return 0, 0, 0
    in_forward, at_step_end = found[-1]
    return len(found), int(in_forward), int(at_step_end)


def test_layers_are_posted_during_the_forward(fronts, servers, tiny_model):
    """The overlap proof on a real SGLang pair: a prompt of several chunks has P post every
    layer from the ``set_kv_buffer`` hook while its forward runs (``layers_posted_in_forward``
    rises by at least the model's layer count) and none after it (``layers_posted_at_step_end``
    stays). Were the hook to stop firing (SGLang renaming what we hook), the tokens would still
    match, each chunk going out after its forward in bulk: this fails then."""
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    _, proxy, _ = fronts
    log = servers.group.log_dir / "sglang-pd-prefill.log"
    prompt = prompt_of(3 * CHUNK + 5, 900)
    # Then the same prompt again: a radix hit on P, whose cached prefix SGLang sends from
    # inside the forward's run_batch (that send must not close the forward's layer-wise step).
    for what in ("new prompt", "radix hit"):
        sent, in_forward, at_step_end = overlap_totals(log)
        completion_text(proxy, prompt)
        end = time.monotonic() + 60
        while overlap_totals(log)[0] <= sent:
            assert time.monotonic() < end, f"{what}: P logged no completed transfer"
            time.sleep(0.2)
        _, after_in_forward, after_at_step_end = overlap_totals(log)
        assert after_in_forward >= in_forward + layers, f"{what}: not posted in the forward"
        assert after_at_step_end == at_step_end, f"{what}: layers posted after the forward"


# With --enable-metrics (the shared pair's), the backend's counters are on each server's /metrics
# (splitserve.connectors.sglang.stats), published when a transfer settles.
def metric(url: str, name: str) -> float:
    """The sum over labels of one sample (0 when absent) on a server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_metrics_prove_the_layers_went_out_during_the_forward(fronts, sglang_pd, tiny_model):
    """The overlap proof from P's /metrics: after a request of several chunks through the pair,
    ``sglang:splitserve_layers_posted_in_forward_total`` rose by at least the model's layer count
    (each counted when the ``set_kv_buffer`` hook posted a layer while the forward was still
    running), ``layers_posted_at_step_end`` (layers the hook missed, posted after the forward)
    did not, and D's exposed-handoff histogram and completed loads counted the request."""
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    _, proxy, _ = fronts
    p, d = sglang_pd.prefill_url, sglang_pd.decode_url
    prefix = "sglang:splitserve_"
    completed = metric(p, prefix + "transfers_completed_total")
    in_forward = metric(p, prefix + "layers_posted_in_forward_total")
    at_step_end = metric(p, prefix + "layers_posted_at_step_end_total")
    handoffs = metric(d, prefix + "exposed_handoff_seconds_count")
    completion_text(proxy, prompt_of(3 * CHUNK + 5, 901))
    end = time.monotonic() + 60
    while metric(p, prefix + "transfers_completed_total") <= completed:
        assert time.monotonic() < end, "P's metrics show no completed transfer"
        time.sleep(0.2)
    assert metric(p, prefix + "layers_posted_in_forward_total") >= in_forward + layers
    assert metric(p, prefix + "layers_posted_at_step_end_total") == at_step_end
    assert metric(p, prefix + "bytes_sent_total") > 0
    assert metric(p, prefix + "transfers_failed_total") == 0
    assert metric(d, prefix + "exposed_handoff_seconds_count") >= handoffs + 1
    assert metric(d, prefix + "loads_completed_total") >= handoffs + 1


def test_timeline_of_a_request_from_both_logs(fronts, servers):
    """The per-request timeline (SPLITSERVE_SGLANG_TIMELINE=1 on the pair) joins across P's and
    D's logs (benchmarks/sglang_timeline.py) into a row with every point, in causal order."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_timeline.py"
    spec = importlib.util.spec_from_file_location("sglang_timeline_bench", path)
    timeline = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = timeline
    spec.loader.exec_module(timeline)
    _, proxy, _ = fronts
    logs = [servers.group.log_dir / f"sglang-pd-{side}.log" for side in ("prefill", "decode")]
    before = set(timeline.read_logs(logs))
    completion_text(proxy, prompt_of(3 * CHUNK + 5, 902))
    end = time.monotonic() + 60
    while True:
        new = [r for room, r in timeline.read_logs(logs).items() if room not in before]
        if new and "d_first_decode_end" in new[-1].events:
            break
        assert time.monotonic() < end, f"no complete timeline: {[r.events for r in new]}"
        time.sleep(0.2)
    row = new[-1].row()
    missing = [name for name in timeline.POINTS if row[name] is None]
    assert not missing, (missing, row)
    assert row["chunks"] >= 4, row  # 3 * CHUNK + 5 tokens, chunked by CHUNK
    order = [
        "p_request",
        "p_init",
        "fwd_first_start",
        "fwd_last_end",
        "d_done",
        "d_first_decode",
        "d_first_decode_end",
    ]
    assert [row[n] for n in order] == sorted(row[n] for n in order), row
    assert row["d_registered"] <= row["p_registered"], row
    assert row["failed"] == ""
