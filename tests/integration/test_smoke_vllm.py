"""A real vLLM server serves the tiny model: completions, chat, deterministic greedy output."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.integration


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def unified(servers, tiny_model):
    return servers.vllm("unified", tiny_model)


def test_completions_greedy_is_deterministic(unified) -> None:
    body = {
        "model": "tiny",
        "prompt": "hello world the quick brown fox",
        "max_tokens": 16,
        "temperature": 0,
    }
    first = _post(unified.url + "/v1/completions", body)
    second = _post(unified.url + "/v1/completions", body)
    assert first["usage"]["completion_tokens"] > 0
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_chat_completions(unified) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "what is a kv cache"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    out = _post(unified.url + "/v1/chat/completions", body)
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] > 0
    # The chat template was applied: the prompt holds the role markers, so it is longer than
    # the user text alone.
    assert out["usage"]["prompt_tokens"] > 4
