"""One request as the client sends it: the body, a plain POST, and streamed token times."""

from __future__ import annotations

import json
import random
import time
import urllib.request


def request_body(length: int, rng: random.Random) -> dict:
    """A fresh random prompt of ``length`` tokens (no prefix-cache hit), three greedy tokens."""
    prompt = [rng.randrange(5, 1000) for _ in range(length)]
    # ignore_eos: a random model may sample EOS; three tokens give the first two gaps.
    return {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }


def post_json(url: str, body: dict, timeout: float = 600.0) -> tuple[dict, float]:
    """POST ``body`` to ``url``'s completions: (the answer, perf_counter when it arrived)."""
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
