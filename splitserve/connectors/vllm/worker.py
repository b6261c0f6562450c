"""SplitserveConnector, worker half: NIXL, the side channel and the layers, in vLLM's worker.

Owns this worker's ``KVAgent`` (its KV cache registered with NIXL), the ZMQ side channel bound to
the configured host and port (plus this worker's tensor parallel rank: ``ranks.py``), a
``KVSender`` (this server as P) and a ``KVReceiver`` (this server as D): every server is both
(``kv_both``). It applies the scheduler half's metadata at the start of each step and reports
settled transfers back through ``get_transfer_results``.

Per step (vLLM's order): ``bind`` (metadata: starts, ends, block tables) -> forward, with
``save_kv_layer`` after each attention layer (post that layer's completed blocks) ->
``wait_for_save`` (close the step) -> ``get_transfer_results`` (poll both halves) ->
``take_worker_meta`` (P's first output tokens of loads that completed in this step, for the
scheduler half). Between steps: vLLM steps only while a request runs or holds blocks, so an
idle P would read a REGISTER, ABORT or HELLO only with its next request (a D that registered
after P's lease expired then waited its whole ``done_timeout_s``: issue #17's P TP 2 -> D TP 1
hang). A daemon thread (the idle drive, ``_drive_idle``) polls the sender once no step ran for
``IDLE_DRIVE_S``, under the worker's lock and never inside a step (``bind`` ..
``get_transfer_results``); what it releases goes out with the next ``get_transfer_results``.

Device paths: on host memory (CPU) a layer's KV is written when its attention op returns, so
``save_kv_layer`` posts at once. On a GPU the attention kernels are asynchronous: the layer's
completion is a CUDA event recorded on the current stream, and a sender thread waits for it
before posting (``transfer.layer_poster.LayerPoster``, shared with ``benchmarks/gpu_proof.py``);
``wait_for_save`` drains that thread before the step ends. The poster runs in the suite with
host events (``gpu_proof --device cpu``); this GPU path inside vLLM is reviewed, not run (no GPU
on our machines).

Tensor parallel: vLLM runs one worker per rank, each with this object; every rank gets the same
metadata (the same block ids: one block table for all ranks) and moves its own KV heads with
the peer rank(s) that hold them (``ranks.source_ranks``: the same rank at equal sizes). At
other sizes every (P rank, D rank) pair moves its own share of the request (``ranks.share_id``):
D wider, a P rank feeds several D ranks, keeps one sender transfer per share and reports the
request sent once the last share settled; P wider, a D rank loads from several P ranks and
reports the load once every share settled, failed if any failed (aborting the others): the
records of those shares are ``shares.Shares``. Each
rank reports its own settled transfers; vLLM's ``KVOutputAggregator`` reports a request
finished only once every rank did and failed if any rank failed it.

State: one ``_Transfer`` record per transfer, keyed by ``(Side, transfer_id)`` (the ids the
sender and receiver report back; the side because a ``kv_both`` server may be P and D of one
transfer), holding the vLLM request id it reports. A transfer's end is the deletion of its
record. Reports owed without a transfer (a reused transfer id, a load the scheduler half failed
at once) and P's first tokens for the scheduler half wait in one ``_Outbox``.

Invariants:
- A request id is reported in ``finished_sending`` / ``finished_recving`` exactly once, and
  only for requests the scheduler half told us about.
- A failed load is reported in ``failed_recving`` (and ``finished_recving``), so vLLM applies
  ``kv_load_failure_policy`` and frees or recomputes; nothing waits forever: every transfer
  has a deadline (lease on P, ``done_timeout_s`` on D), and an idle P still answers D.
- The sender is driven by one thread at a time: the engine's inside a step, the idle drive
  outside one (both under ``_lock``; the GPU poster only inside a step).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from splitserve.connectors.vllm.config import ConnectorConfigError, SplitserveConnectorConfig
from splitserve.connectors.vllm.metadata import (
    SplitserveConnectorMetadata,
    SplitserveWorkerMetadata,
)
from splitserve.connectors.vllm.ranks import Ranks
from splitserve.connectors.vllm.shares import Shares
from splitserve.connectors.vllm.stats import SplitserveKVConnectorStats
from splitserve.connectors.vllm.worker_stats import StatDeltas
from splitserve.transfer import strategy
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.layer_poster import LayerPoster, cuda_device
from splitserve.transfer.layout import kv_layout_from_tensors
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import SideChannel
from splitserve.transfer.tp import heads_of_rank

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# An engine that has not stepped for this long (idle: nothing running, nothing held) has its
# sender driven by the idle drive (``SplitserveWorker._drive_idle``).
IDLE_DRIVE_S = 0.25


class Side(Enum):
    PRODUCE = "produce"  # this server is P of the transfer (``KVSender``)
    RECEIVE = "receive"  # this server is D of the transfer (``KVReceiver``)


class Phase(Enum):
    STREAMING = "streaming"  # P: the engine runs the request; its KV streams to D
    ENDED = "ended"  # P: the engine finished or dropped it; the sender settles the transfer
    LOADING = "loading"  # D: the receiver awaits P's KV


@dataclass
class _Transfer:
    """One transfer's worker-side state; deleted when the sender or receiver settled it."""

    req_id: str
    phase: Phase
    transfer_id: str  # the request's; the record's key is its share (``shares.py``)
    report_sending: bool = False  # P, ENDED: vLLM holds the blocks, report finished_sending


