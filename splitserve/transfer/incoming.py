"""What the decode side (D) keeps per transfer, and what it hands the engine when one settles.

Engine-agnostic; used by ``receiver.KVReceiver`` (the protocol, shared by both directions) and
by its direction strategies ``recv_push.PushReceiving`` and ``recv_pull.PullReceiving``, which
set ``Incoming.ready`` when P said the blocks are filled; the receiver alone completes the load
(``KVReceiver._progress_load``) and changes states.

Invariants:
- ``Incoming.reads`` holds exactly this transfer's READs still in flight (pull): no outcome
  reaches the engine while it is non-empty (``final`` waits instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.transfer import messages
from splitserve.transfer.agent import XferHandle
from splitserve.transfer.side_channel import PeerRef
from splitserve.transfer.state import Transfer


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reason: str = ""
    exposed_handoff_s: float | None = None  # P's last forward returned -> DONE seen here
    first_token: int | None = None  # P's first output token, when the registration asked


@dataclass
class ReceiverStats:
    transfers_completed: int = 0
    transfers_failed: int = 0
    done_timeouts: int = 0
    messages_rejected: int = 0
    reads_posted: int = 0  # pull: one READ per ANNOUNCE
    bytes_read: int = 0
    post_seconds: float = 0.0  # pull: seconds inside READ posts (over cma: the copy, on D)
    completed_on_first_token: int = 0  # pull: completed on P's FIRST_TOKEN, not its DONE
    reads_cancelled: int = 0  # pull: READs of an ended load cancelled past their deadline
    registered_again: int = 0  # REGISTERs sent again after P refused the connection's HELLO
    handoffs_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Ready:
    """P said every block is filled (DONE, or pull's FIRST_TOKEN once all is announced): the
    load completes with these once no READ of ours is in flight."""

    prefill_end_wall: float  # P's wall clock when its last forward returned (or it sampled)
    first_token: int | None = None


@dataclass
class Incoming:
    """One transfer on D: what we registered and how far its load got."""

    record: Transfer
    peer: PeerRef
    num_blocks: int
    wants_token: bool = False
    dst_blocks: frozenset[int] = frozenset()  # what we registered (pull: READ targets)
    outcome: Outcome | None = None  # decided, held back until P's ABORT_ACK
    ready: Ready | None = None  # P said the blocks are filled; completes once no READ is left
    final: Outcome | None = None  # settled, given to the engine once no READ is in flight
    reads: list[XferHandle] = field(default_factory=list)  # pull: posted, not settled
    reads_deadline: float | None = None  # an ended load's READs are cancelled past this
    read_pairs: set[tuple[int, int]] = field(default_factory=set)  # pull: (layer, block) read
    early_token: messages.FirstToken | None = None  # pull: P's engine's token, before DONE
    register: messages.Register | None = None  # what we sent P (sent again after a refusal)
    hello_count: int = 0  # our HELLOs to P before that REGISTER (which HELLO it followed)
    registered_again: bool = False  # sent again once after a HELLO refusal; never twice

    @property
    def started(self) -> bool:
        """P has shown it serves this registration (an ANNOUNCE, a READ, DONE, a token)."""
        return bool(self.reads or self.read_pairs) or not (
            self.ready is None and self.final is None and self.early_token is None
        )


def done_problem(inc: Incoming, done: messages.Done) -> str | None:
    """Why ``done`` cannot complete ``inc`` (``None``: it can), whichever way it came."""
    if done.num_blocks != inc.num_blocks:
        return f"DONE covers {done.num_blocks} blocks, expected {inc.num_blocks}"
    if inc.wants_token and done.first_token is None:
        return "DONE carries no first token (does the prefill side predate it?)"
    return None
