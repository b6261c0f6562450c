"""benchmarks/chunking.py's load generator: the seeded schedule of short and long requests
(``build_schedule``: poisson or phased; also benchmarks/no_regret.py's phased workload), the
requests sent at their offsets and streamed with the time of every token (``drive``), and the
warm-up request before a measurement (``warm_up``)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
from common.sse import token_times


@dataclass
class RequestResult:
    kind: str  # "short" | "long"
    sent: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, result
) -> None:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for now in token_times(response.content):
                if result.first_token is None:
                    result.first_token = now
                result.token_times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = repr(exc)


def build_schedule(args: argparse.Namespace, rng: random.Random) -> list[tuple[float, str]]:
    """(arrival offset s, "short" | "long"), sorted.

    ``poisson``: shorts as a Poisson stream over the whole window, a long prompt every
    ``--long-every`` s. ``phased``: the load alternates, every ``--period`` s: a busy phase
    (the first ``--busy-fraction`` of the period) of Poisson shorts with one long prompt in its
    middle, then a quiet phase without shorts where ``--quiet-longs`` long prompts arrive
    together ``--drain`` s after the busy phase ended (the decodes have finished by then). A
    fixed budget must choose: small chunks protect the busy phase's streams, large ones the
    quiet phase's long prompts."""
    schedule: list[tuple[float, str]] = []
    if args.workload == "poisson":
        t = 0.0
        while True:
            t += rng.expovariate(args.short_rate)
            if t >= args.duration:
                break
            schedule.append((t, "short"))
        n_long = int(args.duration // args.long_every)
        schedule += [(k * args.long_every + 0.5, "long") for k in range(n_long)]
        return sorted(schedule)
    busy = args.period * args.busy_fraction
    start = 0.0
    while start < args.duration:
        t = start
        while True:
            t += rng.expovariate(args.short_rate)
            if t >= start + busy:
                break
            schedule.append((t, "short"))
        schedule.append((start + busy / 2, "long"))
        schedule += [(start + busy + args.drain, "long")] * args.quiet_longs
        start += args.period
    return sorted(schedule)


async def drive(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """The seeded mixed workload; returns the results and the window length (s)."""
    rng = random.Random(args.seed)
    schedule = build_schedule(args, rng)

    results: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=args.duration * 20 + 600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        start = time.perf_counter()
        for offset, kind in schedule:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if kind == "short":
                prompt = [rng.randint(5, 1000) for _ in range(args.short_prompt)]
                max_tokens = args.short_output
            else:
                prompt = [rng.randint(5, 1000) for _ in range(args.long_prompt)]
                max_tokens = args.long_output
            result = RequestResult(kind, time.perf_counter())
            results.append(result)
            tasks.append(asyncio.create_task(_stream(session, url, prompt, max_tokens, result)))
        await asyncio.gather(*tasks)
        window = time.perf_counter() - start
    return results, window


async def warm_up(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        result = RequestResult("warmup", time.perf_counter())
        await _stream(session, url, list(range(10, 300)), 8, result)
        if result.error:
            raise RuntimeError(f"warm-up request failed: {result.error}")
