"""The adaptive chunk scheduler inside real vLLM: same greedy tokens, a budget that moves, metrics
reachable from the API server, and a wrong setting failing at start-up.

One real server runs ``--scheduler-cls splitserve.schedulers.vllm.AdaptiveChunkScheduler`` with
``PROMETHEUS_MULTIPROC_DIR`` set, so the scheduler's metrics (written in the EngineCore process)
appear on the API server's ``/metrics``: that is how the test observes the budget, as an operator
would. Its target is 1 µs, unreachable on any machine (1 ms was not: a CI run learned steps fast
enough that 128 tokens beside a few decodes "fit"), so the budget is exactly the maximum chunk
on steps without decodes and the floor (one 128-token block: no chunk fits such a target alone)
on steps with decodes: whether it moved is then a fact of the workload, not of timing. The two
long prompts arrive together while the short ones decode, so those one-block budgets are shared
between them (64 tokens each, several prompts' chunks per step; ``share_always``, since their
arrival order is not the test's to choose and sharing otherwise applies only to a short prompt
behind a long one): vLLM ran the policy's per-prompt cap. The reference is the shared
default-scheduler server (key ``unified``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
import urllib.request

import aiohttp
import pytest
import starters
from prometheus_client.parser import text_string_to_metric_families

from splitserve.netutil import free_port

pytestmark = pytest.mark.integration

SCHEDULER_CLS = starters.SCHEDULER_CLS
SHORT_PROMPTS = 3
LONG_PROMPT_TOKENS = (700, 1100)  # several 128-token chunks each
MAX_TOKENS = 48


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    short = [[rng.randint(5, 1000) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    long = [[rng.randint(5, 1000) for _ in range(n)] for n in LONG_PROMPT_TOKENS]
    return short + long


@pytest.fixture(scope="module")
def adaptive_and_default(servers, tiny_model, tmp_path_factory):
    """(adaptive, default): started as tests/integration/starters.py says (ahead, while
    the unit tests ran, when the session has them)."""
    keys = starters.adaptive_scheduler(servers, tiny_model, tmp_path_factory)
    keys += starters.unified(servers, tiny_model, tmp_path_factory)
    servers.wait_all(*keys)
    running = servers.group.servers
    return running[starters.ADAPTIVE], running[starters.UNIFIED]


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        return (await response.json())["choices"][0]["token_ids"]


async def _stream_then_wait(
    session: aiohttp.ClientSession, url: str, prompt: list[int], started: asyncio.Event
) -> list[int]:
    """Stream a completion; set ``started`` once its first token arrived (it is decoding)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    tokens: list[int] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
            if tokens:
                started.set()
    return tokens


async def _mixed_workload(url: str) -> list[list[int]]:
    """Short prompts start decoding, then long prompts arrive while they decode."""
    prompts = _prompts()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        events = [asyncio.Event() for _ in range(SHORT_PROMPTS)]
        shorts = [
            asyncio.create_task(_stream_then_wait(session, url, p, e))
            for p, e in zip(prompts[:SHORT_PROMPTS], events, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=300)
        longs = [_complete(session, url, p) for p in prompts[SHORT_PROMPTS:]]
        return list(await asyncio.gather(*shorts, *longs))


async def _reference(url: str) -> list[list[int]]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(_complete(session, url, p) for p in _prompts())))


def _metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("splitserve_scheduler"):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_greedy_tokens_match_default_and_budget_follows_decodes(adaptive_and_default) -> None:
    adaptive, default = adaptive_and_default
    got = asyncio.run(_mixed_workload(adaptive.url))
    expected = asyncio.run(_reference(default.url))
    assert [len(t) for t in got] == [MAX_TOKENS] * len(got)
    assert got == expected

    samples = _metric_samples(adaptive.url)
    decisions = {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "splitserve_scheduler_budget_decisions_total"
    }
    # Steps without decodes got the whole start-up budget; steps with decodes the minimum.
    assert decisions.get("no_decodes", 0) >= 1, decisions
    assert decisions.get("min_chunk", 0) >= 1, decisions
    buckets = {
        dict(labels)["le"]: value
        for (name, labels), value in samples.items()
        if name == "splitserve_scheduler_prefill_budget_chosen_tokens_bucket"
    }
    steps = buckets["+Inf"]
    at_most_min_chunk = buckets["256.0"]
    assert 0 < at_most_min_chunk < steps, buckets
    # Every step of the short prompts' decoding ran with decodes, hence the minimum.
    assert decisions["min_chunk"] >= MAX_TOKENS - 1
    # The long prompts shared those budgets: steps carried both prompts' chunks.
    assert samples.get(("splitserve_scheduler_shared_steps_total", ()), 0) >= 1, samples
    assert samples[("splitserve_scheduler_step_seconds_count", ())] > 0
    assert ("splitserve_scheduler_prediction_error_seconds", ()) in samples


_IN_PROCESS_SCRIPT = textwrap.dedent(
    """
    import json, sys, urllib.request
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        model, scheduler_cls, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
        common = dict(model=model, dtype="float32", enforce_eager=True, scheduler_cls=scheduler_cls)
        try:
            LLM(**common, additional_config={
                "splitserve_scheduler": {"target_itl_ms": 5, "min_chunk": 100}})
        except Exception as exc:  # the start-up failure is the expected outcome
            print("STARTUP-FAILED:", exc)
        else:
            print("STARTUP-SUCCEEDED")
        llm = LLM(**common, additional_config={
            "splitserve_scheduler": {"target_itl_ms": 1, "metrics_port": port}})
        llm.generate([{"prompt_token_ids": list(range(10, 40))}],
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            print("METRICS-BEGIN")
            print(r.read().decode())
    """
)


def test_wrong_setting_fails_at_startup_and_metrics_port_serves(tiny_model, tmp_path) -> None:
    """In-process engines (fast): a wrong setting fails the engine's start-up naming the field;
    ``metrics_port`` serves the scheduler's metrics from the engine's own process."""
    script = tmp_path / "in_process.py"
    script.write_text(_IN_PROCESS_SCRIPT)
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_model), SCHEDULER_CLS, str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "STARTUP-FAILED:" in result.stdout, output[-3000:]
    assert "min_chunk (100) must be a multiple of alignment (128)" in result.stdout
    metrics_text = result.stdout.split("METRICS-BEGIN", 1)[1]
    families = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    decisions = {
        s.labels["reason"]: s.value
        for s in families["splitserve_scheduler_budget_decisions"].samples
        if s.name.endswith("_total")
    }
    assert decisions.get("no_decodes", 0) >= 1 and decisions.get("min_chunk", 0) >= 1, decisions
