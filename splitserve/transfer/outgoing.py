"""What the prefill side (P) keeps per transfer, and the interface of its two directions.

Engine-agnostic; used by ``sender.KVSender`` (the protocol, shared by both directions) and by
its direction strategies ``send_push.PushSending`` and ``send_pull.PullSending``. Nothing here
changes a transfer's state: ``KVSender`` does, through ``Transfer.transition`` (state.py), and a
strategy only answers what happened (a failure reason, a completion).

Invariants:
- ``Outgoing.handles`` holds exactly this transfer's posts still in flight: the blocks they
  copy may not be freed while it is non-empty.
- A strategy keeps nothing per transfer beyond what ``release`` forgets.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from splitserve.transfer import messages
from splitserve.transfer.agent import XferHandle
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import PeerRef
from splitserve.transfer.state import Transfer
from splitserve.transfer.strategy import Direction


@dataclass
class StepUpdate:
    """One producing request's state for the step about to run."""

    transfer_id: str
    block_ids: list[int]  # P's block ids for the request, logical order, at least as many as used
    computed_after_step: int  # tokens whose KV is complete once this step's forward ends


@dataclass
class SenderStats:
    bytes_sent: int = 0  # written (push) or announced for D to read (pull)
    writes_posted: int = 0
    announces_sent: int = 0  # pull: one per layer per step, or one per catch-up
    transfers_completed: int = 0
    transfers_failed: int = 0
    transfers_aborted: int = 0
    lease_expiries: int = 0
    transfers_stalled: int = 0  # failed: no post completed within the lease (silent transport)
    registrations_received: int = 0
    registrations_rejected: int = 0
    # Seconds this side spent inside WRITE posts (pull: ANNOUNCE sends), on the thread that
    # posts (the forward's, or the GPU poster's). Over UCX's cma a WRITE's copy runs inside the
    # post, so this is what the transfer costs the prefill side's CPU; over tcp the bytes move
    # later, in progress. A pull leaves the copy to D: here only the message's cost remains.
    post_seconds: float = 0.0
    # The overlap proof: layers the engine's per-layer hook reported during a step that had
    # transfers in it (posted while the forward ran), and layers the hook never reported, which
    # ``end_step`` posted after the forward. A layer-wise transfer shows the first growing and
    # the second at zero; a hook that stopped firing turns every layer into the second.
    layers_posted_in_forward: int = 0
    layers_posted_at_step_end: int = 0
    # Per request whose prompt a step completed: seconds from the step's last per-layer hook
    # (the last slice posted) to the forward's end (``end_step``, where the exposed handoff's
    # clock starts). The last slice moves during this tail, which the planner's streaming model
    # subtracts (``planner.handoff``). Drained by the engine's stats export; bounded for one
    # that does not drain it.
    forward_tails_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class Reply(enum.Enum):
    """What D is still owed once the transfer is terminal and nothing of it is in flight."""

    BY_STATE = "by_state"  # ABORT unless COMPLETED (DONE itself told D)
    ABORT_ACK = "abort_ack"  # D aborted: acknowledge, so D may free its blocks
    SENT = "sent"  # told already, or D needs no word (it never registered)


@dataclass
class Outgoing:
    """One transfer on P: its record, the request's blocks and D's registration."""

    record: Transfer
    num_tokens: int
    aux_row: int | None = None  # P's row in the aux layers
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is complete (after the last step that ended)
    step_computed: int | None = None  # ... once the running step ends (None: not in it)
    prefill_end_wall: float | None = None  # wall clock when the last forward returned
    request_finished: bool = False  # the engine holds the blocks for us (lease running)
    first_token: int | None = None  # the engine's first output token, from finish_request
    peer: PeerRef | None = None  # D, once it registered (also for a refused registration)
    peer_agent: str | None = None  # D's NIXL agent name
    registration: messages.Register | None = None  # D's valid REGISTER
    first: int = 0  # the first logical block D asked for (it holds those before)
    sent_upto: int = 0  # logical blocks [first, sent_upto) posted for every layer
    handles: list[XferHandle] = field(default_factory=list)  # posts in flight
    stall_mark: float | None = None  # when a post last completed (or the first was posted)
    reply: Reply = Reply.BY_STATE

    @property
    def dst_blocks(self) -> list[int]:
        """D's block ids for logical blocks ``[first, end)`` (read-only: D's message)."""
        reg = self.registration
        return reg.block_ids[0] if reg is not None and reg.block_ids else []

    @property
    def dst_aux_row(self) -> int | None:
        return self.registration.aux_row if self.registration is not None else None

    @property
    def wants_token(self) -> bool:
        """D asked for the first output token with DONE."""
        return self.registration is not None and bool(self.registration.first_token)

    @property
    def end(self) -> int:
        return self.first + len(self.dst_blocks)


