"""benchmarks/goodput.py's open-loop client: requests sent at their arrival times, each
streamed, with the time of its first and every later token (also used by
benchmarks/no_regret.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from common.sse import token_times


@dataclass(frozen=True)
class Arrival:
    at_s: float
    kind: str  # "chat" | "doc"
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Result:
    kind: str
    sent: float
    first: float | None = None
    times: list[float] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def stream_one(session: aiohttp.ClientSession, url: str, a: Arrival, r: Result) -> None:
    body = {
        "model": "bench",
        "prompt": list(a.prompt),
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            async for now in token_times(resp.content):
                if r.first is None:
                    r.first = now
                r.times.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        r.error = repr(e)


async def drive(url: str, arrivals: list[Arrival]) -> list[Result]:
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        tasks = []
        start = time.perf_counter()
        for a in arrivals:
            delay = start + a.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            r = Result(a.kind, time.perf_counter(), prompt_tokens=len(a.prompt))
            results.append(r)
            tasks.append(asyncio.create_task(stream_one(session, url, a, r)))
        await asyncio.gather(*tasks)
    return results
