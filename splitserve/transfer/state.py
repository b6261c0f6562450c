"""The states of one KV transfer and the one place where they change.

Engine-agnostic; used by the sender (P) and the receiver (D) in whatever process runs them.

Sender (P):   AWAITING_REGISTRATION -> STREAMING -> FLUSHING -> CLOSING -> COMPLETED
              (FLUSHING: every block is out; CLOSING: DONE is on its way, on the final WRITE
              (push) or after the last ANNOUNCE (pull), until it completes or D says PULLED)
              AWAITING_REGISTRATION -> COMPLETED (D needs no blocks)
              FLUSHING -> COMPLETED (pull: D said PULLED before DONE, it had the first token)
              any non-terminal -> ABORTED (D said ABORT, or P's request was cancelled)
              AWAITING_REGISTRATION -> EXPIRED (no registration within the lease)
              CLOSING -> EXPIRED (pull: no PULLED within the lease after DONE)
              STREAMING / FLUSHING / CLOSING -> FAILED (a WRITE failed, registration invalid)
Receiver (D): REGISTERED -> COMPLETED (DONE arrived)
              REGISTERED -> FAILED (P sent ABORT, P's process died)
              REGISTERED -> EXPIRED (no DONE within done_timeout_s)
              REGISTERED -> ABORTED (D's request was aborted; waits for P's ABORT_ACK)

Invariants:
- ``Transfer.transition`` is the only way a state changes; an illegal transition raises
  ``IllegalTransition`` (a bug, never a peer's doing: peers' messages are checked first).
- Terminal states never change again; ``reason`` records why the transfer ended.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


class TransferState(enum.Enum):
    AWAITING_REGISTRATION = "awaiting_registration"
    STREAMING = "streaming"
    FLUSHING = "flushing"
    CLOSING = "closing"
    REGISTERED = "registered"
    COMPLETED = "completed"
    ABORTED = "aborted"
    EXPIRED = "expired"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {
    TransferState.COMPLETED,
    TransferState.ABORTED,
    TransferState.EXPIRED,
    TransferState.FAILED,
}

_S = TransferState
_ALLOWED: dict[TransferState, set[TransferState]] = {
    _S.AWAITING_REGISTRATION: {_S.STREAMING, _S.COMPLETED, _S.ABORTED, _S.EXPIRED, _S.FAILED},
    _S.STREAMING: {_S.FLUSHING, _S.ABORTED, _S.FAILED, _S.EXPIRED},
    _S.FLUSHING: {_S.CLOSING, _S.COMPLETED, _S.ABORTED, _S.FAILED, _S.EXPIRED},
    _S.CLOSING: {_S.COMPLETED, _S.ABORTED, _S.FAILED, _S.EXPIRED},
    _S.REGISTERED: {_S.COMPLETED, _S.FAILED, _S.EXPIRED, _S.ABORTED},
}


class IllegalTransition(RuntimeError):
    """A transition the state machine does not allow (a bug in the caller)."""


@dataclass
class Transfer:
    """One transfer's state, deadline and history (kept short: state and reason)."""

    transfer_id: str
    state: TransferState
    deadline: float | None = None  # monotonic seconds; meaning depends on the state
    reason: str = ""
    created: float = field(default_factory=time.monotonic)
    changed: float = field(default_factory=time.monotonic)

    def transition(self, new_state: TransferState, reason: str = "") -> None:
        if new_state not in _ALLOWED.get(self.state, set()):
            raise IllegalTransition(
                f"transfer {self.transfer_id}: {self.state.value} -> {new_state.value}"
            )
        log = logger.warning if new_state in (_S.FAILED, _S.EXPIRED) else logger.debug
        log(
            "transfer %s: %s -> %s%s",
            self.transfer_id,
            self.state.value,
            new_state.value,
            f" ({reason})" if reason else "",
        )
        self.state = new_state
        self.reason = reason or self.reason
        self.changed = time.monotonic()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
