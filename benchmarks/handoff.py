"""Handoff benchmark: TTFT and exposed handoff of a P->D pair, rivals side by side in one run.

Model preset ``bench`` (16 layers, 256 KiB of fp32 KV per token), prompt lengths 512..4096,
fresh random prompts per request (no prefix-cache hits), greedy, on one machine:

- ``colocated``: a plain request to one server (the splitserve P server, no transfer);
- ``splitserve-concurrent``: SplitserveConnector through the splitserve proxy with
  ``first_token_from_prefill`` off: P and D get the request at once, KV streamed per layer and
  per chunk while P computes, D computes the last prompt token and samples every token;
- ``splitserve-first-token``: the same with ``first_token_from_prefill`` on: the proxy streams
  the token P sampled as soon as P answers, D loads every prompt token's KV and continues from
  it (its first step samples token 2);
- ``splitserve-first-token-push``: the same flow on a second pair whose connectors set
  ``"direction": "push"`` (P WRITEs every layer; on ``cma`` the pair above pulls: P announces,
  D reads), started after the first pair in the same run; TTFT is compared with the first
  pair's ``colocated`` rows (same core, same server settings);
- ``splitserve-sequential``: SplitserveConnector behind the stock sequential flow (P first,
  then D; P writes everything once D registers);
- ``nixl``: vLLM's stock ``NixlConnector`` (D pulls after P finished), sequential flow;
- ``nixl-push``: vLLM's ``NixlPushConnector`` when the installed vLLM has it;
- ``sglang-colocated``, ``sglang-splitserve``, ``sglang-nixl``, ``sglang-mooncake-tcp``: SGLang
  rows, same model and prompts: our SGLang backend against SGLang's own ``nixl`` and
  ``mooncake`` (TCP) backends, TTFT against a single SGLang server and our exposed handoff
  (``benchmarks/handoff_sglang.py`` says how each is measured).

Each row is measured on NIXL's default path and, with ``--transports default tcp``, again with
``UCX_TLS=tcp`` (a slower link). Per request the client records:

- ``ttft_s``: client send -> first streamed token (for sequential flows: including P);
- ``gap_s``: first streamed token -> second (colocated: one decode step; first-token flow: D's
  DONE wait after P's answer, plus its one forward, which now samples token 2);
- ``after_p_s`` (flows through the proxy): TTFT minus P's answer time as the proxy measured it,
  i.e. what the client waits beyond P's prefill (first-token flow: only the proxy's relay);
- ``handoff_s`` (direct sequential flows): P's answer received -> D's first token (what the
  client waits beyond P's prefill; includes D's one-token forward);
- ``exposed_s`` (splitserve only): from the end of P's last forward (all layers computed) to
  DONE seen at D, from the connector's own ``vllm:splitserve_exposed_handoff_seconds``
  histogram (server timestamps);
- ``on_first_token`` (flows through the proxy): 1 when D completed the load on the first token
  P's engine relayed (``FIRST_TOKEN``), not on P's DONE (pull with the first-token flow);
- ``plain_fallback`` (flows through the proxy): 1 when the proxy served the request in the
  plain flow after P's answer (first-token flow: P's token had no text of its own, or a stop
  string could span the seam; ``splitserve_proxy_first_token_fallbacks_total``); the summary
  counts them (``plain_fallbacks``);
- ``p_post_s`` / ``d_post_s`` (flows through the proxy): seconds P and D spent inside their
  transfer posts for the request (``vllm:splitserve_post_seconds_total``): push, P's WRITEs
  (over ``cma`` the copy, on P's core); pull, P's ANNOUNCE sends and D's READs (the copy, on
  D's core).

The summary adds, per length, TTFT relative to ``colocated`` and the gap beyond colocated's
(one decode step), the figures the first-token flow's targets are stated in: TTFT within 2% of
colocated, token 2 within one layer's transfer plus one decode step of token 1.

Dispatch goes through ``splitserve.proxy.dispatch`` like the proxy. Output: a JSON file, a
markdown table on stdout and, when matplotlib is importable, a PNG next to the JSON.

    python benchmarks/handoff.py --lengths 512 1024 2048 4096 --repeats 3 \\
        --transports default tcp --out results/handoff.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec
from splitserve.netutil import free_ports
from splitserve.proxy import dispatch
from splitserve.proxy.config import build_config
from splitserve.proxy.server import BackgroundProxy

START_TIMEOUT = 900.0
# Connector stats ride on the engines' step outputs to the API server: a pause after a request
# before reading them lets the last step's arrive.
STATS_SETTLE_S = 0.5


# ----------------------------------------------------------------------------- HTTP


def post_json(url: str, body: dict, timeout: float = 600.0) -> tuple[dict, float]:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.loads(response.read())
    return answer, time.perf_counter()


def token_times(url: str, body: dict, timeout: float = 600.0) -> tuple[float, float]:
    """Stream ``body``; perf_counter times of the first two token chunks (vLLM sends one chunk
    per token, also when a token's text is still empty; a server that fell behind merges
    tokens into one chunk, and then token 2 came with token 1: both times are that chunk's)."""
    body = dict(body, stream=True)
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    times: list[float] = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if len(times) < 2 and line.startswith("data: {"):
                now = time.perf_counter()
                if json.loads(line[6:]).get("choices"):
                    times.append(now)
    if not times:
        raise RuntimeError(f"{url}: no token streamed")
    return times[0], times[-1]


def metrics_text(url: str) -> str:
    """``url``'s ``/metrics`` page (read once per server per moment, then parsed)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return response.read().decode()


def sample_sum(text: str, name: str) -> float:
    """Sample ``name`` of a metrics page, summed over its label sets (0 when absent)."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$"
    return sum(float(m) for m in re.findall(pattern, text, flags=re.M))


def histogram_in(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` on a metrics page."""
    return sample_sum(text, name + "_sum"), sample_sum(text, name + "_count")


def histogram(url: str, name: str) -> tuple[float, float]:
    return histogram_in(metrics_text(url), name)


# ----------------------------------------------------------------------------- servers


def splitserve_kv(side_port: int, direction: str = "auto") -> dict:
    extra: dict[str, Any] = {
        "side_channel_port": side_port,
        # Generous deadlines: a loaded machine must show up as slow, not as failed loads.
        "lease_s": 600,
        "done_timeout_s": 900,
    }
    if direction != "auto":
        extra["direction"] = direction
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def nixl_kv(connector: str, role: str) -> dict:
    """Stock connector config. ``NixlPushConnector`` is one-way (P a producer, D a consumer),
    holds P's blocks for ``kv_lease_duration`` (prefill here takes up to a minute) and fails a
    D that no push reached within ``push_registration_timeout``."""
    if connector != "NixlPushConnector":
        return {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return {
        "kv_connector": connector,
        "kv_role": "kv_producer" if role == "p" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 600, "push_registration_timeout": 300},
    }


def start_pair(
    group: ServerGroup,
    name: str,
    model: Path,
    kind: str,
    env: dict,
    max_len: int = 8192,
    kv_gib: int = 4,
    direction: str = "auto",
) -> dict:
    """P on core 0, D on core 1; returns urls and P's side channel port.

    Each server's whole process tree is pinned to its core (not only its OpenMP threads), as
    if P and D were separate hosts: a D whose requests wait for KV steps vLLM's engine loop
    and its shared-memory queues busy-poll for a second after every message, which on a
    shared core would slow P's prefill (measured: 23 s instead of 13.5 s at 2048 tokens).
    The colocated row uses the same P server, so it gets the same one core."""
    http = free_ports(2)
    side = free_ports(2)
    extra = ["--max-model-len", str(max_len), "--max-num-batched-tokens", "2048"]
    servers = {}
    for role, core in (("p", 0), ("d", 1)):
        server_env = dict(env, VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
        if kind == "splitserve":
            kv = splitserve_kv(side[core], direction)
        else:
            kv = nixl_kv(kind, role)
            server_env.update(
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(side[core]),
            )
        servers[role] = group.add_vllm(
            f"{name}-{role}",
            str(model),
            port=http[core],
            served_model_name="bench",
            kv_transfer_config=kv,
            extra_args=extra,
            cpu_core=core,
            cpus=[core],
            env=server_env,
        )
    group.wait(START_TIMEOUT, names=[f"{name}-p", f"{name}-d"])
    return {"p": servers["p"].url, "d": servers["d"].url, "p_side": side[0]}


# ----------------------------------------------------------------------------- one request


def request_body(length: int, rng: random.Random) -> dict:
    prompt = [rng.randrange(5, 1000) for _ in range(length)]
    # ignore_eos: a random model may sample EOS; three tokens give the first two gaps.
    return {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }


def run_colocated(pair: dict, body: dict) -> dict:
    """``step_s``: the server's own mean decode step for this request (its decode time over its
    two decode steps), the figure a first-token flow's ``d_step_s`` compares with."""
    decode = "vllm:request_decode_time_seconds"
    before = histogram(pair["p"], decode)
    start = time.perf_counter()
    first, second = token_times(pair["p"], body)
    after = histogram(pair["p"], decode)
    return {"ttft_s": first - start, "gap_s": second - first, "step_s": (after[0] - before[0]) / 2}


def run_proxied(pair: dict, body: dict, proxy_url: str) -> dict:
    """Through the splitserve proxy (concurrent flow), as a client sees it. ``after_p_s``: the
    client's TTFT minus P's answer time as the proxy measured it (its
    ``splitserve_proxy_prefill_seconds``): what the client waits beyond P's prefill, a figure
    that a slow or noisy prefill does not blur."""
    name = "vllm:splitserve_exposed_handoff_seconds"
    # D's "prefill time" (scheduled, i.e. KV loaded, to its first token): the one step D runs
    # before its first token (first-token flow: the step that samples token 2).
    d_step = "vllm:request_prefill_time_seconds"
    # P's time inside WRITE posts (over cma: the copy itself, on P's core).
    post = "vllm:splitserve_post_seconds_total"
    # D's loads completed on P's relayed FIRST_TOKEN instead of its DONE (pull, first token).
    early = "vllm:splitserve_loads_completed_on_first_token_total"
    d_text, post_before = metrics_text(pair["d"]), sample_sum(metrics_text(pair["p"]), post)
    before, d_before = histogram_in(d_text, name), histogram_in(d_text, d_step)
    d_post_before, early_before = sample_sum(d_text, post), sample_sum(d_text, early)
    fallbacks = "splitserve_proxy_first_token_fallbacks_total"
    proxy_text = metrics_text(proxy_url)
    p_before = histogram_in(proxy_text, "splitserve_proxy_prefill_seconds")
    fallbacks_before = sample_sum(proxy_text, fallbacks)
    start = time.perf_counter()
    first, second = token_times(proxy_url, body)
    proxy_text = metrics_text(proxy_url)
    p_after = histogram_in(proxy_text, "splitserve_proxy_prefill_seconds")
    time.sleep(STATS_SETTLE_S)
    d_text = metrics_text(pair["d"])
    after, d_after = histogram_in(d_text, name), histogram_in(d_text, d_step)
    p_post = sample_sum(metrics_text(pair["p"]), post) - post_before
    d_post = sample_sum(d_text, post) - d_post_before
    exposed = (after[0] - before[0]) / max(after[1] - before[1], 1)
    prefill = p_after[0] - p_before[0]
    return {
        "ttft_s": first - start,
        "gap_s": second - first,
        "after_p_s": first - start - prefill,
        "exposed_s": exposed,
        "d_step_s": d_after[0] - d_before[0],
        "p_post_s": p_post,
        "d_post_s": d_post,
        "on_first_token": sample_sum(d_text, early) - early_before,
        "plain_fallback": sample_sum(proxy_text, fallbacks) - fallbacks_before,
    }


def run_sequential(pair: dict, body: dict, ours: bool) -> dict:
    name = "vllm:splitserve_exposed_handoff_seconds"
    before = histogram(pair["d"], name) if ours else None
    start = time.perf_counter()
    tid = dispatch.new_transfer_id()  # also the request id on P and D (NixlPushConnector)
    p_answer, p_done = post_json(pair["p"], dispatch.vllm_sequential_prefill_request(body, tid))
    d_body = dispatch.vllm_sequential_decode_request(body, p_answer, tid)
    first, second = token_times(pair["d"], d_body)
    out = {"ttft_s": first - start, "gap_s": second - first, "handoff_s": first - p_done}
    if ours:
        after = histogram(pair["d"], name)
        out["exposed_s"] = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return out


def start_proxy(pair: dict, first_token: bool, started: list) -> str:
    """A splitserve proxy (concurrent flow) in this process, in front of the pair."""
    config = build_config(
        {
            "port": 0,
            "flow": "concurrent",
            "first_token_from_prefill": first_token,
            "prefill": [{"url": pair["p"], "side_channel_port": pair["p_side"]}],
            "decode": [{"url": pair["d"]}],
        }
    )
    proxy = BackgroundProxy(config).start()
    started.append(proxy)
    return proxy.url


# ----------------------------------------------------------------------------- main


def nixl_push_available() -> bool:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.get_connector_class_by_name("NixlPushConnector")
        return True
    except (ImportError, ValueError):
        return False


def summarize(rows: list[dict]) -> list[dict]:
    table: dict[tuple, list[dict]] = {}
    for row in rows:
        table.setdefault((row["transport"], row["contender"], row["length"]), []).append(row)
    out = []
    for (transport, contender, length), group in sorted(table.items()):
        entry = {"transport": transport, "contender": contender, "length": length}
        keys = (
            "ttft_s",
            "gap_s",
            "after_p_s",
            "handoff_s",
            "exposed_s",
            "p_post_s",
            "d_post_s",
            "on_first_token",
        )
        for key in keys:
            values = [r[key] for r in group if key in r]
            if values:
                entry[key] = statistics.median(values)
        # Token 1 -> 2 beyond the decode step that produced token 2, per request (D's own step
        # for a first-token flow, the server's mean decode step for colocated): what the seam
        # costs, free of the step-to-step noise that comparing two requests' gaps carries.
        beyond = [
            r["gap_s"] - r.get("d_step_s", r.get("step_s", 0.0))
            for r in group
            if "gap_s" in r and ("d_step_s" in r or "step_s" in r)
        ]
        if beyond:
            entry["gap_beyond_step_s"] = statistics.median(beyond)
        if any("plain_fallback" in r for r in group):
            entry["plain_fallbacks"] = int(sum(r.get("plain_fallback", 0) for r in group))
        out.append(entry)
    colocated = {(e["transport"], e["length"]): e for e in out if e["contender"] == "colocated"}
    for e in out:
        ref = colocated.get((e["transport"], e["length"]))
        if ref is None or e is ref:
            continue
        e["ttft_vs_colocated"] = e["ttft_s"] / ref["ttft_s"] - 1.0
        if "gap_s" in e and "gap_s" in ref:
            e["gap_beyond_colocated_s"] = e["gap_s"] - ref["gap_s"]
    return out


def measure_links(transports: list[str]) -> dict[str, dict]:
    """NIXL WRITE bandwidth between two processes per transport (host memory, target pinned to
    D's core): the bulk-transfer figure the layer-wise target is stated in."""
    import os

    from splitserve.planner.nixl_probe import measure_nixl_bandwidth

    links = {}
    for transport in transports:
        saved = os.environ.get("UCX_TLS")
        if transport == "tcp":
            os.environ["UCX_TLS"] = "tcp"
        try:
            bw = measure_nixl_bandwidth([1 << 20, 256 << 20], runs=3, cpu_core=1)
            links[transport] = {"bytes_per_s": bw.bytes_per_s, "fixed_s": bw.per_transfer_s}
        except Exception as exc:  # a figure we cannot get is reported, not fatal
            print(f"NIXL bandwidth probe ({transport}) failed: {exc}", file=sys.stderr)
        finally:
            if saved is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = saved
    return links


def targets(summary: list[dict], links: dict[str, dict], model: str = "bench") -> list[dict]:
    """The connector's targets per transport and length: exposed handoff (concurrent flow) within
    bulk transfer / layers + 2 ms, and what the client waits beyond P's answer at most 0.25x
    stock ``NixlConnector``'s (both "P answer -> D's first token")."""
    spec = resolve_spec(model)
    per_token = spec.kv_bytes_per_token()
    by = {(e["transport"], e["contender"], e["length"]): e for e in summary}
    out = []
    for transport, length in sorted({(e["transport"], e["length"]) for e in summary}):
        ours = by.get((transport, "splitserve-concurrent", length))
        first = by.get((transport, "splitserve-first-token", length))
        if ours is None and first is None:
            continue
        row: dict[str, Any] = {"transport": transport, "length": length}
        link = links.get(transport)
        if link:
            bulk = link["fixed_s"] + length * per_token / link["bytes_per_s"]
            row["bulk_s"] = bulk
            row["bound_s"] = bulk / spec.num_layers + 0.002
        if link and ours is not None and "exposed_s" in ours:
            row["exposed_s"] = ours["exposed_s"]
            row["exposed_ok"] = ours["exposed_s"] <= row["bound_s"]
        if first is not None:  # the first-token option's targets
            if "ttft_vs_colocated" in first:
                row["first_token_ttft_vs_colocated"] = first["ttft_vs_colocated"]
                row["first_token_ttft_ok"] = first["ttft_vs_colocated"] <= 0.02
            if "gap_beyond_colocated_s" in first:
                row["token2_beyond_s"] = first["gap_beyond_colocated_s"]
            if link:
                row["one_layer_s"] = row["bulk_s"] / spec.num_layers
                # "Token 2 within one layer's transfer plus one decode step of token 1": the
                # decode step is the one D ran for token 2 (per request); runs before 2026-12-01
                # 10:00 compared with colocated's gap instead (noise of +-10 ms per step).
                if "gap_beyond_step_s" in first:
                    row["token2_beyond_step_s"] = first["gap_beyond_step_s"]
                    row["token2_ok"] = first["gap_beyond_step_s"] <= row["one_layer_s"]
                elif "gap_beyond_colocated_s" in first:
                    row["token2_ok"] = first["gap_beyond_colocated_s"] <= row["one_layer_s"]
        stock = by.get((transport, "nixl", length))
        if stock and ours is not None and "handoff_s" in stock and "after_p_s" in ours:
            row["after_p_s"] = ours["after_p_s"]
            row["nixl_handoff_s"] = stock["handoff_s"]
            row["vs_nixl"] = ours["after_p_s"] / stock["handoff_s"]
            row["vs_nixl_ok"] = row["vs_nixl"] <= 0.25
        out.append(row)
    return out


def _ms(row: dict, key: str) -> str:
    """A seconds figure of a table row in milliseconds, "-" where the row has none."""
    return f"{1e3 * row[key]:.1f}" if key in row else "-"


def targets_markdown(rows: list[dict]) -> str:
    lines = [
        "| transport | prompt | bulk transfer ms | bound: bulk/layers + 2 ms | exposed ms | met | "
        "ours: P answer -> D 1st token ms | NixlConnector ms | ratio | <= 0.25x | "
        "first token: TTFT vs colocated | <= 2% | token 2 beyond colocated ms | "
        "token 2 beyond D's step ms | one layer ms | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def ms(key, r=r):
            return _ms(r, key)

        def ok(key, r=r):
            return ("yes" if r[key] else "no") if key in r else "-"

        ratio = f"{r['vs_nixl']:.3f}" if "vs_nixl" in r else "-"
        key = "first_token_ttft_vs_colocated"
        pct = f"{100 * r[key]:+.1f}%" if key in r else "-"
        lines.append(
            f"| {r['transport']} | {r['length']} | {ms('bulk_s')} | {ms('bound_s')} | "
            f"{ms('exposed_s')} | {ok('exposed_ok')} | {ms('after_p_s')} | "
            f"{ms('nixl_handoff_s')} | {ratio} | {ok('vs_nixl_ok')} | {pct} | "
            f"{ok('first_token_ttft_ok')} | {ms('token2_beyond_s')} | "
            f"{ms('token2_beyond_step_s')} | {ms('one_layer_s')} | "
            f"{ok('token2_ok')} |"
        )
    return "\n".join(lines)


def markdown(summary: list[dict]) -> str:
    lines = [
        "| transport | contender | prompt | TTFT ms | TTFT vs colocated | token 1 -> 2 ms | "
        "gap beyond colocated ms | gap beyond its own decode step ms | "
        "TTFT beyond P's answer ms | P answer -> D 1st token ms | "
        "exposed (forward end -> DONE) ms | P's posts ms | D's posts ms | plain fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:

        def ms(key, e=e):
            return _ms(e, key)

        vs = f"{100 * e['ttft_vs_colocated']:+.1f}%" if "ttft_vs_colocated" in e else "-"
        lines.append(
            f"| {e['transport']} | {e['contender']} | {e['length']} | {ms('ttft_s')} | {vs} | "
            f"{ms('gap_s')} | {ms('gap_beyond_colocated_s')} | {ms('gap_beyond_step_s')} | "
            f"{ms('after_p_s')} | "
            f"{ms('handoff_s')} | "
            f"{ms('exposed_s')} | {ms('p_post_s')} | {ms('d_post_s')} | "
            f"{e.get('plain_fallbacks', '-')} |"
        )
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    transports = sorted({e["transport"] for e in summary})
    fig, axes = plt.subplots(1, len(transports), figsize=(6 * len(transports), 4), squeeze=False)
    contenders = sorted({e["contender"] for e in summary})
    colors = {c: f"C{i}" for i, c in enumerate(contenders)}  # one color per contender
    for ax, transport in zip(axes[0], transports, strict=True):
        for contender in contenders:
            # What the client waits beyond P's answer: measured at the client for the direct
            # sequential flows, through the proxy for the concurrent ones.
            points = [
                (e["length"], 1e3 * e.get("handoff_s", e.get("after_p_s", 0.0)))
                for e in summary
                if e["transport"] == transport
                and e["contender"] == contender
                and ("handoff_s" in e or "after_p_s" in e)
            ]
            if points:
                ax.plot(
                    *zip(*points, strict=True), marker="o", label=contender, color=colors[contender]
                )
        ax.set_title(f"beyond P's answer to D's first token ({transport})")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms (log)")
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["default", "tcp"])
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=[
            "colocated",
            "splitserve-concurrent",
            "splitserve-first-token",
            "splitserve-first-token-push",
            "splitserve-sequential",
            "nixl",
            "nixl-push",
            "sglang-colocated",
            "sglang-splitserve",
            "sglang-nixl",
            "sglang-mooncake-tcp",
        ],
    )
    parser.add_argument("--out", type=Path, default=Path("results/handoff.json"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="VLLM_CPU_KVCACHE_SPACE per server (the bench model needs 256 KiB per token; "
        "2 is enough for prompts up to 2048 on a shared 24 GiB machine)",
    )
    parser.add_argument(
        "--resummarize",
        type=Path,
        help="summarize the rows of an earlier run's JSON (measuring the links now) and exit",
    )
    args = parser.parse_args(argv)
    if args.resummarize:
        return resummarize(args)
    # A plain kill (SIGTERM) must still stop the servers this run started (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Room for the longest prompt and its tokens, in whole blocks (vLLM checks it fits the KV).
    max_len = max(1024, 2 * max(args.lengths))

    work = Path(tempfile.mkdtemp(prefix="splitserve-handoff-"))
    model = build_model(resolve_spec("bench"), work / "bench")
    rng = random.Random(args.seed)
    contenders = list(args.contenders)
    if "nixl-push" in contenders and not nixl_push_available():
        print("NixlPushConnector is not in this vLLM: skipped", file=sys.stderr)
        contenders.remove("nixl-push")
    rows: list[dict[str, Any]] = []
    for transport in args.transports:
        env = {"UCX_TLS": "tcp"} if transport == "tcp" else {}
        kinds = []
        ours = {
            "colocated",
            "splitserve-concurrent",
            "splitserve-first-token",
            "splitserve-sequential",
        }
        if ours & set(contenders):
            kinds.append("splitserve")
        if "splitserve-first-token-push" in contenders:
            kinds.append("splitserve-push")
        kinds += [k for k in ("nixl", "nixl-push") if k in contenders]
        for kind in kinds:
            group = ServerGroup(work / f"logs-{transport}-{kind}")
            connector = {
                "nixl": "NixlConnector",
                "nixl-push": "NixlPushConnector",
                "splitserve-push": "splitserve",
            }.get(kind, kind)
            direction = "push" if kind == "splitserve-push" else "auto"
            proxies: list[BackgroundProxy] = []
            try:
                pair = start_pair(
                    group,
                    f"{kind}-{transport}",
                    model,
                    connector,
                    env,
                    max_len,
                    args.kv_cache_gib,
                    direction,
                )
                if kind == "splitserve-push":
                    first = start_proxy(pair, True, proxies)
                    runs = {
                        "splitserve-first-token-push": lambda p, b, u=first: run_proxied(p, b, u)
                    }
                elif kind == "splitserve":
                    plain, first = (start_proxy(pair, on, proxies) for on in (False, True))
                    runs = {
                        "colocated": run_colocated,
                        "splitserve-concurrent": lambda p, b, u=plain: run_proxied(p, b, u),
                        "splitserve-first-token": lambda p, b, u=first: run_proxied(p, b, u),
                        "splitserve-sequential": lambda p, b: run_sequential(p, b, True),
                    }
                else:
                    runs = {kind: lambda p, b: run_sequential(p, b, False)}
                runs = {name: fn for name, fn in runs.items() if name in contenders}
                run_sequential(pair, request_body(64, rng), connector == "splitserve")  # warm-up
                for fn in runs.values():
                    fn(pair, request_body(64, rng))  # warm-up of each path
                for length in args.lengths:
                    for repeat in range(args.repeats):
                        # Every other repeat runs the contenders in reverse order, so that no
                        # contender always follows the same one (warm caches, a D's leftovers).
                        order = list(runs.items())
                        for name, fn in order if repeat % 2 == 0 else order[::-1]:
                            result = fn(pair, request_body(length, rng))
                            rows.append(
                                {"transport": transport, "contender": name, "length": length}
                                | result
                            )
                            print(json.dumps(rows[-1]), flush=True)
                            partial = {"command": "(partial)", "rows": rows}
                            args.out.parent.mkdir(parents=True, exist_ok=True)
                            args.out.write_text(json.dumps(partial, indent=1))
            finally:
                for proxy in proxies:
                    proxy.stop()
                group.stop()
    import handoff_sglang  # benchmarks/handoff_sglang.py, next to this script

    rows += handoff_sglang.rows_for(args, work, model, rng)
    command = "python benchmarks/handoff.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report(rows, command, args.out, measure_links(args.transports))
    return 0


def report(rows: list[dict], command: str, out: Path, links: dict[str, dict]) -> None:
    import handoff_sglang  # benchmarks/handoff_sglang.py, next to this script

    summary = handoff_sglang.relative_to_colocated(summarize(rows))
    goals = targets(summary, links)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": command,
                "rows": rows,
                "summary": summary,
                "links": links,
                "targets": goals,
            },
            indent=1,
        )
    )
    print(markdown(summary))
    print()
    print(targets_markdown(goals))
    if plot(summary, out.with_suffix(".png")):
        print(f"plot: {out.with_suffix('.png')}")


def resummarize(args: argparse.Namespace) -> int:
    earlier = json.loads(args.resummarize.read_text())
    rows = earlier["rows"]
    transports = sorted({r["transport"] for r in rows})
    command = earlier.get("command", "(partial)")
    report(rows, command, args.out, earlier.get("links") or measure_links(transports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