@dataclass
class _Outbox:
    """Reports owed without a transfer record, taken at the next poll (request ids)."""

    sending: set[str] = field(default_factory=set)  # finished_sending
    failed: set[str] = field(default_factory=set)  # finished_recving + failed_recving
    first_tokens: dict[str, int] = field(default_factory=dict)  # D: P's token, this step


class SplitserveWorker:
    """The worker-side state of one worker process (see module docstring)."""

    def __init__(
        self,
        config: SplitserveConnectorConfig,
        engine_id: str,
        num_blocks: int,
        block_size: int,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config
        self.ranks = ranks or Ranks()
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.agent: KVAgent | None = None
        self.channel: SideChannel | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._layer_index: dict[str, int] = {}
        self._lock = threading.Lock()  # sender calls from the GPU poster thread vs this thread
        self._gpu_poster: LayerPoster | None = None
        self._transfers: dict[tuple[Side, str], _Transfer] = {}
        self._outbox = _Outbox()
        self._stepping = False
        # bind .. get_transfer_results: the engine's thread drives sender and receiver; outside
        # a step, past ``idle_drive_s`` since the last, the idle drive polls the sender
        self._in_step = False
        self.idle_drive_s = IDLE_DRIVE_S
        self._clock = time.monotonic
        self._last_step_end = self._clock()
        self._idle_released: set[str] = set()  # sender ids the idle drive released
        self._idle_stop = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self._stat_deltas = StatDeltas()  # what ``stats`` exported last
        self.shares = Shares(self.ranks, config.decode_tp_size)  # each request's, this rank

    # -- start-up -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if os.environ.get("SPLITSERVE_DUMP_STACKS_ON_SIGUSR1"):
            # Debug aid: `kill -USR1 <worker pid>` writes every thread's stack to stderr.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        names = list(kv_caches)
        tensors = [kv_caches[name] for name in names]
        self._layer_index = {name: i for i, name in enumerate(names)}
        ranks = self.ranks
        layout = kv_layout_from_tensors(
            tensors,
            self.num_blocks,
            self.block_size,
            ranks.size,
            ranks.rank,
            head_dim=self._head_dim(tensors),
            total_kv_heads=ranks.total_kv_heads,
        )
        other_sizes = {self.config.prefill_tp_size, self.config.decode_tp_size} - {None, ranks.size}
        if other_sizes and not layout.kv_heads:
            raise ConnectorConfigError(
                f"SplitserveConnector: peers of tensor parallel size {sorted(other_sizes)} (this "
                f"server: {ranks.size}) need each block's KV heads as contiguous sub-runs (heads "
                "outermost inside a block, as vLLM CPU's layout has them); this attention "
                "backend's KV layout does not (equal sizes only)"
            )
        transport = strategy.transport_of()
        direction = strategy.effective(transport, layout.memory, self.config.direction)
        preferred = strategy.choose(transport, layout.memory)
        name = f"splitserve-{self.engine_id}-r{ranks.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = KVAgent(
            name,
            layout,
            backend_params=self.config.ucx_backend_params,
            backends=self.config.nixl_backends,
        )
        key = self.config.load_auth_key()
        port = ranks.port(self.config.side_channel_port)
        self.channel = SideChannel(
            self.config.side_channel_host,
            port,
            key,
            name=f"splitserve-sc-r{ranks.rank}",
            connect_timeout_s=self.config.peer_liveness_s,
            liveness_timeout_s=self.config.peer_liveness_s,
        )
        self.sender = KVSender(
            self.agent,
            self.channel,
            lease_s=self.config.lease_s,
            direction=direction,
            per_peer=self.config.direction == "auto",  # a receiver on another host: push
        )
        self.receiver = KVReceiver(
            self.agent,
            self.channel,
            done_timeout_s=self.config.done_timeout_s,
            abort_ack_timeout_s=self.config.abort_ack_timeout_s,
        )
        if layout.memory == "VRAM":
            self._gpu_poster = LayerPoster(
                self.sender.layer_done, self._lock, on_start=cuda_device(layout.device_id)
            )
        self._idle_thread = threading.Thread(
            target=self._idle_loop, name=f"splitserve-idle-r{ranks.rank}", daemon=True
        )
        self._idle_thread.start()
        logger.info(
            "SplitserveConnector worker (tensor parallel rank %d of %d): %d layers, %d blocks of "
            "%d tokens (%d bytes/block all layers), %s memory, side channel %s:%s (%s), "
            "transport %s, direction %s%s",
            ranks.rank,
            ranks.size,
            len(names),
            layout.num_blocks,
            self.block_size,
            layout.bytes_per_block_all_layers,
            layout.memory,
            self.config.side_channel_host,
            port,
            "authenticated: CurveZMQ under the deployment key" if key else "NO KEY: open",
            transport,
            direction.value,
            "" if direction is preferred else f" (set by 'direction'; {preferred.value} preferred)",
        )

    def _head_dim(self, tensors: list[torch.Tensor]) -> int | None:
        """vLLM's per-layer KV view is [B, H, N, C] (``allocate_kv_cache``): dim 1, when it
        holds this rank's share of the heads; else the heads stay undescribed (equal TP sizes
        only). The strides decide whether a head range is a sub-run (``layout``)."""
        total = self.ranks.total_kv_heads
        if not total or any(t.dim() != 4 for t in tensors):
            return None
        share = len(heads_of_rank(total, self.ranks.size, self.ranks.rank))
        return 1 if all(t.shape[1] == share for t in tensors) else None

    # -- per step -----------------------------------------------------------------------------

    def bind(self, meta: SplitserveConnectorMetadata) -> None:
        sender, receiver = self.sender, self.receiver
        assert sender is not None and receiver is not None, "register_kv_caches not called"
        assert self.channel is not None
        # A dead side channel must stop the engine (its /health then fails), not leave every
        # transfer waiting for its timeout behind a server that looks healthy.
        self.channel.check()
        transfers, outbox, shares_of = self._transfers, self._outbox, self.shares
        with self._lock:
            self._in_step = True  # until get_transfer_results: no idle drive
            for start in meta.produce_start:
                shares = shares_of.start_sending(start.transfer_id, start.decode_tp_size)
                if shares is None:
                    # A client reused a transfer id: that request is served without a transfer.
                    logger.error(
                        "request %s: transfer id %s already in use; no transfer",
                        start.req_id,
                        start.transfer_id,
                    )
                    continue
                for share in shares:  # none: this rank's heads go to D from another rank
                    transfers[(Side.PRODUCE, share)] = _Transfer(
                        start.req_id, Phase.STREAMING, start.transfer_id
                    )
                    sender.add_request(share, start.num_prompt_tokens)
            for end in meta.produce_end:
                shares = shares_of.sending(end.transfer_id)
                if not shares:  # nothing of ours to send: free at once
                    shares_of.forget_sending(end.transfer_id)
                    if end.holds_blocks:
                        outbox.sending.add(end.req_id)
                for share in shares:
                    transfer = transfers.get((Side.PRODUCE, share))
                    if transfer is None or transfer.req_id != end.req_id:
                        if end.holds_blocks:
                            outbox.sending.add(end.req_id)
                        continue
                    transfer.phase = Phase.ENDED
                    transfer.report_sending = end.holds_blocks
                    if end.cancel_reason is None:
                        sender.finish_request(share, end.first_token)
                    else:
                        sender.cancel(share, end.cancel_reason)
            for start in meta.receive_start:
                sources = shares_of.sources(start.transfer_id, start.remote_tp_size)
                if not shares_of.start_loading(start.transfer_id, [s for _, s in sources]):
                    logger.error(
                        "request %s: transfer id %s already awaited by another request",
                        start.req_id,
                        start.transfer_id,
                    )
                    outbox.failed.add(start.req_id)
                    continue
                for source, share in sources:
                    transfers[(Side.RECEIVE, share)] = _Transfer(
                        start.req_id, Phase.LOADING, start.transfer_id
                    )
                    receiver.expect(
                        share,
                        start.side_channel_host,
                        self.ranks.port(start.side_channel_port, source),
                        start.block_ids,
                        start.token_offset,
                        start.first_token,
                    )
            for release in meta.receive_release:
                for source, share in shares_of.sources(release.transfer_id, release.remote_tp_size):
                    receiver.release_remote(
                        share,
                        release.side_channel_host,
                        self.ranks.port(release.side_channel_port, source),
                    )
            outbox.failed.update(meta.receive_fail)
            for abort in meta.receive_abort:
                for share in shares_of.loading(abort.transfer_id):
                    if self._req_id(Side.RECEIVE, share) == abort.req_id:
                        receiver.abort(share, "request aborted on the decode side")
            sender.begin_step(
                StepUpdate(share, step.block_ids, step.computed_after_step)
                for step in meta.produce_steps
                for share in shares_of.sending(step.transfer_id)
                if self._req_id(Side.PRODUCE, share) == step.req_id
            )
        self._stepping = True

    def _req_id(self, side: Side, transfer_id: str) -> str | None:
        transfer = self._transfers.get((side, transfer_id))
        return None if transfer is None else transfer.req_id

    def save_kv_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or self.sender is None:
            return
        if self._gpu_poster is not None:
            self._gpu_poster.submit(layer)
            return
        self.sender.layer_done(layer)

    def wait_for_save(self) -> None:
        if not self._stepping or self.sender is None:
            return
        if self._gpu_poster is not None:
            self._gpu_poster.drain()
        with self._lock:
            self.sender.end_step()
        self._stepping = False

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) request ids."""
        if self.sender is None or self.receiver is None:
            return set(), set(), set()
        if self._stepping:  # a step without wait_for_save (should not happen): close it
            self.wait_for_save()
        with self._lock:
            released = self.sender.poll() | self._idle_released
            self._idle_released = set()
        outbox = self._outbox
        sending, outbox.sending = outbox.sending, set()
        for transfer_id in released:
            transfer = self._transfers.pop((Side.PRODUCE, transfer_id), None)
            if transfer is None or not self.shares.released(transfer.transfer_id, transfer_id):
                continue  # not ours, or the request's blocks wait for its other shares
            if transfer.report_sending:
                sending.add(transfer.req_id)
        failed, outbox.failed = outbox.failed, set()
        recving = set(failed)
        for transfer_id, outcome in self.receiver.poll().items():
            transfer = self._transfers.pop((Side.RECEIVE, transfer_id), None)
            if transfer is None:
                continue
            req_id = transfer.req_id
            settled = self.shares.settle(
                transfer.transfer_id,
                transfer_id,
                outcome.ok,
                outcome.first_token,
                outcome.reason,
                self.receiver.abort,
            )
            if settled is None:
                continue  # other shares of the request still loading
            ok, token, reason = settled
            recving.add(req_id)
            if ok and token is not None:
                outbox.first_tokens[req_id] = token
            if not ok:
                failed.add(req_id)
                logger.error("KV load for request %s failed: %s", req_id, reason)
        with self._lock:
            self._in_step = False
            self._last_step_end = self._clock()
        return sending, recving, failed

    def _idle_loop(self) -> None:
        while not self._idle_stop.wait(self.idle_drive_s):
            try:
                self._drive_idle()
            except Exception:  # the engine's own polls go on; only the idle drive ends
                logger.exception("SplitserveConnector: idle drive of the sender failed; stopped")
                return

    def _drive_idle(self) -> bool:
        """An idle engine steps no more, so nothing reads the sender's side of the channel: a
        REGISTER (a late D's, after the lease expired; one for a request this P never gets),
        an ABORT or a HELLO would wait for the next request P gets, and D with it (its
        ``done_timeout_s``). Past ``idle_drive_s`` without a step, poll the sender here, under
        the lock (``bind`` takes it first and the engine's thread holds the step until
        ``get_transfer_results``, so the two never drive the sender at once); what it releases
        is reported by the next ``get_transfer_results``. True when it polled."""
        if self._in_step or self.sender is None:
            return False
        with self._lock:
            if self._in_step or self._clock() - self._last_step_end < self.idle_drive_s:
                return False
            self._idle_released |= self.sender.poll()
        return True

    def take_worker_meta(self) -> SplitserveWorkerMetadata | None:
        """P's first tokens of the loads reported finished by the last ``get_transfer_results``."""
        if not self._outbox.first_tokens:
            return None
        tokens, self._outbox.first_tokens = self._outbox.first_tokens, {}
        return SplitserveWorkerMetadata(tokens)

    # -- stats and shutdown -------------------------------------------------------------------

    def stats(self) -> SplitserveKVConnectorStats | None:
        if self.sender is None or self.receiver is None or self.channel is None:
            return None
        with self._lock:  # the idle drive may be counting
            return self._stat_deltas(self.sender, self.receiver, self.channel)

    def shutdown(self) -> None:
        self._idle_stop.set()
        if self._idle_thread is not None:
            self._idle_thread.join(timeout=5)
        if self._gpu_poster is not None:
            self._gpu_poster.close()
        if self.channel is not None:
            self.channel.close()
        if self.agent is not None:
            self.agent.close()
