"""Reading a request's ``kv_transfer_params``: which side of a transfer it is, and where P is.

Pure functions (no vLLM import), used twice with the same rules: by the API server's request
guard (``middleware.PrefillTargetGuard``), which answers a malformed set or a ``remote_host``
outside ``allowed_prefill_hosts`` with a 400 naming the field, and by the scheduler half in the
engine-core process, the second wall for servers started without the guard: there a refused set
is logged and the request is served without a transfer (D computes it locally), never crashing
the engine. The params come from whoever reaches the server's HTTP port (docs/security.md).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.transfer.peers import PeerAllowlist


class KVParamsError(ValueError):
    """``kv_transfer_params`` are malformed or name a refused target; ``field`` is the key at
    fault (``""``: the params as a whole)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ReceiveParams:
    """D side: load this request's prompt KV from P.

    ``first_token_from_prefill``: D continues from the first output token P sampled (the proxy
    streams that token to the client itself): D loads the KV of every prompt token, receives the
    token with DONE, and its first step samples the request's second token.
    """

    transfer_id: str
    remote_host: str
    remote_port: int
    first_token_from_prefill: bool = False
    remote_tp_size: int | None = None  # P's tensor parallel size, when the params say it


@dataclass(frozen=True)
class ProduceParams:
    """P side: compute the prompt and hand its KV to a D."""

    transfer_id: str
    decode_tp_size: int | None = None  # D's tensor parallel size, when the params say it


def _tp_size(params: dict[str, Any], key: str) -> int | None:
    tp = params.get(key)
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or not 0 < tp <= 1024):
        raise KVParamsError(key, f"{key} must be an int in 1..1024, got {_shown(tp)}")
    return tp


def _shown(value: Any) -> str:
    """A client's value, cut short for a message (it is echoed in logs and 400 answers)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _transfer_id(params: dict[str, Any], *, required: bool) -> str:
    tid = params.get("transfer_id")
    if tid is None and not required:
        return uuid.uuid4().hex
    if not isinstance(tid, str) or not tid or len(tid) > 128:
        raise KVParamsError(
            "transfer_id",
            f"transfer_id must be a non-empty string of <= 128 chars, got {_shown(tid)}",
        )
    return tid


def _flag(params: Any, key: str) -> bool:
    """A boolean switch of the params; params that are not an object are refused (the field
    reaches the engine untyped: ``vllm_xargs`` entries pass through as they are)."""
    if params is None:
        return False
    if not isinstance(params, dict):
        raise KVParamsError("", f"must be an object, got {type(params).__name__}")
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise KVParamsError(key, f"{key} must be true or false, got {_shown(value)}")
    return bool(value)


def receive_params(params: Any, allowlist: PeerAllowlist | None = None) -> ReceiveParams | None:
    """The D-side params of a request (None when it is not a remote prefill). With an
    ``allowlist``, a ``remote_host`` outside it is refused (D never contacts it)."""
    if not _flag(params, "do_remote_prefill"):
        return None
    assert params is not None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host:
        raise KVParamsError(
            "remote_host", f"remote_host must be a non-empty string, got {_shown(host)}"
        )
    if len(host) > 253:
        raise KVParamsError("remote_host", f"remote_host of {len(host)} characters")
    if allowlist is not None and not allowlist.allows(host):
        # The allowed entries are not named: this message also answers the client.
        raise KVParamsError(
            "remote_host",
            f"remote_host {host!r} is not an allowed prefill host (allowed_prefill_hosts)",
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVParamsError(
            "remote_port", f"remote_port must be an int in 1..65535, got {_shown(port)}"
        )
    first = _flag(params, "first_token_from_prefill")
    tp = _tp_size(params, "remote_tp_size")
    return ReceiveParams(_transfer_id(params, required=True), host, port, first, tp)


def produce_params(params: Any) -> ProduceParams | None:
    """The P-side params of a request (None when it is not a remote decode). A request from a
    stock router carries no transfer id: one is made here and returned to the router."""
    if not _flag(params, "do_remote_decode"):
        return None
    assert params is not None
    return ProduceParams(_transfer_id(params, required=False), _tp_size(params, "decode_tp_size"))


def check_params(params: Any, allowlist: PeerAllowlist | None = None) -> None:
    """Raise ``KVParamsError`` if either side's params are malformed or name a refused
    ``remote_host`` (the request guard's one call: the same rules as the scheduler half)."""
    receive_params(params, allowlist)
    produce_params(params)


def tokens_to_receive(num_prompt_tokens: int, first_token_from_prefill: bool) -> int:
    """Prompt tokens whose KV D takes from P: all but the last (D computes the last and samples
    the first output token), or all of them when P's first output token comes with the KV."""
    return num_prompt_tokens if first_token_from_prefill else max(num_prompt_tokens - 1, 0)


def blocks_to_receive(
    num_prompt_tokens: int,
    local_tokens: int,
    block_size: int,
    first_token_from_prefill: bool = False,
) -> range:
    """Logical blocks D loads: ``tokens_to_receive`` minus what D already holds.

    ``local_tokens`` (D's own prefix-cache hit) is block aligned.
    """
    needed_tokens = tokens_to_receive(num_prompt_tokens, first_token_from_prefill)
    return range(local_tokens // block_size, math.ceil(needed_tokens / block_size))
