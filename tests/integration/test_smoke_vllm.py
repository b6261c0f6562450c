"""A stock vLLM with splitserve installed: vLLM finds our plugin, and serves our test model as
we built it.

Each test fails through a splitserve path, cheaply (one colocated server, shared with
``test_adaptive_scheduler.py``):

- the installed entry point (pyproject.toml -> ``splitserve.plugins.register_vllm``), run by
  vLLM's own plugin loader, registers ``SplitserveConnector`` resolving to our class. vLLM only
  logs a plugin that does not load, so a stale or wrong entry point would otherwise surface
  later, as "unknown connector" on the first disaggregated server;
- ``splitserve.models`` and the launcher: the server serves the directory we built, as we
  built it (its greedy tokens equal those of transformers' reference implementation run here on
  the same directory, which also needs the logits spread that models.py chose), and our chat
  template applies;
- ``tests/metrics_text.py`` reads vLLM's real ``/metrics`` (a reader that silently found
  nothing would let other tests compare zeros).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request

import pytest
import starters
from metrics_text import fetch_metrics, metric_sum

pytestmark = pytest.mark.integration

MAX_TOKENS = 24


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def unified(servers, tiny_model, tmp_path_factory):
    servers.wait_all(*starters.unified(servers, tiny_model, tmp_path_factory))
    return servers.group.servers[starters.UNIFIED]


_LOAD_PLUGINS_AS_VLLM_DOES = """
import vllm.plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

vllm.plugins.load_general_plugins()
cls = KVConnectorFactory.get_connector_class_by_name("SplitserveConnector")
print("CONNECTOR", cls.__module__ + "." + cls.__qualname__)
"""


def test_vllm_plugin_loader_registers_our_connector() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_PLUGINS_AS_VLLM_DOES],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CONNECTOR splitserve.connectors.vllm.connector.SplitserveConnector" in done.stdout


def _reference_greedy(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy ids from transformers' Llama on the directory the server loaded (fp32 as the
    server runs; the model's logits are spread wide enough for both to agree: models.py)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


def test_serves_our_model_greedy_equal_to_the_reference(unified, tiny_model) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(5, 1000) for _ in range(24)]
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    choice = _post(unified.url + "/v1/completions", body)["choices"][0]
    assert len(choice["token_ids"]) == MAX_TOKENS
    assert choice["token_ids"] == _reference_greedy(tiny_model, prompt, MAX_TOKENS)


def test_chat_template_applies(unified) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "what is a kv cache"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    out = _post(unified.url + "/v1/chat/completions", body)
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] > 0
    # Our chat template (models.py) wraps the user text in role markers, so the prompt is
    # longer than the user text alone.
    assert out["usage"]["prompt_tokens"] > 4


def test_metrics_reader_reads_vllm(unified) -> None:
    _post(
        unified.url + "/v1/completions",
        {"model": "tiny", "prompt": "hello world", "max_tokens": 2, "temperature": 0},
    )
    text = fetch_metrics(unified.url)
    assert metric_sum(text, "vllm:request_success_total") >= 1
    assert metric_sum(text, "vllm:request_success_total", finished_reason="length") >= 1
