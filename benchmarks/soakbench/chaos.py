"""benchmarks/soak.py's samples and kills: each server's (and the proxy's) process-tree RSS, open
fds and KV usage every ``--sample-s`` seconds, and the SIGKILLs of whole server trees, each with
its kill window (until the proxy's ``/ready`` answers 200 again)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from typing import Any

import psutil
from common.metrics import metrics_text, sample_sum

from soakbench.deployment import Deployed
from splitserve.netutil import http_ok

logger = logging.getLogger("soak")

MB = 1024 * 1024
KV = "vllm:kv_cache_usage_perc"


def tree_sum(procs: list[psutil.Process], measure) -> int:
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += measure(proc)
    return total


def sample(deployed: Deployed, t0: float) -> dict[str, Any]:
    row: dict[str, Any] = {"t": time.monotonic() - t0}
    for name in deployed.ports:
        procs = deployed.tree(name)
        entry: dict[str, Any] = {
            "pid": procs[0].pid if procs else None,
            "rss_mb": tree_sum(procs, lambda p: p.memory_info().rss) / MB,
            "fds": tree_sum(procs, lambda p: p.num_fds()),
        }
        if name != "proxy":
            try:
                entry["kv"] = sample_sum(metrics_text(deployed.engines[name], timeout=5), KV)
            except Exception:  # noqa: BLE001 - a server being restarted has no /metrics
                entry["kv"] = None
        row[name] = entry
    return row


def sampler(
    deployed: Deployed, t0: float, every: float, stop_at: threading.Event, rows: list
) -> None:
    while not stop_at.is_set():
        rows.append(sample(deployed, t0))
        stop_at.wait(every)


def kill(deployed: Deployed, name: str) -> None:
    procs = deployed.tree(name)
    logger.warning("SIGKILL %s (%d processes)", name, len(procs))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)


def wait_back(deployed: Deployed, name: str, bound: float) -> bool:
    """The killed server answers its /health again (the restarted process), then the proxy's
    /ready is 200 (it readmitted it)."""
    end = time.monotonic() + bound
    for url in (deployed.engines[name] + "/health", deployed.proxy_url + "/ready"):
        while not http_ok(url):
            if time.monotonic() > end:
                return False
            time.sleep(1)
    return True


def chaos(
    deployed: Deployed,
    t0: float,
    kills: list[tuple[float, str]],
    windows: list[list[float]],
    stop_at: threading.Event,
) -> None:
    """Each kill at its time (relative to t0), never while an earlier window is open."""
    for at, name in kills:
        if stop_at.wait(max(0.0, t0 + at - time.monotonic())):
            return
        window = [time.monotonic() - t0, math.inf]
        windows.append(window)
        kill(deployed, name)
        ready = wait_back(deployed, name, 900)
        window[1] = time.monotonic() - t0 + 5.0  # readmission and retries settle
        logger.warning("%s back %s at %.0f s", name, "" if ready else "NOT", window[1])
        if stop_at.wait(5.0):
            return
