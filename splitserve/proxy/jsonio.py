"""JSON encoding and decoding on the proxy's hot path, fast and exact.

Runs in the proxy process, on every request: the client's body is decoded once, the prefill and
decode bodies encoded once each, P's answer (and, in the first-token flow, every SSE event of
D's stream) decoded once. ``orjson`` is several times faster than the standard library at both,
which matters once prompts are long.

Invariants: ``loads`` reads standard JSON (RFC 8259) and returns exactly what ``json.loads``
returns for it; it refuses ``NaN``, ``Infinity`` and numbers beyond a double's range (the
standard library would make non-finite floats of them, which no JSON encoder can write back:
orjson writes ``null``). So whatever ``loads`` returned, ``dumps`` encodes to bytes that mean
the same. Where orjson refuses what the standard library accepts (an integer beyond 64 bits, a
lone surrogate, UTF-16 text, a byte-order mark) the standard library does the work, and so
reports the error when the input is not JSON at all. The one value orjson changes silently, an
integer literal beyond 64 bits (decoded as a float), is kept exact by handing any text with a run
of 19 or more digits (a string holding a long number included) to the standard library.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

# Every integer of at most 18 digits fits in 64 bits; a longer one may not. Digits map to "0",
# everything else to ".", and the run is looked for as a substring: a C-speed scan (a regex
# ``\d{19}`` costs as much as decoding the whole body with the standard library).
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x2E for b in range(256))
_LONG_RUN = b"0" * 19
# Above this size the scan plus orjson costs as much as the standard library's C scanner (equal
# at about 3 KiB of prompt text, 12 KiB of chat messages; measured), so it decodes alone.
_FAST_MAX_BYTES = 2048


def dumps(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: big integer, lone surrogate, odd key
        return json.dumps(obj).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads(raw: bytes | str) -> Any:
    """``json.loads(raw)`` for standard JSON, through orjson where that gives the same value.
    Raises ``ValueError`` for text that is not standard JSON (``UnicodeDecodeError``, a
    subclass, for bytes that are not text) and ``RecursionError`` for absurd nesting. A ``str``
    goes to the standard library (the hot path has bytes)."""
    if (
        isinstance(raw, bytes | bytearray)
        and len(raw) <= _FAST_MAX_BYTES
        and _LONG_RUN not in raw.translate(_DIGITS_AS_ZEROS)
    ):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # not JSON, or JSON only the standard library reads: it decides
    return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
