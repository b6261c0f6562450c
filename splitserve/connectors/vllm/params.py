"""Reading a request's ``kv_transfer_params``: which side of a transfer it is, and where P is.

Pure functions (no vLLM import), used by the scheduler half in the engine-core process. The
params come from the client (through the proxy), so they are validated here and a malformed
set is refused with a message that says what is wrong; the request is then served without a
transfer (D computes it locally), never crashing the engine.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.transfer.peers import PeerAllowlist


class KVParamsError(ValueError):
    """``kv_transfer_params`` are malformed."""


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


@dataclass(frozen=True)
class ProduceParams:
    """P side: compute the prompt and hand its KV to a D."""

    transfer_id: str


def _transfer_id(params: dict[str, Any], *, required: bool) -> str:
    tid = params.get("transfer_id")
    if tid is None and not required:
        return uuid.uuid4().hex
    if not isinstance(tid, str) or not tid or len(tid) > 128:
        raise KVParamsError(f"transfer_id must be a non-empty string of <= 128 chars, got {tid!r}")
    return tid


def receive_params(
    params: dict[str, Any] | None, allowlist: PeerAllowlist | None = None
) -> ReceiveParams | None:
    """The D-side params of a request (None when it is not a remote prefill). With an
    ``allowlist``, a ``remote_host`` outside it is refused (D never contacts it)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host:
        raise KVParamsError(f"remote_host must be a non-empty string, got {host!r}")
    if len(host) > 253:
        raise KVParamsError(f"remote_host of {len(host)} characters")
    if allowlist is not None and not allowlist.allows(host):
        raise KVParamsError(
            f"remote_host {host!r} is not an allowed prefill host (allowed_prefill_hosts: "
            f"{allowlist})"
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVParamsError(f"remote_port must be an int in 1..65535, got {port!r}")
    first = params.get("first_token_from_prefill", False)
    if not isinstance(first, bool):
        raise KVParamsError(f"first_token_from_prefill must be true or false, got {first!r}")
    return ReceiveParams(_transfer_id(params, required=True), host, port, first)


def produce_params(params: dict[str, Any] | None) -> ProduceParams | None:
    """The P-side params of a request (None when it is not a remote decode). A request from a
    stock router carries no transfer id: one is made here and returned to the router."""
    if not params or not params.get("do_remote_decode"):
        return None
    return ProduceParams(_transfer_id(params, required=False))


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