def registration_problem(
    out: Outgoing,
    reg: messages.Register,
    block_size: int,
    peer_layout: KVLayout | None,
    aux_layers: list[int],
) -> str | None:
    """Why D's registration cannot be served (``None``: it can). ``peer_layout`` is the
    registering agent's layout: D's block ids are checked against it before anything is
    posted, so a peer can never make us write outside its cache."""
    if len(reg.block_ids) > 1:
        return f"{len(reg.block_ids)} KV cache groups, this sender supports one"
    if reg.token_offset % block_size:
        return f"token offset {reg.token_offset} not a multiple of block size"
    dst = reg.block_ids[0] if reg.block_ids else []
    first = reg.token_offset // block_size
    total = math.ceil(out.num_tokens / block_size)
    if first + len(dst) > total:
        return f"asks blocks {first}..{first + len(dst) - 1}, request has {total}"
    if len(set(dst)) != len(dst):
        return "duplicate destination block ids"
    if (reg.aux_row is None) != (out.aux_row is None):
        return f"aux row {reg.aux_row!r}, this request's is {out.aux_row!r}"
    if peer_layout is None:
        return f"unknown peer agent {reg.agent_name!r}"
    try:
        peer_layout.validate_block_ids(dst, "registered block")
        if reg.aux_row is not None:
            peer_layout.validate_block_ids([reg.aux_row], "registered aux row", aux_layers[0])
    except ValueError as exc:
        return str(exc)
    return None


class SendStrategy:
    """How P hands a layer's blocks to D: the interface of ``PushSending`` / ``PullSending``.

    Each method answers a failure reason (``None``: fine) where one is possible; the sender
    then fails the transfer. Defaults are the push behaviour where push needs nothing."""

    direction: Direction

    def hello_ack(self) -> messages.HelloAck:
        """The answer to D's HELLO."""
        raise NotImplementedError

    def registered(self, out: Outgoing) -> None:
        """D's registration was accepted."""

    def post(self, out: Outgoing, layers: list[int], src: list[int], dst: list[int]) -> str | None:
        """Hand D the blocks ``src`` (ours) for ``dst`` (D's) of ``layers``."""
        raise NotImplementedError

    def close(self, out: Outgoing, done: messages.Done) -> str | None:
        """Every block is out (and the engine gave what DONE needs): send ``done``."""
        raise NotImplementedError

    def progress(self, out: Outgoing) -> str | None:
        """Settle this transfer's posts (``out.handles``)."""
        return None

    def delivered(self, out: Outgoing) -> bool:
        """DONE is known to have reached D (the transfer completes)."""
        return False

    def pulled(self, out: Outgoing) -> bool:
        """D said PULLED for ``out`` (from its registered peer): does that complete it?"""
        return False

    def release(self, out: Outgoing) -> None:
        """The transfer is over and its blocks are freed: drop what is kept for it."""


def stalled(out: Outgoing, in_flight: list[XferHandle], now: float, limit_s: float) -> bool:
    """Track when a post of ``out`` last completed (``in_flight``: its posts before this
    round's progress); True when posts are in flight and none completed for ``limit_s``: the
    transport went silent (a partition, a wedged peer). Posts that keep completing, however
    long the prefill, never stall."""
    if not out.handles:
        out.stall_mark = None
        return False
    if out.stall_mark is None or any(h not in out.handles for h in in_flight):
        out.stall_mark = now
        return False
    return now - out.stall_mark >= limit_s
