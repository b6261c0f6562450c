"""Engine dispatch protocols: the request bodies the proxy sends to a prefill (P) and a decode (D)
server, as pure functions.

This module is the one place that knows how each engine pairs a P with a D (the cross-team
contract in ``docs/proxy.md``); the proxy and the connector tests both build their bodies here and
nowhere else. Runs wherever it is imported (the proxy process, a test); imports no engine.

Invariants:
- Every function returns new top-level dicts and never mutates the caller's ``body``; nested
  values (``messages``, ``prompt`` lists) are shared with it, read-only, so that building the
  bodies copies no prompt (the bodies are serialized at once and never changed after).
- Fields that steer a KV transfer (``kv_transfer_params``, ``bootstrap_*``) are always overwritten
  with the values given here, so a client can never make a server connect to a host the proxy
  did not choose.
- The prefill body asks for exactly one token (``max_tokens=1`` and, when present,
  ``max_completion_tokens=1``), is never streamed and carries no ``stream_options``.
"""

from __future__ import annotations

import os
from typing import Any

# Fields a client may send that only the proxy is allowed to set.
TRANSFER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")

# SGLang's bootstrap_room is a non-negative 63-bit integer (what its router draws).
_MAX_ROOM = 2**63 - 1


class DispatchError(ValueError):
    """A body or an upstream answer that does not fit the dispatch protocol."""


class _RandomBytes:
    """Bytes from ``os.urandom``, fetched 4 KiB at a time: the same randomness as a call per id,
    without a getrandom() system call on every request. A forked child starts with a fresh
    buffer (``os.register_at_fork``), so parent and child never hand out the same ids."""

    _SIZE = 4096

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._buf, self._pos = b"", 0

    def take(self, n: int) -> bytes:
        pos = self._pos
        if pos + n > len(self._buf):
            self._buf, pos = os.urandom(self._SIZE), 0
        self._pos = pos + n
        return self._buf[pos : pos + n]


_random = _RandomBytes()


def new_transfer_id() -> str:
    """A fresh transfer id (128 random bits as 32 hex digits): one per attempt, never reused on a
    retry. From ``os.urandom`` (buffered), cheaper than ``uuid4`` on the hot path
    (docs/benchmarks.md, "Hot path after a profile")."""
    return _random.take(16).hex()


def new_bootstrap_room() -> int:
    """A fresh SGLang ``bootstrap_room`` (random 63-bit integer, from ``os.urandom`` as
    ``SystemRandom`` would, without building one per request)."""
    return int.from_bytes(_random.take(8), "little") & _MAX_ROOM


def _client_body(body: dict[str, Any]) -> dict[str, Any]:
    """A (shallow) copy of the client's body without any transfer field the client tried to
    set."""
    if not isinstance(body, dict):
        raise DispatchError(f"request body must be a JSON object, got {type(body).__name__}")
    out = dict(body)
    for key in TRANSFER_FIELDS:
        out.pop(key, None)
    return out


def _prefill_only(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (already a copy) turned into a one-token, non-streamed prefill request."""
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body.pop("stream_options", None)
    # min_tokens > 1 would contradict max_tokens=1 and make vLLM reject the prefill request.
    body.pop("min_tokens", None)
    return body


def vllm_concurrent_requests(
    body: dict[str, Any],
    transfer_id: str,
    side_host: str,
    side_port: int,
    first_token_from_prefill: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill_body, decode_body) for the vLLM concurrent flow with ``SplitserveConnector``.

    Both are sent at the same time. D learns where P's connector side channel listens
    (``side_host``:``side_port``) and registers its blocks there under ``transfer_id``; P holds
    the request's KV under that id until the registration arrives.

    ``first_token_from_prefill``: D continues from the first token P samples (it receives the
    KV of every prompt token and the token itself with DONE); the client's first token is P's
    (``splitserve.proxy.stitch``), D's answer starts at the second. The caller decides whether
    a request can go this way (``stitch.first_token_eligible``).
    """
    if not transfer_id:
        raise DispatchError("transfer_id must be a non-empty string")
    decode = _client_body(body)
    decode["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": side_host,
        "remote_port": int(side_port),
    }
    if first_token_from_prefill:
        decode["kv_transfer_params"]["first_token_from_prefill"] = True
    prefill = _prefill_only(_client_body(body))
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return prefill, decode


def colocated_request(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request for one server that serves it whole (no transfer)."""
    return _client_body(body)


def vllm_sequential_prefill_request(
    body: dict[str, Any], transfer_id: str | None = None
) -> dict[str, Any]:
    """The first request of the vLLM sequential flow (stock ``NixlConnector`` or ours).

    P computes the prompt, samples one token and answers with ``kv_transfer_params`` naming
    itself; those go to D unchanged (``vllm_sequential_decode_request``). ``transfer_id`` is
    added for our connector, which keys the held KV by it; the stock connector ignores it.
    It is also the request's ``request_id`` on P (and, passed to the decode request, on D):
    vLLM's ``NixlPushConnector`` pairs D's registration with P's held KV by request id alone,
    so P and D must serve the request under one id (vLLM then adds its own prefix/suffix).
    """
    prefill = _prefill_only(_client_body(body))
    if transfer_id is not None:
        prefill["request_id"] = transfer_id
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    prefill["kv_transfer_params"] = params
    return prefill


def vllm_sequential_decode_request(
    body: dict[str, Any], prefill_response: dict[str, Any], transfer_id: str | None = None
) -> dict[str, Any]:
    """The second request of the vLLM sequential flow: the client's body plus P's returned
    ``kv_transfer_params``, unchanged and not copied (the caller hands P's answer over: a
    long prompt's block ids are thousands of integers), under the prefill request's
    ``transfer_id`` as its ``request_id`` (see ``vllm_sequential_prefill_request``).

    Raises ``DispatchError`` when P's answer carries no ``kv_transfer_params`` object (P was
    started without a KV connector, or is not a producer).
    """
    if not isinstance(prefill_response, dict):
        raise DispatchError("prefill response is not a JSON object")
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise DispatchError(
            "prefill response has no kv_transfer_params: is the prefill server started with a "
            "KV connector (--kv-transfer-config)?"
        )
    decode = _client_body(body)
    decode["kv_transfer_params"] = params  # P's answer is handed over, not copied
    if transfer_id is not None:
        decode["request_id"] = transfer_id
    return decode


def sglang_requests(
    body: dict[str, Any], bootstrap_host: str, bootstrap_port: int | None, room: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill_body, decode_body) for SGLang's PD flow, sent to P and D at the same time.

    Both carry the same ``bootstrap_host`` / ``bootstrap_port`` (P's bootstrap server) and
    ``bootstrap_room`` (the transfer id); D's answer is what the client gets. P's copy is not
    streamed (its answer is only awaited for errors); sampling settings stay identical.
    """
    if not 0 <= int(room) <= _MAX_ROOM:
        raise DispatchError(f"bootstrap_room must be a 63-bit non-negative integer, got {room}")
    fields = {
        "bootstrap_host": bootstrap_host,
        "bootstrap_port": None if bootstrap_port is None else int(bootstrap_port),
        "bootstrap_room": int(room),
    }
    decode = _client_body(body)
    decode.update(fields)
    prefill = _client_body(body)
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill.update(fields)
    return prefill, decode
