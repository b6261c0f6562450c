"""The ``splitserve`` SGLang backend's data path: settings, KV layout and the transport objects.

Runs in SGLang's scheduler process (one per prefill or decode server), called by the manager in
``splitserve.connectors.sglang.conn``. Imports no SGLang: it turns what SGLang's ``KVArgs`` lists
(pointer, byte length and per-page byte length of every KV buffer and every aux buffer) into a
``splitserve.transfer.KVLayout`` and builds the same ``KVAgent`` / ``SideChannel`` /
``KVSender`` / ``KVReceiver`` the vLLM connector uses (no second transport, ``open_transport``),
after ``check_supported`` refused a server it cannot serve.

Layout: one layout layer per SGLang KV buffer (``MHATokenToKVPool`` keeps ``k_buffer[l]`` and
``v_buffer[l]`` apart, listed k0..k(L-1) then v0..v(L-1)), one block per page; then one aux layer
per metadata buffer (first output token, logprobs, ...: one row per request slot), which travel
once per transfer with DONE. Memory is registered with its real kind: host memory is ``DRAM``.

Settings come from the server's environment (SGLang has no per-backend config):

- The deployment key, as for the vLLM connector (docs/security.md): the file named by
  ``SPLITSERVE_SGLANG_AUTH_KEY_FILE`` or ``SPLITSERVE_AUTH_KEY_FILE``, else
  ``SPLITSERVE_AUTH_KEY``. P binds its side channel on SGLang's host address
  (``SGLANG_HOST_IP``, else the host's own), so without a key it refuses to start unless that
  address is loopback or ``SPLITSERVE_SGLANG_INSECURE=1``. P never advertises an unspecified
  address (``0.0.0.0``): D could not reach it.
- ``SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS`` (any): D contacts only prefill side channels on
  these comma-separated addresses, CIDRs or host names.
- ``SPLITSERVE_SGLANG_LEASE_S`` (300): P holds a registration for a transfer it does not know yet,
  and a finished request's pages waiting for one, this long.
- ``SPLITSERVE_SGLANG_DONE_TIMEOUT_S`` (300): D fails a transfer whose DONE has not come this
  long after its registration.
- ``SPLITSERVE_SGLANG_ABORT_ACK_TIMEOUT_S`` (5): D waits this long for P's ABORT_ACK.
- ``SPLITSERVE_SGLANG_LAYERWISE`` (1): P posts each layer's WRITE as the KV pool stores it;
  0: per chunk, after the forward.
- ``SPLITSERVE_SGLANG_TIMELINE`` (0): 1 logs a per-request timeline at INFO
  (``splitserve.connectors.sglang.timeline``).
- ``SPLITSERVE_SGLANG_UCX_PARAMS`` (``{}``): extra UCX backend parameters (JSON, strings).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.netutil import is_loopback
from splitserve.transfer.agent import KVAgent, NixlBackend
from splitserve.transfer.auth import KEY_ENV, KEY_FILE_ENV, AuthKeyError, load_key
from splitserve.transfer.layout import KVLayout, LayerLayout, MemoryKind
from splitserve.transfer.peers import PeerAllowlist
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender
from splitserve.transfer.side_channel import SideChannel

logger = logging.getLogger(__name__)

ENV_PREFIX = "SPLITSERVE_SGLANG_"


class BackendSettingsError(ValueError):
    """A ``SPLITSERVE_SGLANG_*`` variable is invalid; the message names it."""


class BackendSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    auth_key_file: str | None = None
    insecure: bool = False
    allowed_prefill_hosts: str | None = None  # comma-separated addresses, CIDRs, host names
    lease_s: float = Field(300.0, gt=0)
    done_timeout_s: float = Field(300.0, gt=0)
    abort_ack_timeout_s: float = Field(5.0, gt=0)
    layerwise: bool = True
    timeline: bool = False
    idle_nap_ms: float = Field(1.0, ge=0, le=100)  # connectors/sglang/idle.py; 0: SGLang's spin
    idle_check_ms: float = Field(0.2, ge=0, le=100)  # idle.py: our news checked this often in a nap
    ucx_params: dict[str, str] = Field(default_factory=dict)
    nixl_backends: list[NixlBackend] | None = None  # JSON list, in order of preference

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BackendSettings:
        env = os.environ if env is None else env
        raw: dict[str, object] = {}
        for name in cls.model_fields:
            value = env.get(ENV_PREFIX + name.upper())
            if value is None or value == "":
                continue
            if name in ("ucx_params", "nixl_backends"):
                try:
                    raw[name] = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise BackendSettingsError(
                        f"{ENV_PREFIX}{name.upper()}: not JSON: {exc}"
                    ) from exc
            else:
                raw[name] = value
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = [
                f"{ENV_PREFIX}{str(err['loc'][0]).upper()}: {err['msg']}" for err in exc.errors()
            ]
            raise BackendSettingsError("; ".join(problems)) from exc


def _layers(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], what: str):
    if not (len(ptrs) == len(lens) == len(item_lens)):
        raise ValueError(f"{what}: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)}")
    out = []
    for i, (ptr, length, item) in enumerate(zip(ptrs, lens, item_lens, strict=True)):
        if item <= 0 or length < item:
            raise ValueError(f"{what} {i}: {length} bytes cannot hold one {item}-byte item")
        runs = ((0, item),)
        out.append(
            LayerLayout(base_addr=ptr, block_stride=item, num_blocks=length // item, runs=runs)
        )
    return out


def layout_from_buffers(
    *,
    kv_ptrs: Sequence[int],
    kv_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    aux_ptrs: Sequence[int],
    aux_lens: Sequence[int],
    aux_item_lens: Sequence[int],
    page_size: int,
    memory: MemoryKind,
    device_id: int = 0,
) -> KVLayout:
    """The KV layout of SGLang's buffers as ``KVArgs`` lists them (one item = one page of a KV
    buffer, or one request row of an aux buffer)."""
    if not kv_ptrs:
        raise ValueError("no KV buffers to describe")
    kv = _layers(kv_ptrs, kv_lens, kv_item_lens, "KV buffer")
    aux = _layers(aux_ptrs, aux_lens, aux_item_lens, "aux buffer")
    return KVLayout(
        block_size=page_size,
        memory=memory,
        device_id=device_id,
        layers=tuple(kv + aux),
        aux_layers=len(aux),
    )


def layout_layers_of_model_layers(
    num_buffers: int, layer_ids: Sequence[int], start_layer: int
) -> dict[int, list[int]]:
    """Model layer id -> the layout layers (KV buffers) that hold its KV.

    ``layer_ids`` is ``KVArgs.kv_layer_ids`` (one global layer id per buffer) when SGLang gives
    it; plain MHA pools give none and list k0..k(L-1) then v0..v(L-1) from ``start_layer``.
    """
    out: dict[int, list[int]] = {}
    if layer_ids:
        for index, layer_id in enumerate(layer_ids[:num_buffers]):
            out.setdefault(int(layer_id), []).append(index)
        return out
    if num_buffers % 2:
        raise ValueError(f"{num_buffers} KV buffers: expected K and V buffers per layer")
    half = num_buffers // 2
    for i in range(half):
        out[start_layer + i] = [i, half + i]
    return out


def check_supported(args, server_args) -> None:
    """Stop start-up, saying why, on a server this backend cannot serve (``KVArgs`` and
    ``ServerArgs`` read by name)."""
    problems = []
    if getattr(args, "state_types", None):
        problems.append(f"state buffers {[str(t) for t in args.state_types]}")
    for name in ("tp_size", "pp_size", "dp_size"):
        value = getattr(server_args, name, 1) or 1
        if value != 1:
            problems.append(f"{name}={value}")
    device = getattr(server_args, "device", "cpu")
    if device != "cpu":
        problems.append(f"device {device!r} (the aux buffers live in host memory; mixed memory")
        problems[-1] += " kinds in one agent are not built yet)"
    if problems:
        raise NotImplementedError(
            "the splitserve SGLang transfer backend supports full-attention KV pools with "
            "TP=PP=DP=1 on host memory; this server has " + ", ".join(problems)
        )


def side_channel_key(settings: BackendSettings, host: str, *, prefill: bool) -> bytes | None:
    """The deployment key; a prefill side channel open to the network without one, or one
    that would advertise an unspecified address, stops start-up with what to do."""
    try:
        key = load_key(settings.auth_key_file)
    except AuthKeyError as exc:
        raise BackendSettingsError(f"splitserve SGLang backend: {exc}") from None
    if not prefill:
        return key
    address = _address(host)
    if address is not None and address.is_unspecified:
        raise BackendSettingsError(
            f"splitserve SGLang backend: the prefill side channel would be advertised to D as "
            f"{host!r}, which D cannot connect to; set SGLANG_HOST_IP to an address D reaches"
        )
    if key is None and not is_loopback(host) and not settings.insecure:
        raise BackendSettingsError(
            f"splitserve SGLang backend: the prefill side channel binds {host!r}, reachable "
            "from the network, but no auth key is set: anyone who reaches it could read and "
            f"steer KV transfers. Set {KEY_FILE_ENV} (a 0600 file; the same on every prefill "
            f"and decode server) or {KEY_ENV}; on an isolated lab network only, "
            f"{ENV_PREFIX}INSECURE=1"
        )
    return key


def prefill_allowlist(settings: BackendSettings) -> PeerAllowlist | None:
    """D's allowlist of prefill side channels (None: any)."""
    if settings.allowed_prefill_hosts is None:
        return None
    entries = [e for e in settings.allowed_prefill_hosts.split(",") if e.strip()]
    try:
        return PeerAllowlist.parse(entries)
    except ValueError as exc:
        raise BackendSettingsError(f"{ENV_PREFIX}ALLOWED_PREFILL_HOSTS: {exc}") from None


