"""Pull, P's side: P ANNOUNCEs each layer's blocks on the side channel and D READs them.

Engine-agnostic; runs in the thread that posts for ``KVSender``. Every place that would post a
WRITE sends an ANNOUNCE of the same (layers, P blocks, D blocks) instead, and D READs them. DONE
then goes on the side channel after the last ANNOUNCE (same socket: in order), and the transfer
is delivered only when D answers PULLED (every READ of it done): only then may P free. No
PULLED within ``lease_s`` of DONE (D died): the sender expires the transfer.

A D that asked for the first token usually answers PULLED before DONE: the engine's
FIRST_TOKEN reaches it through the side channel's relay (set up here at registration) as soon as
the token is sampled, and D needs nothing more once every block is announced. So PULLED also
delivers a first-token transfer that is FLUSHING (all announced) before its DONE went out.

While a pull is open the agent's progress thread calls into NIXL (``KVAgent.hold_progress``),
so D's READs complete while this thread computes: at the slow rate while the request computes,
at the fast rate once all is announced (D's last READs are then what D waits for). The HELLO_ACK
carries P's agent metadata and layout for D to read from. Aux rows are not carried by a pull.

Invariants:
- One hold per open transfer, taken at its first ANNOUNCE and dropped at ``release``; a pull
  that ended without PULLED keeps the agent progressing a lease longer (D's READs still in
  flight complete only while P calls into NIXL).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.outgoing import Outgoing, SenderStats, SendStrategy
from splitserve.transfer.side_channel import SideChannel
from splitserve.transfer.state import TransferState
from splitserve.transfer.strategy import Direction

S = TransferState


class PullSending(SendStrategy):
    """P ANNOUNCEs, D READs (see module docstring)."""

    direction = Direction.PULL

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        stats: SenderStats,
        *,
        lease_s: float,
        clock: Callable[[], float],
    ) -> None:
        if agent.layout.aux_layers:
            raise ValueError("the pull direction does not carry aux rows; use push")
        self.agent = agent
        self.channel = channel
        self.stats = stats
        self.lease_s = lease_s
        self.clock = clock
        self._holds: dict[str, bool] = {}  # transfer id -> its progress hold is urgent

    def hello_ack(self) -> messages.HelloAck:
        """D reads from us: it needs our metadata and layout."""
        return messages.HelloAck(
            agent_name=self.agent.name,
            direction="pull",
            agent_metadata=self.agent.metadata(),
            layout=self.agent.layout.wire(),
        )

    def registered(self, out: Outgoing) -> None:
        if out.wants_token:  # the engine's FIRST_TOKEN goes straight to D
            self.channel.relay_first_token(out.record.transfer_id, out.peer)

    def post(self, out: Outgoing, layers: list[int], src: list[int], dst: list[int]) -> str | None:
        """ANNOUNCE: tell D these (layers x blocks) are complete."""
        layout = self.agent.layout
        t0 = time.perf_counter()  # a cost, not a deadline
        try:
            for layer in layers:
                layout.validate_block_ids(src, "local block", layer)
        except ValueError as exc:
            return f"ANNOUNCE not sent: {exc}"
        if out.record.transfer_id not in self._holds:
            self._hold(out.record.transfer_id, urgent=False)
        announce = messages.Announce(
            transfer_id=out.record.transfer_id,
            layers=list(layers),
            src_block_ids=list(src),
            dst_block_ids=list(dst),
        )
        assert out.peer is not None
        self.channel.send(out.peer, announce)
        self.stats.post_seconds += time.perf_counter() - t0
        self.stats.announces_sent += 1
        self.stats.bytes_sent += len(src) * sum(layout.layers[i].block_bytes for i in layers)
        return None

    def close(self, out: Outgoing, done: messages.Done) -> str | None:
        """DONE after the last ANNOUNCE (same socket, so D sees it after them); PULLED is due
        within a lease."""
        assert out.peer is not None
        self.channel.send(out.peer, done)
        out.record.deadline = self.clock() + self.lease_s
        return None

    def progress(self, out: Outgoing) -> str | None:
        """Everything announced: D's last READs are on the critical path, round fast."""
        transfer_id = out.record.transfer_id
        urgent = self._holds.get(transfer_id)
        if urgent is False and out.record.state in (S.FLUSHING, S.CLOSING):
            self._hold(transfer_id, urgent=True)
        return None

    def pulled(self, out: Outgoing) -> bool:
        # Before our DONE only when D had the first token from the engine's FIRST_TOKEN (and
        # so needed no DONE): it completes once all is announced (FLUSHING) and read.
        state = out.record.state
        return state is S.CLOSING or (state is S.FLUSHING and out.wants_token)

    def release(self, out: Outgoing) -> None:
        transfer_id = out.record.transfer_id
        if transfer_id in self._holds:
            if out.record.state is not S.COMPLETED:
                # D may still have READs of these blocks in flight (it aborted, or we failed):
                # they complete only while we call into NIXL.
                self.agent.linger_progress(self.lease_s)
            self._hold(transfer_id, urgent=None)
        if out.wants_token:
            self.channel.relay_first_token(transfer_id, None)

    def _hold(self, transfer_id: str, urgent: bool | None) -> None:
        """Hold the agent's progress for D's READs (``urgent``: at the fast rate), or drop the
        hold (``None``)."""
        held = self._holds.pop(transfer_id, None)
        if held is not None:
            self.agent.drop_progress(urgent=held)
        if urgent is not None:
            self.agent.hold_progress(urgent=urgent)
            self._holds[transfer_id] = urgent
