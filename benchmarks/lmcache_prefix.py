"""Shared prefix across a prefill pool: LMCache's shared tier against none, one run.

A 2-P pool and one D (model preset ``mid``: a 4,000-token prefill takes seconds on one core),
the concurrent flow (D registers while P computes, KV streamed per layer), requests one at a
time, each a shared ``--prefix`` of random token ids followed by a fresh 64-token question,
sent to P1, P2, P1, P2 ... (what least-outstanding routing does with one request at a time):

- ``shared-tier``: both P servers run vLLM's ``MultiConnector`` of LMCache (our CPU shim) and
  ``SplitserveConnector``, sharing LMCache's own cache server (a ``lmcache:`` section with a
  ``remote`` tier, as ``splitserve up`` starts it); request 2 on P2 loads the prefix P1 stored;
- ``no-tier``: the same pool with ``SplitserveConnector`` alone; each P has only its own vLLM
  prefix cache, so request 2 on P2 computes the prefix again (from request 3 on, each P hits
  its own cache);
- ``one-p``: the no-tier pool with every request on P1 (what the proxy's ``prefix_affinity``
  does): the best a single server's cache can do, and the load it concentrates on one P.

Per request: TTFT at the client (D's first streamed token), P's answer time, the tokens P loaded
from a connector (vLLM's ``external_prefix_cache_hits``) and computed
(``request_prefill_kv_computed_tokens``), and D's exposed handoff (forward end -> DONE, our
connector's histogram). Greedy answers are not checked here (``tests/integration/test_lmcache.py``
checks them against a colocated server). LMCache's own P/D mode is not a contender: its vLLM
P/D path needs its NIXL channel on a GPU (docs/lmcache.md).

    flock /tmp/splitserve-integration.lock .venv/bin/python benchmarks/lmcache_prefix.py \\
        --prefix 4000 --requests 6 --out results/lmcache_prefix.json
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.metrics import histogram_in, metrics_text, sample_sum
from handoffbench.client import token_times

from splitserve.connectors.lmcache.settings import LMCacheSettings, composed_kv_config
from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec
from splitserve.netutil import free_ports
from splitserve.proxy import dispatch

START_TIMEOUT = 900.0
QUESTION = 64
CHUNK = 256
EXPOSED = "vllm:splitserve_exposed_handoff_seconds"
HITS = "vllm:external_prefix_cache_hits_total"
COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"
CONTENDERS = ["shared-tier", "no-tier", "one-p"]


def splitserve_kv(side_port: int) -> dict:
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "side_channel_port": side_port,
            "lease_s": 600,
            "done_timeout_s": 900,
        },
    }


def start_pool(group: ServerGroup, model: Path, tier: LMCacheSettings | None) -> dict:
    """P1 and P2 on core 0 (one computes at a time: requests go one by one), D alone on core 1
    (a D waiting for KV steps continuously: beside a P it slowed that P's prefill 5x, 30.8 s
    against 5.9 s for the same 4,064 tokens); P servers composed with LMCache when ``tier``."""
    http, side = free_ports(3), free_ports(3)
    args = ["--max-model-len", "8192", "--max-num-batched-tokens", "2048"]
    urls = {}
    for i, (name, core) in enumerate((("p1", 0), ("p2", 0), ("d", 1))):
        kv = splitserve_kv(side[i])
        # dev mode: /reset_prefix_cache between contenders that share a pool
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_SERVER_DEV_MODE": "1"}
        if tier is not None and name != "d":
            kv, env = composed_kv_config(kv), {**env, **tier.env()}
        server = group.add_vllm(
            name,
            str(model),
            port=http[i],
            served_model_name="mid",
            kv_transfer_config=kv,
            extra_args=args,
            cpu_core=core,
            cpus=[core],
            env=env,
        )
        urls[name] = server.url
    group.wait(START_TIMEOUT, names=["p1", "p2", "d"])
    return {**urls, "p1_side": side[0], "p2_side": side[1]}


def start_tier(group: ServerGroup) -> LMCacheSettings:
    """LMCache's cache server as the pool's shared tier (a TCP server: ready once bound)."""
    port = free_ports(1)[0]
    tier = LMCacheSettings(chunk_size=CHUNK, remote={"port": port})
    group.add("lmcache-server", tier.remote.argv(), port=port, ready_path=None)
    group.wait(120.0, names=["lmcache-server"])
    return tier


def one_request(pool: dict, p: str, prompt: list[int]) -> dict:
    """P and D at once (the concurrent flow); D streamed: TTFT is D's first token."""
    body = {"model": "mid", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    body["ignore_eos"] = True
    prefill, decode = dispatch.vllm_concurrent_requests(
        body, dispatch.new_transfer_id(), "127.0.0.1", pool[f"{p}_side"]
    )
    p_before, d_before = metrics_text(pool[p]), metrics_text(pool["d"])
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as workers:
        d_future = workers.submit(token_times, pool["d"], decode)
        p_done = workers.submit(post_timed, pool[p], prefill).result()
        first, _ = d_future.result()
    time.sleep(0.5)  # the last step's stats reach /metrics with the engine's next output
    p_after, d_after = metrics_text(pool[p]), metrics_text(pool["d"])
    (sum_after, n_after), (sum_before, n_before) = (
        histogram_in(d_after, EXPOSED),
        histogram_in(d_before, EXPOSED),
    )
    return {
        "p": p,
        "ttft_s": first - start,
        "p_answer_s": p_done - start,
        "loaded_tokens": sample_sum(p_after, HITS) - sample_sum(p_before, HITS),
        "computed_tokens": sample_sum(p_after, COMPUTED) - sample_sum(p_before, COMPUTED),
        "exposed_s": (sum_after - sum_before) / max(n_after - n_before, 1),
    }


def post_timed(url: str, body: dict) -> float:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=900) as response:
        answer = json.loads(response.read())
    if "choices" not in answer:
        raise RuntimeError(f"{url}: {answer}")
    return time.perf_counter()


