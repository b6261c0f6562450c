"""Unit tests of splitserve.proxy.jsonio (our own logic; no engine): the fast paths give exactly
what the standard library gives, values and errors alike."""

from __future__ import annotations

import json

import pytest

from splitserve.proxy import jsonio

SAME_AS_STDLIB = [
    b'{"prompt": "hello", "max_tokens": 8, "temperature": 0.7, "stream": true}',
    b'{"a": 9223372036854775807, "b": -9223372036854775808}',  # 64-bit ends: orjson exact
    b'{"a": 18446744073709551616}',  # beyond 64 bits: orjson would give a float
    b'{"a": -123456789012345678901234567890}',
    b'{"a": 123456789012345678901234567890.5}',
    b'{"prompt": "call 12345678901234567890 now"}',  # long digits inside a string
    b'{"a": 0.1, "b": 1e-7, "c": 2.5e300, "d": -0.0, "e": 1E2}',
    b'{"a": 1, "a": 2}',  # duplicate key: the last wins in both
    b'{"s": "\\u00e9\\ud83d\\ude00 \\"q\\" \\\\ \\n"}',
    '{"s": "é 😀"}'.encode(),
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte-order mark (the standard library skips it)
    b'{"s": "\\ud800"}',  # a lone surrogate
    b"[1, [2, [3, {}]]]",
    b"  {}  ",
    '{"a": [1, 2]}'.encode("utf-16"),  # the standard library detects UTF-16
]


@pytest.mark.parametrize("raw", SAME_AS_STDLIB)
def test_loads_equals_the_standard_library(raw: bytes) -> None:
    got, want = jsonio.loads(raw), json.loads(raw)
    # repr compares types too (an int must not come back as a float) and NaN with NaN.
    assert repr(got) == repr(want)


def test_loads_accepts_str_as_the_standard_library_does() -> None:
    for raw in SAME_AS_STDLIB[:8]:
        text = raw.decode()
        assert repr(jsonio.loads(text)) == repr(json.loads(text))


def test_big_integer_stays_an_integer() -> None:
    value = jsonio.loads(b'{"room": 340282366920938463463374607431768211456}')["room"]
    assert isinstance(value, int) and value == 2**128


@pytest.mark.parametrize(
    "raw, error",
    [
        (b"{not json", ValueError),
        (b"", ValueError),
        (b'{"a": 1', ValueError),
        (b'{"a": "\xff"}', UnicodeDecodeError),
        (b"[" * 100_000 + b"]" * 100_000, RecursionError),
    ],
)
def test_loads_raises_what_the_standard_library_raises(raw: bytes, error: type) -> None:
    with pytest.raises(error):
        json.loads(raw)
    with pytest.raises(error):
        jsonio.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": [-Infinity]}', b'{"a": 1e400}', b"-1e309"],
)
def test_loads_refuses_what_json_cannot_write_back(raw: bytes) -> None:
    # The standard library makes non-finite floats of these; orjson would encode them as null.
    with pytest.raises(ValueError, match="not a JSON value|out of range"):
        jsonio.loads(raw)


def test_dumps_round_trips_what_orjson_refuses() -> None:
    for obj in ({"a": 2**70}, {"s": "\ud800"}, {"b": -(2**64)}):
        assert json.loads(jsonio.dumps(obj)) == obj


def test_whatever_loads_returns_dumps_writes_back() -> None:
    for raw in SAME_AS_STDLIB:
        value = jsonio.loads(raw)
        assert repr(json.loads(jsonio.dumps(value))) == repr(value)


@pytest.mark.parametrize("filler", ["x", "1 ", "12345678901234567890 "])
def test_long_bodies_decode_the_same(filler: str) -> None:
    # Long bodies skip orjson (the standard library is as fast there): same results, same refusals.
    raw = json.dumps({"prompt": filler * 3000, "n": [2**70, 7, 0.5]}).encode()
    assert repr(jsonio.loads(raw)) == repr(json.loads(raw))
    with pytest.raises(ValueError):
        jsonio.loads(raw[:-1] + b', "t": NaN}')
