"""Every selected vLLM contender on every transport: one P/D pair per connector kind, its
contenders' flows over it, and one row per request (written out as they come).

A kind is a pair of servers: ``splitserve`` (``colocated``, both proxied flows and the
sequential flow share it), ``splitserve-push`` (the first-token flow with ``"direction":
"push"``), ``nixl`` and ``nixl-push`` (stock connectors, sequential flow), and the
heterogeneous tensor-parallel pairs ``splitserve-tp2`` (P TP 2 -> D TP 1, the concurrent flow
through the proxy) and ``nixl-tp2`` (the same sizes with the stock ``NixlConnector``,
sequential flow).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from handoffbench.client import request_body
from handoffbench.flows import run_colocated, run_proxied, run_sequential
from handoffbench.servers import start_pair, start_proxy
from splitserve.launch.group import ServerGroup

# The contenders the ``splitserve`` pair serves.
SPLITSERVE_PAIR = {
    "colocated",
    "splitserve-concurrent",
    "splitserve-first-token",
    "splitserve-sequential",
}
# The connector each kind's servers run (a kind not listed runs the connector of its name).
CONNECTORS = {
    "nixl": "NixlConnector",
    "nixl-push": "NixlPushConnector",
    "splitserve-push": "splitserve",
    "splitserve-tp2": "splitserve",
    "nixl-tp2": "NixlConnector",
}
# Kinds whose P runs tensor parallel 2 (D TP 1).
PREFILL_TP = {"splitserve-tp2": 2, "nixl-tp2": 2}
Flow = Callable[[dict, dict], dict]


def server_kinds(contenders: list[str]) -> list[str]:
    """The pairs the contenders need, in the order they start."""
    kinds = []
    if SPLITSERVE_PAIR & set(contenders):
        kinds.append("splitserve")
    if "splitserve-first-token-push" in contenders:
        kinds.append("splitserve-push")
    kinds += [k for k in ("nixl", "nixl-push", "splitserve-tp2", "nixl-tp2") if k in contenders]
    return kinds


def flows(kind: str, pair: dict, proxies: list) -> dict[str, Flow]:
    """Each contender's flow over the ``kind`` pair (starting the proxies it needs)."""
    if kind == "splitserve-push":
        first = start_proxy(pair, True, proxies)
        return {"splitserve-first-token-push": lambda p, b, u=first: run_proxied(p, b, u)}
    if kind == "splitserve-tp2":
        plain = start_proxy(pair, False, proxies)
        return {kind: lambda p, b, u=plain: run_proxied(p, b, u)}
    if kind == "splitserve":
        plain, first = (start_proxy(pair, on, proxies) for on in (False, True))
        return {
            "colocated": run_colocated,
            "splitserve-concurrent": lambda p, b, u=plain: run_proxied(p, b, u),
            "splitserve-first-token": lambda p, b, u=first: run_proxied(p, b, u),
            "splitserve-sequential": lambda p, b: run_sequential(p, b, True),
        }
    return {kind: lambda p, b: run_sequential(p, b, False)}


def write_partial(out: Path, rows: list[dict]) -> None:
    """The rows so far: a run cut short keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "(partial)", "rows": rows}, indent=1))


def measure_pair(
    runs: dict[str, Flow],
    pair: dict,
    transport: str,
    args: argparse.Namespace,
    rng: random.Random,
    rows: list[dict],
) -> None:
    """``args.repeats`` requests per length and contender over one pair, appended to ``rows``."""
    for length in args.lengths:
        for repeat in range(args.repeats):
            # Every other repeat runs the contenders in reverse order, so that no contender
            # always follows the same one (warm caches, a D's leftovers).
            order = list(runs.items())
            for name, fn in order if repeat % 2 == 0 else order[::-1]:
                result = fn(pair, request_body(length, rng))
                rows.append({"transport": transport, "contender": name, "length": length} | result)
                print(json.dumps(rows[-1]), flush=True)
                write_partial(args.out, rows)


def vllm_rows(
    args: argparse.Namespace,
    contenders: list[str],
    work: Path,
    model: Path,
    rng: random.Random,
) -> list[dict[str, Any]]:
    """The vLLM rows: per transport, per kind, a pair, warm-ups, then the measured requests."""
    # Room for the longest prompt and its tokens, in whole blocks (vLLM checks it fits the KV).
    max_len = max(1024, 2 * max(args.lengths))
    rows: list[dict[str, Any]] = []
    for transport in args.transports:
        env = {"UCX_TLS": "tcp"} if transport == "tcp" else {}
        for kind in server_kinds(contenders):
            group = ServerGroup(work / f"logs-{transport}-{kind}")
            connector = CONNECTORS.get(kind, kind)
            direction = "push" if kind == "splitserve-push" else "auto"
            proxies: list = []
            try:
                pair = start_pair(
                    group, f"{kind}-{transport}", model, connector, env, max_len,
                    args.kv_cache_gib, direction, PREFILL_TP.get(kind, 1),
                )  # fmt: skip
                runs = {n: fn for n, fn in flows(kind, pair, proxies).items() if n in contenders}
                run_sequential(pair, request_body(64, rng), connector == "splitserve")  # warm-up
                for fn in runs.values():
                    fn(pair, request_body(64, rng))  # warm-up of each path
                measure_pair(runs, pair, transport, args, rng, rows)
            finally:
                for proxy in proxies:
                    proxy.stop()
                group.stop()
    return rows
