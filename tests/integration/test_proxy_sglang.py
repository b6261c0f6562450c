"""The proxy in front of a real SGLang prefill/decode pair (splitserve's transfer backend on host
memory; the shared ``sglang_pd`` fixture, tests/integration/conftest.py), checked against
SGLang's own router on the same pair: same greedy text, streamed and not, through the official
``openai`` client.

Needs the SGLang test environment (scripts/install_sglang_cpu.sh, e.g. ``.venv-sglang``); skipped
where SGLang is not installed (the vLLM-only venv). The pair is the one
tests/integration/test_sglang_pd.py uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

import openai  # noqa: E402

from splitserve.proxy.background import BackgroundProxy  # noqa: E402
from splitserve.proxy.config import build_config  # noqa: E402

pytestmark = pytest.mark.integration

PROMPTS = ["hello world the quick brown fox", "the kv cache moves from prefill to decode " * 20]


@pytest.fixture(scope="module", autouse=True)
def release_the_fronts_after(servers) -> Iterator[None]:
    """The last module of the router and of test_sglang_pd's proxy (tests/conftest.py's module
    order): they stop when it ends. The pair stays for test_sglang_failures, next."""
    yield
    servers.release("sglang-router", "sglang-proxy")


@pytest.fixture(scope="module")
def proxy(sglang_pd) -> Iterator[BackgroundProxy]:
    config = build_config(
        {
            "engine": "sglang",
            "port": 0,
            "prefill": [{"url": sglang_pd.prefill_url, "bootstrap_port": sglang_pd.bootstrap_port}],
            "decode": [{"url": sglang_pd.decode_url}],
            # SGLang's /health runs a generation: slow on a loaded CPU, so be patient with it.
            "health": {"timeout_s": 30, "failures_to_eject": 3},
        }
    )
    with BackgroundProxy(config) as running:
        yield running


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)


def router_text(router: str, prompt: str) -> str:
    """SGLang's router starts listening late and then answers 503 until its workers are
    registered: retry both, within a bound."""
    end = time.monotonic() + 300
    while True:
        try:
            out = client(router).completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0
            )
            return out.choices[0].text
        except (openai.APIConnectionError, openai.APIStatusError) as e:
            retryable = isinstance(e, openai.APIConnectionError) or e.status_code == 503
            if not retryable or time.monotonic() > end:
                raise
            time.sleep(2)


def test_sglang_pd_through_proxy_matches_sglang_router(sglang_pd, proxy) -> None:
    c = client(proxy.url)
    for prompt in PROMPTS:
        ref = router_text(sglang_pd.router_url, prompt)
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == ref
        assert got.usage.completion_tokens == 12
        stream = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == ref


def test_sglang_chat_through_proxy(proxy) -> None:
    out = client(proxy.url).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "what is a kv cache"}],
        max_tokens=8,
        temperature=0,
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens > 0
