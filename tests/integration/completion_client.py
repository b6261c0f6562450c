"""A completion client for the fault tests: one POST, read to its end, and how it ended.

Shared by the fault modules (``test_fault_matrix.py``, ``test_sglang_failures.py``,
``test_serving_cross_host.py``): their pass criterion is "a correct answer or a clean error
within the bound", so every request's outcome is recorded (status, text or error, seconds)
instead of raised, and a client that goes away mid-request is one call (``send_and_leave``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Outcome:
    """How a request ended: ``text`` (an answer), or ``error`` (its status and body, or the SSE
    error event), and how long it took."""

    status: int = 0
    text: str | None = None
    error: str | None = None
    seconds: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """An answer, or an error a client can read (an OpenAI error body or SSE error event)."""
        return self.text is not None or (self.error is not None and '"error"' in self.error)


def send(url: str, body: dict[str, Any], timeout: float) -> Outcome:
    """POST a completion; read the whole answer (SSE when streamed)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    t0 = time.monotonic()
    out = Outcome()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        out.status = response.status
        if response.status != 200:
            out.error = response.read().decode(errors="replace")
        elif not body.get("stream"):
            out.text = json.loads(response.read())["choices"][0]["text"]
        else:
            text, done = [], False
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                out.events.append(event)
                if "error" in event:
                    out.error = json.dumps(event)
                    break
                text += [c.get("text", "") for c in event.get("choices", [])]
            if done:
                out.text = "".join(text)
            elif out.error is None:
                out.error = "stream ended without [DONE] or an error event"
    except (OSError, http.client.HTTPException) as exc:
        out.error = f"transport: {exc!r}"
    finally:
        conn.close()
        out.seconds = time.monotonic() - t0
    return out


def send_and_leave(url: str, body: dict[str, Any], after_s: float, timeout: float) -> None:
    """POST a streamed completion and close the connection ``after_s`` seconds later, whatever
    arrived by then (a client that goes away)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        time.sleep(after_s)
    finally:
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)
        conn.close()
