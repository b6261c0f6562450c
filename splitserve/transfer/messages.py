"""Every control message of the KV transfer protocol, typed, versioned and encoded in one place.

Runs in whichever process speaks the protocol (vLLM worker, SGLang scheduler, tests); imports
no engine. A message travels as ``MAC_LEN(1 byte) | MAC | JSON body``: the body is the pydantic
model dumped to JSON with a ``v`` (protocol version) and a ``type`` field; the MAC is
HMAC-SHA256 of the body under the shared ``auth_key`` when one is configured (empty otherwise).

Invariants:
- ``decode`` either returns a fully validated message or raises a ``MessageError`` subclass that
  says what was wrong (bad MAC, wrong version, malformed field). It never returns half a message.
- When an ``auth_key`` is configured, a message without a valid MAC is rejected
  (``MessageAuthError``), whatever its content.
- Messages are small: block ids are lists of ints, agent metadata is base64 in JSON.
- Optional fields (``None`` when unused) are left out of the wire body, so adding one keeps
  version 1 compatible with peers that do not know it, as long as they are not asked to use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
_MAC_SIZE = hashlib.sha256().digest_size

# Bounds on what a peer may send, checked before anything is allocated from its numbers
# (docs/security.md). A message is at most MAX_MESSAGE_BYTES on the wire (the side channel also
# sets ZMQ's MAXMSGSIZE to it, so a larger frame is dropped by ZMQ before it is buffered). The
# largest legitimate message is a REGISTER or ANNOUNCE of a long prompt: MAX_BLOCK_IDS block ids
# of up to 10 digits each, well under the frame limit.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_BLOCK_IDS = 1 << 20  # per list: 16 M tokens at 16 tokens a block
MAX_KV_GROUPS = 64
MAX_LAYERS = 4096
MAX_ID_CHARS = 128  # transfer ids and agent names
MAX_REASON_CHARS = 1024
MAX_METADATA_BYTES = 4 * 1024 * 1024
_BLOCK_ID = Annotated[int, Field(ge=0, lt=1 << 40)]
_LAYER = Annotated[int, Field(ge=0, lt=MAX_LAYERS)]
_TRANSFER_ID = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
_AGENT_NAME = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


class MessageError(ValueError):
    """A control message could not be accepted."""


class MessageAuthError(MessageError):
    """The message's MAC is missing or does not match the shared key."""


class MessageVersionError(MessageError):
    """The message speaks another protocol version."""


class MalformedMessageError(MessageError):
    """The message is not valid JSON or a field is missing or has the wrong type."""


class _Message(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64"
    )
    v: Literal[1] = PROTOCOL_VERSION


class Hello(_Message):
    """First contact from a receiver (D) to a sender (P): who I am and how to write into me.

    ``layout`` is a ``splitserve.transfer.layout.KVLayout`` dumped to a dict; the sender checks it
    against its own before accepting registrations from this peer.
    """

    type: Literal["hello"] = "hello"
    agent_name: _AGENT_NAME
    agent_metadata: bytes = Field(max_length=MAX_METADATA_BYTES)
    layout: dict
    target: str | None = Field(
        None,
        max_length=300,
        description="the sender's address as the receiver dialled it (host:port); the "
        "sender names it when it asks the agent to confirm a second connection (``Confirm``)",
    )
    host: str | None = Field(
        None,
        max_length=200,
        description="the receiver's host identity (``strategy.host_identity``: boot id and "
        "network namespace); a sender on another host reaches it over tcp or RDMA, never cma",
    )


class HelloAck(_Message):
    """The sender accepted a HELLO; names the agent whose notifications (DONE) will arrive.

    A sender that pulls (``direction="pull"``) also sends its own agent metadata and KV layout:
    the receiver READs from its memory and checks every announced block id against ``layout``.
    """

    type: Literal["hello_ack"] = "hello_ack"
    agent_name: _AGENT_NAME
    direction: Literal["pull"] | None = Field(
        None, description="the sender ANNOUNCEs and the receiver READs; absent: the sender WRITEs"
    )
    agent_metadata: bytes | None = Field(
        None, max_length=MAX_METADATA_BYTES, description="the sender's NIXL metadata (pull)"
    )
    layout: dict | None = Field(None, description="the sender's KVLayout, dumped (pull)")


