"""A real SGLang CPU server with splitserve's plugin: greedy generation, the adaptive chunk
budget switched on (installed, applied to a prompt longer than the chunk), and a bad setting
stopping start-up with a message naming the field.

Needs the SGLang test environment (scripts/install_sglang_cpu.sh); skipped where SGLang is not
installed (the vLLM-only venv).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import sglang_servers
from sglang_servers import CHUNK

pytest.importorskip("sglang")

from splitserve.launch.process import ProcessStartError  # noqa: E402
from splitserve.netutil import free_port  # noqa: E402

pytestmark = pytest.mark.integration

START_TIMEOUT = 600.0


def generate(url: str, text: str, max_new_tokens: int = 8) -> dict:
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def adaptive_server(servers, tiny_model, tmp_path_factory):
    (key,) = sglang_servers.start_adaptive(servers, tiny_model, tmp_path_factory)
    servers.group.wait(START_TIMEOUT, names=[key], stop_group_on_failure=False)
    return servers.group.servers[key]


def test_adaptive_budget_installed_and_generation_is_greedy(adaptive_server):
    prompt = " ".join(f"word{i}" for i in range(60))  # longer than one 64-token chunk
    first = generate(adaptive_server.url, prompt)
    assert first["meta_info"]["prompt_tokens"] > CHUNK
    again = generate(adaptive_server.url, prompt + " more")
    assert len(first["output_ids"]) == 8
    assert generate(adaptive_server.url, prompt)["output_ids"] == first["output_ids"]
    assert again["meta_info"]["prompt_tokens"] > first["meta_info"]["prompt_tokens"]
    log = adaptive_server.process.log_path.read_text(errors="replace")
    assert "splitserve adaptive chunk budget on" in log
    assert "budget 16..64 tokens in steps of 16" in log


def test_bad_budget_setting_stops_start_up(servers, tiny_model, tmp_path):
    settings = tmp_path / "bad.yaml"
    settings.write_text("target_itl_ms: 40\nmax_chunk: 100000\n")
    port = free_port()
    cmd = sglang_servers.adaptive_command(tiny_model, port, settings)
    key = "sglang-bad-budget"
    servers.group.add(key, cmd.argv, port=port, env=cmd.env)
    with pytest.raises(ProcessStartError) as failure:
        servers.group.wait(START_TIMEOUT, names=[key], stop_group_on_failure=False)
    assert "max_chunk (100000) exceeds" in failure.value.log_tail
