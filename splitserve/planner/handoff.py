"""Handoff arithmetic: how long the KV of a request takes to move, and how much of it is exposed.

Pure functions; runs in the caller's process.

With ``L`` layers, a per-layer slice transfer time ``t_x = a + s / B`` (fixed cost ``a``, slice
``s`` bytes, link ``B`` bytes/s) and a per-layer prefill time ``t_c``:
- bulk (transfer after prefill ends, one transfer): ``a + L s / B``, all of it exposed;
- layer-wise streaming (layer ``i``'s slice leaves when layer ``i`` is computed): the last
  slice leaves at ``L t_c`` at the earliest, and a queue builds when ``t_x > t_c``, so the time
  exposed after prefill ends is ``t_x + (L - 1) max(0, t_x - t_c)``.
Streaming hides everything but the last slice exactly when ``t_x <= t_c``.

Two terms refine the streaming figure where they are known (both default to 0, which leaves it
as above): the forward's *tail* ``t_tail``, the compute after the last layer's KV is written
(the rest of that layer, the final norm: the last slice moves meanwhile, so the tail hides up
to ``t_tail`` of what is left), and ``t_done``, the delivery of the DONE that tells D the KV is
complete. Measured from the forward's end (where a connector can start a clock):
``max(0, t_x + (L - 1) max(0, t_x - t_c) - t_tail) + t_done``. The tail is measured, not
derived: on a CPU it was 0.25-0.3 of a layer's time, below the FLOP share after the hook
(docs/benchmarks.md, viability line).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.planner.catalog import Link


def transfer_seconds(nbytes: float, link: Link) -> float:
    """One transfer of ``nbytes`` over ``link``: fixed cost plus bytes over bandwidth."""
    return link.per_transfer_s + nbytes / link.bytes_per_s


def exposed_streaming_seconds(
    num_layers: int,
    layer_transfer_s: float,
    layer_compute_s: float,
    forward_tail_s: float = 0.0,
    done_s: float = 0.0,
) -> float:
    """Time from the forward's end to D knowing the last slice landed, streaming layer by
    layer; ``forward_tail_s`` (compute after the last slice leaves) hides that much of the
    transfer, ``done_s`` (DONE's delivery) adds to it. Both 0: from the last layer computed to
    the last slice landed."""
    backlog = layer_transfer_s + (num_layers - 1) * max(0.0, layer_transfer_s - layer_compute_s)
    return max(0.0, backlog - forward_tail_s) + done_s


@dataclass(frozen=True)
class Handoff:
    """The handoff of one request over one link."""

    link: str
    link_bytes_per_s: float
    links_in_parallel: int
    request_bytes: float
    layer_slice_bytes: float
    bulk_s: float
    layer_transfer_s: float
    layer_compute_s: float
    exposed_bulk_s: float
    exposed_streaming_s: float

    @property
    def streaming_hides(self) -> bool:
        """True when each slice moves no slower than the next layer computes."""
        return self.layer_transfer_s <= self.layer_compute_s

    @property
    def transfer_to_compute(self) -> float:
        return (
            self.layer_transfer_s / self.layer_compute_s if self.layer_compute_s else float("inf")
        )


def handoff(
    link: Link,
    num_layers: int,
    layer_slice_bytes: float,
    layer_compute_s: float,
    links_in_parallel: int = 1,
    forward_tail_s: float = 0.0,
    done_s: float = 0.0,
) -> Handoff:
    """The handoff of a request whose per-layer KV slice is ``layer_slice_bytes``, with
    ``links_in_parallel`` links (one per tensor-parallel rank, each carrying its share);
    ``forward_tail_s`` and ``done_s`` as in ``exposed_streaming_seconds`` (0: unknown)."""
    share = layer_slice_bytes / links_in_parallel
    layer_x = transfer_seconds(share, link)
    bulk = transfer_seconds(share * num_layers, link)
    return Handoff(
        link=link.name,
        link_bytes_per_s=link.bytes_per_s,
        links_in_parallel=links_in_parallel,
        request_bytes=layer_slice_bytes * num_layers,
        layer_slice_bytes=layer_slice_bytes,
        bulk_s=bulk,
        layer_transfer_s=layer_x,
        layer_compute_s=layer_compute_s,
        exposed_bulk_s=bulk,
        exposed_streaming_s=exposed_streaming_seconds(
            num_layers, layer_x, layer_compute_s, forward_tail_s, done_s
        ),
    )
