"""The aiohttp load generator: C clients in a closed loop, in this process.

The older harness (``--load python``): the client spends more CPU per request than the
proxies under test (docs/benchmarks.md, "A server of our own, and a harness that measures the
proxy"), so on a small machine it measures its own ceiling at high concurrency; ``wrk`` is the
default where installed. The request body (``request_body``) is shared with ``wrk``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import aiohttp

from proxybench.contenders import Contender, rotated, tree_cpu_seconds
from proxybench.stubs import STREAM_CHUNKS

BODY = {"model": "tiny", "prompt": "hello " * 32, "max_tokens": STREAM_CHUNKS, "temperature": 0}
WARMUP = 20  # per round
REQUEST_TIMEOUT_S = 60.0


def request_body(stream: bool, prompt_chars: int = 0) -> bytes:
    """``BODY``, streamed or not; ``prompt_chars`` (``--prompt-chars``) > 0 replaces its
    prompt (192 characters) with one of about that many characters."""
    body = {**BODY, "stream": stream}
    if prompt_chars:
        body["prompt"] = "hello " * (prompt_chars // 6)
    return json.dumps(body).encode()


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> float | str:
    """One request's latency in seconds, or why it failed (counted, not fatal: on a loaded
    machine one stalled request must not lose a whole run)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status != 200:
                return f"HTTP {r.status}"
    except (aiohttp.ClientError, TimeoutError) as e:
        return type(e).__name__
    return time.perf_counter() - t0


async def load(
    url: str, data: bytes, concurrency: int, requests: int
) -> tuple[list[float], float, dict[str, int]]:
    """``requests`` requests of body ``data`` by ``concurrency`` clients in a closed loop, after
    a warm-up: (latencies in seconds, wall time, failed requests by reason)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(min(WARMUP, requests)):  # warm-up: connections, caches
            await one(session, url, data)
        latencies: list[float] = []
        failed: dict[str, int] = {}
        todo = iter(range(requests))

        async def worker() -> None:
            for _ in todo:
                got = await one(session, url, data)
                if isinstance(got, str):
                    failed[got] = failed.get(got, 0) + 1
                else:
                    latencies.append(got)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, wall, failed


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    """p50, p99 and mean latency in ms, and requests per second."""
    if len(latencies) < 2:
        nan = float("nan")
        return {"p50_ms": nan, "p99_ms": nan, "mean_ms": nan, "rps": len(latencies) / wall}
    latencies = sorted(latencies)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "rps": len(latencies) / wall,
    }


def measure_cell(
    contenders: list[Contender], data: bytes, conc: int, n: int, rounds: int
) -> dict[str, dict[str, float]]:
    """One cell (request body ``data``, ``conc`` clients) for every contender, in ``rounds``
    rounds of n/rounds requests with the order of the contenders rotating, so that a burst of
    load from elsewhere hits all of them alike."""
    per_round = max(n // rounds, 2 * conc)
    lat: dict[str, list[float]] = {c.name: [] for c in contenders}
    wall = dict.fromkeys(lat, 0.0)
    cpu = dict.fromkeys(lat, 0.0)
    sent = dict.fromkeys(lat, 0)
    failed: dict[str, dict[str, int]] = {name: {} for name in lat}
    for k in range(rounds):
        for c in rotated(contenders, k):
            cpu0 = tree_cpu_seconds(c.pid) if c.pid else 0.0
            got, w, bad = asyncio.run(load(c.url + "/v1/completions", data, conc, per_round))
            for why, count in bad.items():
                failed[c.name][why] = failed[c.name].get(why, 0) + count
            if c.pid:
                cpu[c.name] += tree_cpu_seconds(c.pid) - cpu0
            lat[c.name] += got
            wall[c.name] += w
            sent[c.name] += per_round + min(WARMUP, per_round)
    out = {}
    for c in contenders:
        out[c.name] = summary(lat[c.name], wall[c.name])
        out[c.name]["failed"] = failed[c.name]
        if c.pid:
            out[c.name]["cpu_us_per_request"] = cpu[c.name] / sent[c.name] * 1e6
    return out
