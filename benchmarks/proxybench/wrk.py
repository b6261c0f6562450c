"""``wrk`` as the load generator (the default where installed).

C, a few microseconds per request: the harness no longer sets the ceiling on a small machine.
Latency percentiles are wrk's per round; a cell reports their median over the rounds. wrk's
report is text: the figures are read from it with regular expressions.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import tempfile
from typing import Any

from proxybench.contenders import Contender, rotated, tree_cpu_seconds
from proxybench.load import REQUEST_TIMEOUT_S

_WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%s]==]
"""
_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def wrk_run(url: str, body: bytes, conc: int, seconds: float) -> dict[str, Any]:
    """One wrk run: C connections in a closed loop for ``seconds``; wrk's own percentiles."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_SCRIPT % body.decode())
        script = f.name
    try:
        duration, timeout = f"{max(1, round(seconds))}s", f"{REQUEST_TIMEOUT_S:.0f}s"
        cmd = ["wrk", "-t", "1", "-c", str(conc), "-d", duration, "--latency",
               "--timeout", timeout, "-s", script, url]  # fmt: skip
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=seconds + REQUEST_TIMEOUT_S + 30
        ).stdout
    finally:
        os.unlink(script)
    return parse_wrk(out)


def parse_wrk(out: str) -> dict[str, Any]:
    """The figures of one wrk report (``--latency``): p50, p99 and mean latency in ms,
    requests, successful requests, wall seconds, failures by kind."""

    def ms(pattern: str) -> float:
        m = re.search(pattern + r"\s+([\d.]+)(us|ms|s|m)\b", out, re.M)
        if m is None:
            raise RuntimeError(f"wrk printed no {pattern!r}:\n{out}")
        return float(m.group(1)) * _WRK_UNITS[m.group(2)]

    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if done is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    requests, wall = int(done.group(1)), float(done.group(2)) * _WRK_UNITS[done.group(3)] / 1e3
    failed: dict[str, int] = {}
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        failed["HTTP non-2xx"] = int(bad.group(1))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        for kind, n in zip(("connect", "read", "write", "timeout"), sock.groups(), strict=True):
            if int(n):
                failed[f"socket {kind}"] = int(n)
    return {
        "p50_ms": ms(r"^\s+50%"),
        "p99_ms": ms(r"^\s+99%"),
        "mean_ms": ms(r"^\s+Latency"),
        "requests": requests,
        "ok": requests - failed.get("HTTP non-2xx", 0),
        "wall_s": wall,
        "failed": failed,
    }


def measure_cell_wrk(
    contenders: list[Contender], body: bytes, conc: int, seconds: float, rounds: int
) -> dict[str, dict[str, float]]:
    """One cell with wrk: a 1 s warm-up per contender, then ``rounds`` rounds of
    ``seconds / rounds`` each, the contenders' order rotating. p50 / p99: the median over the
    rounds of wrk's per-round figure; req/s: successful requests over the timed seconds."""
    per_round = max(1.0, seconds / rounds)
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    cpu = dict.fromkeys(runs, 0.0)
    for c in contenders:
        wrk_run(c.url + "/v1/completions", body, conc, 1)
    for k in range(rounds):
        for c in rotated(contenders, k):
            cpu0 = tree_cpu_seconds(c.pid) if c.pid else 0.0
            runs[c.name].append(wrk_run(c.url + "/v1/completions", body, conc, per_round))
            if c.pid:
                cpu[c.name] += tree_cpu_seconds(c.pid) - cpu0
    out: dict[str, dict[str, Any]] = {}
    for c in contenders:
        rs = runs[c.name]
        requests = sum(r["requests"] for r in rs)
        failed: dict[str, int] = {}
        for r in rs:
            for why, n in r["failed"].items():
                failed[why] = failed.get(why, 0) + n
        out[c.name] = {
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
            "mean_ms": statistics.fmean(r["mean_ms"] for r in rs),
            "rps": sum(r["ok"] for r in rs) / sum(r["wall_s"] for r in rs),
            "failed": failed,
        }
        if c.pid:
            out[c.name]["cpu_us_per_request"] = cpu[c.name] / max(1, requests) * 1e6
    return out
