"""The CPU demo behind the README's main command (``make demo`` / ``splitserve demo``).

Runs in the CLI process: starts the deployment of ``configs/demo-cpu.yaml`` with the same
``DeploymentRunner`` as ``splitserve up``, sends a few requests through the proxy (one streaming),
prints the answers with their client-side time to first token, reads the KV handoff figures from
the servers' Prometheus metrics, and shuts everything down.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from splitserve.launch.deployment import DeploymentRunner

PROMPTS = [
    ("completion", "the quick brown fox jumps over the lazy dog " * 3),
    ("chat", "what is a kv cache and why does prefill fill it"),
    ("completion, streamed", "hello world " * 40 + "the scheduler picks a budget"),
]


@dataclass
class DemoAnswer:
    kind: str
    text: str
    ttft_s: float
    total_s: float
    completion_tokens: int | None


def _request(url: str, body: dict, timeout: float = 300.0) -> urllib.request.Request:
    return urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def ask(base: str, model: str, kind: str, prompt: str, max_tokens: int = 24) -> DemoAnswer:
    """One request through the proxy; TTFT is measured at the client."""
    t0 = time.perf_counter()
    if kind == "chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        with urllib.request.urlopen(
            _request(base + "/v1/chat/completions", body), timeout=300
        ) as r:
            out = json.loads(r.read())
        dt = time.perf_counter() - t0
        return DemoAnswer(
            kind,
            out["choices"][0]["message"]["content"],
            dt,
            dt,
            out.get("usage", {}).get("completion_tokens"),
        )
    if "streamed" not in kind:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        with urllib.request.urlopen(_request(base + "/v1/completions", body), timeout=300) as r:
            out = json.loads(r.read())
        dt = time.perf_counter() - t0
        return DemoAnswer(
            kind, out["choices"][0]["text"], dt, dt, out.get("usage", {}).get("completion_tokens")
        )
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, ttft, tokens = [], None, None
    with urllib.request.urlopen(_request(base + "/v1/completions", body), timeout=300) as r:
        for event in _sse_events(r):
            if event.get("choices"):
                piece = event["choices"][0].get("text", "")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
    total = time.perf_counter() - t0
    return DemoAnswer(kind, "".join(text), ttft if ttft is not None else total, total, tokens)


def _sse_events(resp) -> Iterator[dict]:
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def scrape(url: str) -> dict[str, float]:
    """Flatten a Prometheus endpoint into ``{name{labels}: value}`` for splitserve's metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "splitserve_" in sample.name:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """The sum of metric ``name`` over all its label sets (0 when absent)."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


# SplitserveConnector's metrics on each vLLM server's /metrics
# (splitserve/connectors/vllm/stats.py; docs/connector-protocol.md, "Metrics").
KV_BYTES_SENT = "vllm:splitserve_bytes_sent_total"
TRANSFERS_COMPLETED = "vllm:splitserve_transfers_completed_total"
LOADS_COMPLETED = "vllm:splitserve_loads_completed_total"
EXPOSED_HANDOFF = "vllm:splitserve_exposed_handoff_seconds"


def handoff_summary(servers: list[tuple[str, str]]) -> list[str]:
    """KV bytes moved and exposed handoff per ``(name, base_url)`` engine server, from its
    metrics: a prefill server reports what it sent, a decode server what it loaded."""
    lines = []
    for name, url in servers:
        m = scrape(url)
        sent = metric_sum(m, KV_BYTES_SENT)
        transfers = metric_sum(m, TRANSFERS_COMPLETED)
        loads = metric_sum(m, LOADS_COMPLETED)
        h_sum = metric_sum(m, EXPOSED_HANDOFF + "_sum")
        h_cnt = metric_sum(m, EXPOSED_HANDOFF + "_count")
        parts = []
        if transfers or sent:
            parts.append(f"sent {sent / 2**20:.2f} MiB of KV in {transfers:.0f} transfers")
        if loads:
            parts.append(f"loaded the KV of {loads:.0f} requests")
        if h_cnt:
            parts.append(f"exposed handoff mean {1000 * h_sum / h_cnt:.2f} ms")
        lines.append(f"{name}: {'; '.join(parts) if parts else 'no KV moved'}")
    return lines


def run_demo(runner: DeploymentRunner, echo: Callable[[str], None]) -> None:
    """Start, ask, report, (the caller stops)."""
    runner.start()
    model = runner.dep.model.served_name
    echo(f"\nsending {len(PROMPTS)} requests through the proxy at {runner.url}\n")
    for kind, prompt in PROMPTS:
        a = ask(runner.url, model, kind, prompt)
        echo(f"[{a.kind}] prompt: {prompt[:60]!r}...")
        echo(f"  answer: {a.text!r}")
        echo(
            f"  TTFT {1000 * a.ttft_s:.0f} ms, total {1000 * a.total_s:.0f} ms, "
            f"{a.completion_tokens} tokens\n"
        )
    echo("KV handoff (from the servers' /metrics):")
    servers = [(s.name, f"http://127.0.0.1:{s.port}") for s in runner.planned]
    for line in handoff_summary(servers):
        echo(f"  {line}")
