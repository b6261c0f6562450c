"""Push, P's side: P WRITEs each layer's blocks into D's registered memory.

Engine-agnostic; runs in the thread that posts for ``KVSender`` (the forward's, or a GPU poster
thread). Every block handed to D is one NIXL WRITE posted here; DONE is a NIXL notification on
one final WRITE (the "carrier") posted once every other WRITE of the transfer completed, so it
reaches D after the data. The carrier copies the aux rows when the transfer has them (the
engine fills them when it samples the first token), else the last block of the last layer
again (already written: an idempotent copy). The transfer is delivered when the carrier
completes.

Invariants:
- Every WRITE and the carrier sit in ``Outgoing.handles`` until ``KVAgent.settle`` retires
  them; the carrier is the only post in flight once the transfer is CLOSING.
"""

from __future__ import annotations

import time

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent, TransferPostError
from splitserve.transfer.outgoing import Outgoing, SenderStats, SendStrategy
from splitserve.transfer.side_channel import SideChannel
from splitserve.transfer.state import TransferState
from splitserve.transfer.strategy import Direction


class PushSending(SendStrategy):
    """P WRITEs (see module docstring)."""

    direction = Direction.PUSH

    def __init__(self, agent: KVAgent, channel: SideChannel, stats: SenderStats) -> None:
        self.agent = agent
        self.channel = channel
        self.stats = stats
        layout = agent.layout
        self.last_layer = layout.num_kv_layers - 1
        self.aux_layers = list(range(layout.num_kv_layers, len(layout.layers)))

    def hello_ack(self) -> messages.HelloAck:
        return messages.HelloAck(agent_name=self.agent.name)

    def post(self, out: Outgoing, layers: list[int], src: list[int], dst: list[int]) -> str | None:
        all_layers = [layer for layer in layers for _ in src]
        t0 = time.perf_counter()  # a cost, not a deadline: the real clock, not the sender's
        try:
            handle = self.agent.post(
                "WRITE", out.peer_agent, all_layers, src * len(layers), dst * len(layers)
            )
        except (TransferPostError, ValueError) as exc:
            return f"WRITE not posted: {exc}"
        finally:
            self.stats.post_seconds += time.perf_counter() - t0
        out.handles.append(handle)
        self.stats.writes_posted += 1
        self.stats.bytes_sent += handle.num_bytes
        return None

    def close(self, out: Outgoing, done: messages.Done) -> str | None:
        """Post the carrier: the final WRITE, with DONE as its notification."""
        notif = messages.encode(done, self.channel.auth_key)
        if out.dst_aux_row is not None:
            n_aux = len(self.aux_layers)
            layers, src, dst = self.aux_layers, [out.aux_row] * n_aux, [out.dst_aux_row] * n_aux
        else:
            layers = [self.last_layer]
            src, dst = [out.block_ids[out.end - 1]], [out.dst_blocks[-1]]
        try:
            carrier = self.agent.post("WRITE", out.peer_agent, layers, src, dst, notif=notif)
        except (TransferPostError, ValueError) as exc:
            return f"DONE not posted: {exc}"
        out.handles.append(carrier)
        return None

    def progress(self, out: Outgoing) -> str | None:
        out.handles, failed = self.agent.settle(out.handles)
        if not failed:
            return None
        if out.record.state is TransferState.CLOSING:
            return "DONE WRITE failed"
        return f"WRITE to {failed[0].peer} failed"

    def delivered(self, out: Outgoing) -> bool:
        """The carrier completed: D has DONE, after every block."""
        return out.record.state is TransferState.CLOSING and not out.handles
