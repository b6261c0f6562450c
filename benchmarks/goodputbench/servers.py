"""benchmarks/goodput.py's servers: one contender group's two vLLM servers started, one pinned
core each (``start_group``: P and D with SplitserveConnector for ``pd``, two plain servers
otherwise; their engine flags from the script's ``server_args``, passed in), the proxy's
settings completed with the model's tokenizer (``with_tokenizer``) and the warm-up through the
proxy (``warm``, ``WARM_PROMPTS``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from goodputbench.client import Arrival, Result, stream_one
from splitserve.launch.group import ServerGroup
from splitserve.netutil import free_ports


def start_group(
    group: str,
    model: Path,
    log_dir: Path,
    server_args: Callable[[str, str, int | None], list[str]],
) -> tuple[ServerGroup, dict, int | None]:
    """Start ``group``'s two servers and wait for them: the servers, their URLs by role (and
    each adaptive scheduler's metrics URL, ``<role>-scheduler``) and P's side-channel port
    (None for colocated groups). ``server_args(group, role, metrics_port)``: each server's engine
    flags (goodput.py's, read at start-up, after ``--slo-scale`` and ``--scheduler-set``)."""
    servers = ServerGroup(log_dir)
    http = free_ports(2)
    roles = ("p", "d") if group == "pd" else ("s0", "s1")
    side = free_ports(2) if group == "pd" else [None, None]
    sched_ports = free_ports(2)
    urls = {}
    for core, role in enumerate(roles):
        kv = None
        if group == "pd":
            kv = {
                "kv_connector": "SplitserveConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "side_channel_port": side[core],
                    "lease_s": 600,
                    "done_timeout_s": 900,
                },
            }
        s = servers.add_vllm(
            f"{group}-{role}",
            str(model),
            port=http[core],
            served_model_name="bench",
            kv_transfer_config=kv,
            extra_args=server_args(group, role, sched_ports[core]),
            cpu_core=core,
            cpus=[core],
            env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        )
        urls[role] = s.url
        urls[f"{role}-scheduler"] = f"http://127.0.0.1:{sched_ports[core]}"
    servers.wait(900.0)
    return servers, urls, side[0]


def with_tokenizer(settings: dict[str, Any], model: Path) -> dict[str, Any]:
    if "decide" in settings:
        settings = {**settings, "decide": {**settings["decide"], "tokenizer": str(model)}}
    return settings


WARM_PROMPTS = (64, 2000)  # tokens of the warm-up requests, one after the other, via the proxy


async def warm(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for n in WARM_PROMPTS:
            r = Result("warm", time.perf_counter())
            prompt = tuple(10 + i % 900 for i in range(n))  # ids within the vocabulary
            await stream_one(session, url, Arrival(0, "chat", prompt, 4), r)
            if r.error:
                raise RuntimeError(f"warm-up failed: {r.error}")
