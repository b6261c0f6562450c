"""JSON encoding of the bodies the proxy sends upstream, fast and exact.

Runs in the proxy process, on the hot path of every request (the prefill and decode bodies are
encoded once each). ``orjson`` encodes a 30 KiB prompt about 100 times faster than the standard
library, which matters once prompts are long. Invariant: the bytes mean exactly what
``json.dumps`` would say; where orjson refuses a value the standard library accepts (an integer
beyond 64 bits, a lone surrogate in a string), the standard library encodes it. Decoding stays
with the standard library (orjson turns integers beyond 64 bits into floats, changing what a
client sent).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: big integer, lone surrogate, odd key
        return json.dumps(obj).encode()