class Register(_Message):
    """D's blocks for one transfer: ``block_ids[group]`` are D's block ids for the request's
    logical blocks starting at ``token_offset // block_size`` (the tokens D already holds from
    its own prefix cache are not sent). An empty list means D needs nothing: the sender may free.
    """

    type: Literal["register"] = "register"
    transfer_id: _TRANSFER_ID
    agent_name: _AGENT_NAME
    block_ids: list[Annotated[list[_BLOCK_ID], Field(max_length=MAX_BLOCK_IDS)]] = Field(
        max_length=MAX_KV_GROUPS
    )
    token_offset: int = Field(ge=0)
    first_token: Literal[True] | None = Field(
        None,
        description="D continues from P's first output token: DONE must carry it (and D "
        "registers every prompt token, not all but the last). Absent on the wire when unset, "
        "so a peer that predates the field still understands every other registration.",
    )
    aux_row: int | None = Field(
        None,
        ge=0,
        description="D's row in the layout's aux layers (per-request engine metadata, e.g. "
        "SGLang's first output token): P writes its own row there with DONE. Absent when the "
        "layout has no aux layers.",
    )


class Done(_Message):
    """All of a transfer's KV is written (push) or announced (pull). Push: travels as a NIXL
    notification attached to the transfer's last WRITE, so it arrives after the data it covers.
    Pull: travels on the side channel after the transfer's last ANNOUNCE (same socket, so in
    order); the receiver completes once its READs of every announced block are done."""

    type: Literal["done"] = "done"
    transfer_id: _TRANSFER_ID
    num_blocks: int = Field(ge=0, le=MAX_BLOCK_IDS * MAX_KV_GROUPS)
    prefill_end_wall: float = Field(
        description="P's wall clock (time.time()) when the forward that completed the prompt "
        "returned (every layer computed, each layer's WRITE posted as its attention ran); D "
        "measures the exposed handoff from it (same host or synced clocks)"
    )
    first_token: int | None = Field(
        None,
        ge=0,
        description="The request's first output token as P sampled it; sent when the "
        "registration asked for it (``Register.first_token``), absent otherwise.",
    )


# An ABORT whose reason starts with this is about the connection's HELLO, not the transfer: P
# has no valid HELLO on that connection (restarted, pruned it, or refused it). The receiver says
# HELLO again and registers the transfer again, once per transfer (``receiver``).
HELLO_REFUSAL = "hello: "


class Abort(_Message):
    """Stop a transfer. From D: the request is gone, stop writing. From P: the transfer failed
    (reason says why), D must not wait for DONE."""

    type: Literal["abort"] = "abort"
    transfer_id: _TRANSFER_ID
    reason: str = Field(max_length=MAX_REASON_CHARS)


class AbortAck(_Message):
    """P settled an ABORT: no WRITE of this transfer is in flight any more; D may free."""

    type: Literal["abort_ack"] = "abort_ack"
    transfer_id: _TRANSFER_ID


class Announce(_Message):
    """Pull strategy: in each of ``layers``, P's blocks ``src_block_ids`` are complete and D may
    READ them into its blocks ``dst_block_ids`` (pairwise). One per layer per step while P
    computes; one for several layers when a registration catches up (bulk, mid-forward)."""

    type: Literal["announce"] = "announce"
    transfer_id: _TRANSFER_ID
    layers: list[_LAYER] = Field(min_length=1, max_length=MAX_LAYERS)
    src_block_ids: list[_BLOCK_ID] = Field(min_length=1, max_length=MAX_BLOCK_IDS)
    dst_block_ids: list[_BLOCK_ID] = Field(min_length=1, max_length=MAX_BLOCK_IDS)


class Pulled(_Message):
    """Pull strategy, D -> P: every READ of this transfer completed (after DONE): P may free its
    blocks. A receiver that fails or aborts sends ABORT instead, once its READs settled."""

    type: Literal["pulled"] = "pulled"
    transfer_id: _TRANSFER_ID


class FirstToken(_Message):
    """Pull strategy: the request's first output token, sent by P's engine the moment it sampled
    it, to P's own side channel, whose I/O thread relays it at once to the D registered for the
    transfer (``SideChannel.relay_first_token``). DONE carries the same token but waits for P's
    next engine step (the engine tells its worker of a finished request only then); with this,
    D completes a load as soon as every registered (layer, block) was announced and read and
    the token is here, and a later DONE for it is ignored. Dropped by P's side channel when no
    D registered for the transfer with ``Register.first_token``."""

    type: Literal["first_token"] = "first_token"
    transfer_id: _TRANSFER_ID
    token: int = Field(ge=0)
    sampled_wall: float = Field(
        description="P's wall clock (time.time()) when its engine saw the sampled token; D "
        "measures the exposed handoff from it when it completes on this message"
    )


