"""The proxy in front of a real SGLang prefill/decode pair (SGLang's own NIXL transfer backend on
host memory), checked against SGLang's own router on the same pair: same greedy text, streamed
and not, through the official ``openai`` client.

Needs the SGLang test environment (scripts/install_sglang_cpu.sh, e.g. ``.venv-sglang``); skipped
where SGLang is not installed (the vLLM-only venv). SGLang's own NIXL backend labels host buffers
as GPU memory; the environment's CPU shim (``SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM=1``) registers
them as host memory. Servers are shared through the ``servers`` fixture under the keys
``proxy-sglang-p`` / ``proxy-sglang-d`` / ``proxy-sglang-router``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang_router")

import openai  # noqa: E402

from splitserve.launch.process import free_ports  # noqa: E402
from splitserve.proxy.config import build_config  # noqa: E402
from splitserve.proxy.server import BackgroundProxy  # noqa: E402

pytestmark = pytest.mark.integration

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM": "1",
}
PROMPTS = ["hello world the quick brown fox", "the kv cache moves from prefill to decode " * 20]


def _server_argv(model: str, port: int, mode: str, bootstrap_port: int) -> list[str]:
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model,
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch", "--disable-cuda-graph", "--mem-fraction-static", "0.05",
        "--skip-server-warmup", "--max-total-tokens", "16384",
        "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl",
    ]  # fmt: skip
    if mode == "prefill":  # the overlap scheduler makes a CUDA event on prefix hits
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        argv += ["--disable-overlap-schedule"]
    else:
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return argv


@pytest.fixture(scope="module")
def sglang_pd(servers, tiny_model) -> dict[str, str | int]:
    """P, D and SGLang's router over them: urls of "p", "d", "router"; P's "bootstrap" port."""
    group = servers.group
    if "proxy-sglang-p" not in group.servers:
        p_port, d_port, bootstrap, router_port, router_metrics = free_ports(5)
        group.add(
            "proxy-sglang-p",
            _server_argv(str(tiny_model), p_port, "prefill", bootstrap),
            port=p_port,
            env=ENV,
        )
        group.add(
            "proxy-sglang-d",
            _server_argv(str(tiny_model), d_port, "decode", bootstrap),
            port=d_port,
            env=ENV,
        )
        servers.wait_all("proxy-sglang-p", "proxy-sglang-d")
        router = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{p_port}", str(bootstrap),
            "--decode", f"http://127.0.0.1:{d_port}", "--host", "127.0.0.1",
            "--port", str(router_port), "--prometheus-port", str(router_metrics),
        ]  # fmt: skip
        # Not waited for here: it listens late; router_text retries until it answers.
        group.add("proxy-sglang-router", router, port=router_port, env=ENV)
    p = group.servers["proxy-sglang-p"]
    argv = p.process.argv
    bootstrap = int(argv[argv.index("--disaggregation-bootstrap-port") + 1])
    return {
        "p": p.url,
        "d": group.servers["proxy-sglang-d"].url,
        "bootstrap": bootstrap,
        "router": group.servers["proxy-sglang-router"].url,
    }


@pytest.fixture(scope="module")
def proxy(sglang_pd) -> Iterator[BackgroundProxy]:
    config = build_config(
        {
            "engine": "sglang",
            "port": 0,
            "prefill": [{"url": sglang_pd["p"], "bootstrap_port": sglang_pd["bootstrap"]}],
            "decode": [{"url": sglang_pd["d"]}],
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
        ref = router_text(str(sglang_pd["router"]), prompt)
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
