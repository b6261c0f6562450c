"""One SGLang request as the client sends it (``benchmarks/handoff_sglang.py``'s rows): the
body, a colocated request, and a PD request sent the way SGLang's router sends it (to P and D at
once with the same ``bootstrap_room``; D's stream is what the client sees), timed per streamed
token, with our backend's exposed handoff read from D's log."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.request
from pathlib import Path


def _stream(url: str, body: dict) -> list[float]:
    """perf_counter times of the streamed chunks of SGLang's native /generate."""
    request = urllib.request.Request(
        url + "/generate",
        json.dumps(body | {"stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    times = []
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return times


def _post(url: str, body: dict) -> None:
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=900) as response:
        response.read()


def _body(length: int, rng: random.Random) -> dict:
    prompt = [rng.randrange(5, 1000) for _ in range(length)]
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": params}


def _colocated(url: str, body: dict) -> dict:
    start = time.perf_counter()
    times = _stream(url, body)
    return {"ttft_s": times[0] - start} | _gaps(times)


def _gaps(times: list[float]) -> dict:
    """First -> second and (when the stream had a third chunk: SGLang may send the last two
    tokens in one) second -> third streamed token."""
    gaps = {"gap_s": times[1] - times[0]}
    if len(times) > 2:
        gaps["gap2_s"] = times[2] - times[1]
    return gaps


def _pd(pair: dict, body: dict, log: Path | None) -> dict:
    bootstrap_room = random.randrange(2**62)
    body = body | {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pair["bootstrap"],
        "bootstrap_room": bootstrap_room,
    }
    errors: list[BaseException] = []

    def prefill() -> None:
        try:
            _post(pair["p"], body)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=prefill)
    send_wall, start = time.time(), time.perf_counter()
    thread.start()
    times = _stream(pair["d"], body)
    thread.join(900)
    if errors:
        raise errors[0]
    out = {
        "ttft_s": times[0] - start,
        **_gaps(times),
        "room": str(bootstrap_room),
        "send_wall": send_wall,
        "first_wall": send_wall + (times[0] - start),
    }
    if log is not None:
        # The backend's transfer id is str(bootstrap_room) (splitserve.connectors.sglang.conn).
        pattern = rf"transfer {bootstrap_room} received, exposed handoff ([0-9.e+-]+) s"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the log line may trail the stream by a flush
            found = re.findall(pattern, log.read_text(errors="replace"))
            if found:
                out["exposed_s"] = float(found[-1])
                break
            time.sleep(0.1)
    return out