def _address(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def agent_name(role: str) -> str:
    return f"splitserve-sglang-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass
class Transport:
    """One server's transport: P has a ``sender``, D a ``receiver``."""

    agent: KVAgent
    channel: SideChannel
    sender: KVSender | None = None
    receiver: KVReceiver | None = None


def open_transport(
    kv_args: Any, settings: BackendSettings, *, prefill: bool, host: str
) -> Transport:
    """The agent over SGLang's buffers (``KVArgs``), the side channel (P binds it on ``host``,
    on a free port the bootstrap server then names) and the sender (P) or receiver (D)."""
    layout = layout_from_buffers(
        kv_ptrs=kv_args.kv_data_ptrs,
        kv_lens=kv_args.kv_data_lens,
        kv_item_lens=kv_args.kv_item_lens,
        aux_ptrs=kv_args.aux_data_ptrs,
        aux_lens=kv_args.aux_data_lens,
        aux_item_lens=kv_args.aux_item_lens,
        page_size=kv_args.page_size,
        memory="DRAM",
    )
    agent = KVAgent(
        agent_name("prefill" if prefill else "decode"),
        layout,
        backend_params=settings.ucx_params,
        backends=settings.nixl_backends,
    )
    key = side_channel_key(settings, host, prefill=prefill)
    if prefill:
        channel = SideChannel(host, 0, key, name="splitserve-sglang-sc")
        opened = Transport(
            agent, channel, sender=KVSender(agent, channel, lease_s=settings.lease_s)
        )
    else:
        channel = SideChannel(None, None, key, name="splitserve-sglang-sc")
        receiver = KVReceiver(
            agent,
            channel,
            done_timeout_s=settings.done_timeout_s,
            abort_ack_timeout_s=settings.abort_ack_timeout_s,
        )
        opened = Transport(agent, channel, receiver=receiver)
    logger.info(
        "splitserve SGLang backend (%s): %d KV buffers, %d aux buffers, %d pages of %d "
        "tokens, %s memory%s",
        "prefill" if prefill else "decode",
        layout.num_kv_layers,
        layout.aux_layers,
        layout.num_blocks,
        layout.block_size,
        layout.memory,
        f", side channel {host}:{channel.bound_port}" if prefill else "",
    )
    return opened