def run_contender(name: str, pool: dict, args: argparse.Namespace, rows: list[dict]) -> None:
    rng = random.Random(args.seed)  # the same prefix and questions for every contender
    prefix = [rng.randrange(5, 1000) for _ in range(args.prefix)]
    for index in range(1, args.requests + 1):
        question = [rng.randrange(5, 1000) for _ in range(QUESTION)]
        p = "p1" if name == "one-p" or index % 2 else "p2"
        row = {"contender": name, "request": index} | one_request(pool, p, prefix + question)
        rows.append(row)
        print(json.dumps(row), flush=True)
        # spaced arrivals, the same for every contender: LMCache's puts to the tier are
        # asynchronous, and a request right behind the one that stored the prefix may miss it
        time.sleep(args.settle_s)


def warm(pool: dict, rng: random.Random) -> None:
    """One short request per P (first forwards, the P -> D peers met) before measuring."""
    for p in ("p1", "p2"):
        one_request(pool, p, [rng.randrange(5, 1000) for _ in range(64)])


def table(rows: list[dict]) -> str:
    lines = [
        "| contender | request | P | TTFT ms | P answer ms | loaded from connector | computed | "
        "exposed ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['request']} | {r['p']} | {r['ttft_s'] * 1000:.0f} | "
            f"{r['p_answer_s'] * 1000:.0f} | {r['loaded_tokens']:.0f} | "
            f"{r['computed_tokens']:.0f} | {r['exposed_s'] * 1000:.1f} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Per contender: TTFT of request 1 (the prefix computed cold), of the first request on each
    other P (where a shared tier can help: in a 2-P pool, request 2), and the median of the rest
    (each P's own prefix cache); the first-visit figure against ``no-tier``'s."""
    out = [
        "| contender | request 1 ms | first request on another P ms | vs no-tier | median of "
        "the rest ms |",
        "|---|---:|---:|---:|---:|",
    ]
    figures = {}
    for c in dict.fromkeys(r["contender"] for r in rows):
        mine = sorted((r for r in rows if r["contender"] == c), key=lambda r: r["request"])
        seen, first_visits, rest = {mine[0]["p"]}, [], []
        for r in mine[1:]:
            (rest if r["p"] in seen else first_visits).append(r["ttft_s"])
            seen.add(r["p"])
        visit = statistics.median(first_visits) if first_visits else None
        figures[c] = (mine[0]["ttft_s"], visit, statistics.median(rest) if rest else None)
    base = figures.get("no-tier", (None, None, None))[1]
    for c, (first, visit, rest) in figures.items():
        ratio = f"{visit / base:.2f}x" if visit is not None and base else "-"
        shown = [f"{v * 1000:.0f}" if v is not None else "-" for v in (first, visit, rest)]
        out.append(f"| {c} | {shown[0]} | {shown[1]} | {ratio} | {shown[2]} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=4000, help="shared prefix tokens")
    parser.add_argument("--requests", type=int, default=6, help="requests per contender")
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause between requests")
    parser.add_argument("--out", type=Path, default=Path("results/lmcache_prefix.json"))
    args = parser.parse_args(argv)
    if args.prefix + QUESTION + 2 > 8192 or args.requests < 2:
        parser.error("--prefix must leave room for the question in 8192 tokens; --requests >= 2")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks still run
    work = Path(tempfile.mkdtemp(prefix="splitserve-lmcache-"))
    model = build_model(resolve_spec("mid"), work / "mid")
    rows: list[dict] = []
    rng = random.Random(args.seed + 1)
    if "shared-tier" in args.contenders:
        group = ServerGroup(work / "logs-shared-tier")
        try:
            pool = start_pool(group, model, start_tier(group))
            warm(pool, rng)
            run_contender("shared-tier", pool, args, rows)
        finally:
            group.stop()
    plain = [c for c in ("no-tier", "one-p") if c in args.contenders]
    if plain:
        group = ServerGroup(work / "logs-no-tier")
        try:
            pool = start_pool(group, model, None)
            warm(pool, rng)
            for i, name in enumerate(plain):
                if i:  # a fresh prefix cache: the next contender starts cold, as the first did
                    for p in ("p1", "p2", "d"):
                        reset_prefix_cache(pool[p])
                run_contender(name, pool, args, rows)
        finally:
            group.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/lmcache_prefix.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print(table(rows))
    print()
    print(summary(rows))
    print(f"logs: {work}")
    return 0


def reset_prefix_cache(url: str) -> None:
    """Empty a server's prefix cache (vLLM dev mode: ``VLLM_SERVER_DEV_MODE``)."""
    request = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


if __name__ == "__main__":
    sys.exit(main())
