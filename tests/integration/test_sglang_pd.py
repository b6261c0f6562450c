"""A real SGLang PD pair on CPU behind our proxy (``splitserve proxy --engine sglang``) and behind
``sglang_router``: greedy tokens equal a single SGLang server's for prompts shorter than, equal to
and longer than the chunk (so prefill chunks), concurrent requests and a repeated prompt (a
radix-cache hit on the prefill side).

The pair runs the transfer backend named by ``TRANSFER_BACKEND``. splitserve's own backend is not
built yet (docs/sglang.md), so today this exercises the proxy's SGLang dispatch, the router and
the CPU test environment with SGLang's ``nixl`` backend, made to work on a CPU by the test shim
(tests/shims/sglang_cpu, ``SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM=1``). When the backend lands, set
``TRANSFER_BACKEND = "splitserve"`` and drop the shim variable.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

from splitserve.connectors.sglang.launch import sglang_router, sglang_server  # noqa: E402
from splitserve.launch.process import free_ports  # noqa: E402

pytestmark = pytest.mark.integration

TRANSFER_BACKEND = "nixl"
BACKEND_ENV = {"SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM": "1"}
CHUNK = 64
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
def fronts(servers, tiny_model):
    """(single server URL, proxy URL, router URL), started once per module."""
    group = servers.group
    model = str(tiny_model)
    p_port, d_port, s_port, bootstrap, router_port, proxy_port, metrics_port = free_ports(7)
    starts = {
        "sglang-single": sglang_server(
            model, s_port, served_model_name="tiny", chunked_prefill_size=CHUNK
        ),
        "sglang-pd-prefill": sglang_server(
            model,
            p_port,
            served_model_name="tiny",
            mode="prefill",
            transfer_backend=TRANSFER_BACKEND,
            bootstrap_port=bootstrap,
            chunked_prefill_size=CHUNK,
            env=BACKEND_ENV,
        ),
        "sglang-pd-decode": sglang_server(
            model,
            d_port,
            served_model_name="tiny",
            mode="decode",
            transfer_backend=TRANSFER_BACKEND,
            chunked_prefill_size=CHUNK,
            env=BACKEND_ENV,
        ),
    }
    ports = {"sglang-single": s_port, "sglang-pd-prefill": p_port, "sglang-pd-decode": d_port}
    for key, cmd in starts.items():
        if key not in group.servers:
            group.add(key, cmd.argv, port=ports[key], env=cmd.env)
    group.wait(START_TIMEOUT, names=list(starts), stop_group_on_failure=False)
    p_url, d_url = group.servers["sglang-pd-prefill"].url, group.servers["sglang-pd-decode"].url
    if "sglang-router" not in group.servers:
        router = sglang_router(
            router_port, [(p_url, bootstrap)], [d_url], prometheus_port=metrics_port
        )
        group.add("sglang-router", router.argv, port=router_port, env=router.env)
    if "sglang-proxy" not in group.servers:
        argv = [sys.executable, "-m", "splitserve.cli", "proxy", "--engine", "sglang"]
        argv += ["--prefill", p_url, "--bootstrap-port", str(bootstrap), "--decode", d_url]
        argv += ["--port", str(proxy_port)]
        group.add("sglang-proxy", argv, port=proxy_port)
    group.wait(START_TIMEOUT, names=["sglang-router", "sglang-proxy"], stop_group_on_failure=False)
    return (
        group.servers["sglang-single"].url,
        group.servers["sglang-proxy"].url,
        group.servers["sglang-router"].url,
    )


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
