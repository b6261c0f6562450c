"""What one worker's transfer layer counted since the last step, as vLLM's connector stats.

Runs in vLLM's worker process: ``SplitserveWorker.stats`` (``worker.py``) calls ``StatDeltas``
under the worker's lock (the idle drive may be counting). It reads the cumulative totals of the
worker's ``KVSender`` (P), ``KVReceiver`` (D) and side channel, by the names of the shared
catalogue (``splitserve.connectors.counters``), and fills a ``SplitserveKVConnectorStats``
(``stats.py``) with what changed. Split from ``worker.py`` so that the mapping from the
transfer layer's stats to the exported counters sits in one short module, apart from the
per-step bookkeeping of the transfers.

Invariants: counters travel as deltas (each total exported once, so aggregation is addition);
samples (exposed handoffs, forward tails) are taken from the transfer layer's lists, which are
emptied, so each sample is in exactly one step's stats; no change at all gives None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitserve.connectors.vllm.stats import (
    COUNTERS,
    HANDOFF,
    TAIL,
    SplitserveKVConnectorStats,
)

if TYPE_CHECKING:
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.sender import KVSender
    from splitserve.transfer.side_channel import SideChannel


class StatDeltas:
    """The counters' totals at the previous call, to export what changed since."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def __call__(
        self, sender: KVSender, receiver: KVReceiver, channel: SideChannel
    ) -> SplitserveKVConnectorStats | None:
        s, r = sender.stats, receiver.stats
        totals: dict[str, Any] = {
            "bytes_sent": s.bytes_sent,
            "writes_posted": s.writes_posted,
            "transfers_completed": s.transfers_completed,
            "transfers_failed": s.transfers_failed,
            "transfers_aborted": s.transfers_aborted,
            "lease_expiries": s.lease_expiries,
            "registrations_received": s.registrations_received,
            "registrations_rejected": s.registrations_rejected,
            "messages_rejected": channel.rejected + r.messages_rejected,
            "loads_completed": r.transfers_completed,
            "loads_failed": r.transfers_failed,
            "done_timeouts": r.done_timeouts,
            "post_seconds": s.post_seconds + r.post_seconds,
            "announces_sent": s.announces_sent,
            "reads_posted": r.reads_posted,
            "bytes_read": r.bytes_read,
            "first_tokens_relayed": channel.relayed,
            "loads_completed_on_first_token": r.completed_on_first_token,
            "layers_posted_in_forward": s.layers_posted_in_forward,
            "layers_posted_at_step_end": s.layers_posted_at_step_end,
            "transfers_stalled": s.transfers_stalled,
            "reads_cancelled": r.reads_cancelled,
            "peers_dropped": sum(
                n for kind, n in channel.stats.dropped_peers.items() if kind != "idle"
            ),
        }
        data: dict[str, Any] = {}
        for name in COUNTERS:
            data[name] = totals[name] - self.last.get(name, 0)
            self.last[name] = totals[name]
        data[HANDOFF] = list(r.handoffs_s)
        r.handoffs_s.clear()
        data[TAIL] = list(s.forward_tails_s)
        s.forward_tails_s.clear()
        stats = SplitserveKVConnectorStats(data=data)
        return None if stats.is_empty() else stats