class Confirm(_Message):
    """P -> D, over D's admitted connection: "a HELLO in your agent's name came on the
    connection with this routing id (dialled as ``target``): is it yours?" (``peering``)."""

    type: Literal["confirm"] = "confirm"
    nonce: str = Field(min_length=16, max_length=64)
    routing_id: str = Field(min_length=2, max_length=512, description="hex")
    target: str | None = Field(None, max_length=300)


class Confirmed(_Message):
    """D -> P, the answer to ``Confirm``: ``owned`` when the routing id is one of D's own
    connections (dialled to ``target`` when one was named)."""

    type: Literal["confirmed"] = "confirmed"
    nonce: str = Field(min_length=16, max_length=64)
    owned: bool


Message = Annotated[
    Hello
    | HelloAck
    | Register
    | Done
    | Abort
    | AbortAck
    | Announce
    | Pulled
    | FirstToken
    | Confirm
    | Confirmed,
    Field(discriminator="type"),
]
_MESSAGE_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def _mac(auth_key: bytes, body: bytes) -> bytes:
    return hmac.new(auth_key, body, hashlib.sha256).digest()


def encode(message: _Message, auth_key: bytes | None = None) -> bytes:
    """The wire bytes of ``message``, MAC'd under ``auth_key`` when given."""
    # Optional fields travel only when set, so a peer that predates them (same version, stricter
    # model) still accepts every message that does not use them.
    body = message.model_dump_json(exclude_none=True).encode()
    mac = _mac(auth_key, body) if auth_key else b""
    return bytes([len(mac)]) + mac + body


def decode(wire: bytes, auth_key: bytes | None = None) -> Message:
    """Parse and authenticate wire bytes; raises a ``MessageError`` subclass on any problem."""
    if not wire:
        raise MalformedMessageError("empty message")
    mac_len = wire[0]
    if mac_len not in (0, _MAC_SIZE) or len(wire) < 1 + mac_len:
        raise MalformedMessageError(f"bad MAC length {mac_len}")
    mac, body = wire[1 : 1 + mac_len], wire[1 + mac_len :]
    if auth_key:
        if not mac:
            raise MessageAuthError("message carries no MAC but an auth_key is configured")
        if not hmac.compare_digest(mac, _mac(auth_key, body)):
            raise MessageAuthError("message MAC does not match the configured auth_key")
    if len(body) > MAX_MESSAGE_BYTES:
        raise MalformedMessageError(f"message of {len(body)} bytes (limit {MAX_MESSAGE_BYTES})")
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedMessageError(f"message body is not JSON: {exc}") from exc
    except RecursionError:
        # ``[[[[...`` a few thousand deep: the parser's recursion limit, not a crash of ours.
        raise MalformedMessageError("message body is nested too deeply") from None
    except Exception as exc:  # anything a peer's bytes can provoke is a rejected message
        raise MalformedMessageError(f"message body could not be parsed: {exc!r}") from None
    if not isinstance(raw, dict):
        raise MalformedMessageError("message body is not a JSON object")
    if raw.get("v") != PROTOCOL_VERSION:
        raise MessageVersionError(
            f"protocol version {raw.get('v')!r}, this side speaks {PROTOCOL_VERSION}"
        )
    try:
        return _MESSAGE_ADAPTER.validate_json(body)
    except ValidationError as exc:
        raise MalformedMessageError(f"invalid message: {_first_error(exc)}") from None
    except Exception as exc:
        raise MalformedMessageError(f"invalid message: {exc!r}") from None


def _first_error(exc: ValidationError) -> str:
    """The first validation problem, short: a peer's oversized input is not echoed back whole."""
    error = exc.errors(include_url=False, include_input=False)[0]
    return f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"[:300]


def new_routing_id() -> bytes:
    """A fresh ZMQ routing id for one connection a receiver opens (one per address it dials,
    kept for its process's life, so a reconnection hands the same id over). Random, so nobody
    who has not seen the connection can speak on it: the sender binds an agent to the
    connection that first said HELLO for it (``peering``). Never starts with a zero byte (ZMQ
    reserves those)."""
    return b"ss:" + secrets.token_bytes(16)
