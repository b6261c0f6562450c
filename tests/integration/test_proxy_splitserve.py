"""The proxy in front of two real vLLM servers running our SplitserveConnector: the concurrent
flow (one transfer id, P and D at the same time, KV streamed layer by layer) and the sequential
flow, with the official ``openai`` client; greedy output equals a colocated run.

Shares the connector tests' servers (keys ``ss-a`` / ``ss-b``): when they already run, their
side-channel ports are read from their command lines; otherwise they are started here with the
same settings the connector tests use. Only successful flows run here, so the connector tests'
"no failed transfer" check on those servers still holds.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
from collections.abc import Iterator

import openai
import pytest

from splitserve.launch.process import free_ports
from splitserve.proxy.config import build_config
from splitserve.proxy.server import BackgroundProxy

pytestmark = pytest.mark.integration

# The connector tests' settings for these shared servers (tests/integration/test_connector_vllm.py).
AUTH_KEY = "splitserve-test-key"
EXTRA_ARGS = ["--max-model-len", "2048", "--max-num-batched-tokens", "512"]


def _kv_config(side_port: int) -> dict:
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "side_channel_port": side_port,
            "auth_key": AUTH_KEY,
            "lease_s": 20,
            "done_timeout_s": 300,
        },
    }


def _side_port(argv: list[str]) -> int:
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return int(config["kv_connector_extra_config"]["side_channel_port"])


@pytest.fixture(scope="module")
def ss_pair(servers, tiny_model) -> dict[str, tuple[str, int]]:
    """{key: (url, side_channel_port)} of the two SplitserveConnector servers."""
    ports = dict(zip(("ss-a", "ss-b"), free_ports(2), strict=True))
    for core, key in enumerate(ports):
        if key not in servers.group.servers:
            servers.vllm(
                key,
                tiny_model,
                kv_transfer_config=_kv_config(ports[key]),
                extra_args=EXTRA_ARGS,
                cpu_core=core,
                wait=False,
            )
    servers.wait_all(*ports)
    out = {}
    for key in ports:
        server = servers.group.servers[key]
        out[key] = (server.url, _side_port(server.process.argv))
    return out


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


def test_concurrent_flow_through_proxy_matches_colocated(ss_pair, concurrent_proxy) -> None:
    p_url = ss_pair["ss-a"][0]
    c = client(concurrent_proxy.url)
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


def test_concurrent_flow_parallel_streams(ss_pair, concurrent_proxy) -> None:
    p_url = ss_pair["ss-a"][0]
    prompts = [prompt_of(n, 7200 + n) for n in (40, 200, 333, 600)]
    refs = [colocated(p_url, pr) for pr in prompts]

    def one(prompt: list[int]) -> str:
        stream = client(concurrent_proxy.url).completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == refs
    text = concurrent_proxy.state.metrics.render().decode()
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
