"""benchmarks/soak.py's load: client threads sending completions of 1 to ``--max-words`` words,
streamed and not, some leaving at a random point; one ``Record`` per request."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "now"]


@dataclass
class Record:
    start: float
    end: float
    words: int
    stream: bool
    outcome: str  # ok | error | left
    error: str = ""
    check: dict[str, Any] | None = None  # body and answer kept for the colocated check


def prompt_of(rng: random.Random, max_words: int) -> str:
    words = max(1, int(math.exp(rng.uniform(0, math.log(max_words)))))
    return " ".join(rng.choice(WORDS) for _ in range(words))


def post(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str] | None = None):
    """(ok, text or error) of one completion, streamed or not."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"Content-Type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        if r.status != 200:
            return False, f"{r.status} {r.read()[:200].decode(errors='replace')}"
        if not body.get("stream"):
            return True, json.loads(r.read())["choices"][0]["text"]
        text = []
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return True, "".join(text)
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return False, f"stream error {json.dumps(event)[:200]}"
                text += [c.get("text", "") for c in event.get("choices", [])]
        return False, "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return False, f"transport {exc!r}"
    finally:
        conn.close()


def leave(url: str, body: dict[str, Any], after_s: float) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        time.sleep(after_s)
    except OSError:
        pass
    finally:
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)
        conn.close()


def client(i: int, url: str, args: argparse.Namespace, until: float, records: list[Record]) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < until:
        prompt = prompt_of(rng, args.max_words)
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": rng.randint(1, 16),
            "temperature": 0,
            "stream": rng.random() < 0.5,
        }
        t0 = time.monotonic()
        if rng.random() < args.disconnect:
            leave(url, {**body, "stream": True}, rng.uniform(0, 2))
            records.append(Record(t0, time.monotonic(), len(prompt.split()), True, "left"))
            continue
        ok, result = post(url, body, timeout=args.request_timeout)
        record = Record(t0, time.monotonic(), len(prompt.split()), body["stream"], "ok")
        if not ok:
            record.outcome, record.error = "error", result
            time.sleep(args.error_pause_s)  # as a client would before trying again
        elif rng.random() < args.check:
            record.check = {"body": {**body, "stream": False}, "answer": result}
        records.append(record)
