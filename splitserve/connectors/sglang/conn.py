"""The ``splitserve`` SGLang transfer backend: SGLang's ``Common*`` disaggregation classes over
``splitserve.transfer``.

Runs in SGLang's scheduler process of a prefill (P) or decode (D) server; every method here is
called from the scheduler thread (SGLang's own worker threads are not started). SGLang selects
these classes through ``--disaggregation-transfer-backend splitserve`` (registered by the plugin,
``splitserve.connectors.sglang.registry``). What each side does, in SGLang's names:

- Bootstrap (``CommonKVBootstrapServer``, unchanged): P registers its rank with the bootstrap
  server; the rank's port is our side channel's (a ZMQ ROUTER), so D's ``bootstrap_infos`` name
  it. The router's ``bootstrap_room`` is the transfer id.
- D, ``send_metadata(kv_indices, aux_index, ...)``: ``KVReceiver.expect`` (HELLO on first
  contact, then REGISTER with D's pages, its radix-cache prefix as the token offset, and its aux
  row). ``abort`` sends our ABORT. ``poll`` drives the receiver: DONE -> ``Success``; P's ABORT,
  P's process lost or no DONE in time -> ``Failed`` with the reason.
- P, ``poll`` while ``Bootstrapping``: D's REGISTER arrived -> ``WaitingForInput`` (its token
  offset is SGLang's ``decode_prefix_len``). ``init(num_pages, aux_index)``:
  ``KVSender.add_request``. ``send(kv_indices)`` per chunk: the chunk's pages join the request's
  page table and every layer not yet posted is written (with the layer-wise hooks on, see
  ``splitserve.connectors.sglang.layerwise``, the layers already went out during the forward);
  the last chunk calls ``finish_request`` (the aux row is filled by then), and the final WRITE
  carries the aux rows and DONE. ``Success`` / ``Failed`` once the transfer is settled and none
  of its WRITEs is in flight.

Ids: SGLang's ``bootstrap_room`` (an int) becomes our ``transfer_id`` with ``str()`` once, where
SGLang calls us; ``_room`` turns it back only to call SGLang's own bookkeeping. P's state is one
``_Transfer`` record per transfer id with a ``Phase``; every failure goes through ``_fail``.

Stats: with SGLang's ``--enable-metrics`` the transport's counters and D's exposed handoff go to
the server's ``/metrics`` (``splitserve.connectors.sglang.stats``), published when a transfer
settles and at most once a second otherwise; P also logs its sender's totals with every completed
transfer ("splitserve: transfer ... sent (totals: ...)"), the overlap proof
``layers_posted_in_forward`` / ``layers_posted_at_step_end`` among them. With
``SPLITSERVE_SGLANG_TIMELINE=1`` both sides log a per-request timeline
(``splitserve.connectors.sglang.timeline``).

Invariants:
- Only full-attention KV pools (no state buffers: Mamba, SWA, ...), attention TP, CP and PP of 1
  on both sides; anything else stops start-up with a message.
- A transfer reaches ``Success`` or ``Failed`` only through ``KVSender`` / ``KVReceiver``
  outcomes, SGLang's own timeouts or an abort; no path leaves one without (each side has a
  deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from splitserve.connectors.sglang import layerwise
from splitserve.connectors.sglang.stats import open_metrics, transport_totals
from splitserve.connectors.sglang.timeline import Timeline
from splitserve.connectors.sglang.transport import (
    BackendSettings,
    check_supported,
    layout_layers_of_model_layers,
    open_transport,
    prefill_allowlist,
)
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import SideChannel
from splitserve.transfer.state import TransferState

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0  # metrics between settled transfers (the counters of a running one)


def _room(transfer_id: str) -> int:
    """SGLang's key for a transfer (its ``bootstrap_room``): the inverse of the edge's ``str()``."""
    return int(transfer_id)


class Phase(Enum):
    """Where P's transfer stands (one ``_Transfer`` record per transfer id)."""

    AWAITING_REGISTRATION = "awaiting_registration"  # bootstrapped; D's REGISTER not seen yet
    SENDING = "sending"  # ``init`` done: chunks join the page table as ``send`` brings them


@dataclass
class _Transfer:
    """P's view of one transfer: its pages in logical order from ``first_page``."""

    phase: Phase
    first_page: int = 0
    num_tokens: int = 0  # page-aligned: (first_page + pages to send) * page_size
    pages: list[int] = field(default_factory=list)

    def page_table(self) -> list[int]:
        """P's pages by logical page index (pages below ``first_page`` are never read)."""
        return [0] * self.first_page + self.pages


class SplitserveKVManager(CommonKVManager):
    """One per scheduler: owns the NIXL agent, the side channel and the sender or receiver."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **_: Any):
        self.settings = BackendSettings.from_env()
        self.lock = threading.RLock()
        self.agent: KVAgent | None = None
        self.channel: SideChannel | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.transfers: dict[str, _Transfer] = {}  # P, by transfer id
        self.handoffs_s: list[float] = []
        self.layer_map: dict[int, list[int]] = {}
        self.forward_open = False
        self.layers_hooked = 0  # layer stores seen by the layer-wise hook (P)
        self.timeline = Timeline(self.settings.timeline)
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self.metrics = open_metrics(server_args, prefill=prefill)
        self.published = 0.0  # monotonic time of the last metrics publication
        check_supported(args, server_args)
        # For P, CommonKVManager.__init__ registers with the bootstrap server: our override of
        # register_to_bootstrap opens the transport first, so the port it names is ours.
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._open_transport()
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._start_heartbeat_checker_thread()
            if self.timeline.enabled:
                layerwise.ACTIVE = self  # for D's first decode step
        elif self.settings.layerwise:
            self.layer_map = layout_layers_of_model_layers(
                len(args.kv_data_ptrs), args.kv_layer_ids, args.prefill_start_layer or 0
            )
            layerwise.ACTIVE = self
            logger.info("splitserve: layer-wise posting on (%d model layers)", len(self.layer_map))
        elif self.timeline.enabled:
            layerwise.ACTIVE = self  # for the forwards' times only

    # -- transport ------------------------------------------------------------------------------

    def _open_transport(self) -> None:
        if self.agent is not None:
            return
        prefill = self.disaggregation_mode == DisaggregationMode.PREFILL
        opened = open_transport(self.kv_args, self.settings, prefill=prefill, host=self.local_ip)
        self.agent, self.channel = opened.agent, opened.channel
        self.sender, self.receiver = opened.sender, opened.receiver

    def register_to_bootstrap(self):
        self._open_transport()
        assert self.channel is not None and self.channel.bound_port is not None
        self.rank_port = self.channel.bound_port
        super().register_to_bootstrap()

    def check_status(self, bootstrap_room: int) -> KVPoll:
        self.drive()
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def _fail(self, transfer_id: str, reason: str) -> None:
        """Conclude a transfer as failed, in SGLang's bookkeeping, saying why."""
        room = _room(transfer_id)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def _set_status(self, transfer_id: str, status: KVPoll) -> None:
        self.update_status(_room(transfer_id), status)

    def drive(self) -> None:
        """Read control messages and completions; conclude the transfers they settle."""
        with self.lock:
            settled = False
            if self.sender is not None:
                settled = self._drive_sender()
            if self.receiver is not None:
                settled = self._drive_receiver() or settled
            self.publish_metrics(force=settled)

    def publish_metrics(self, force: bool = False) -> None:
        """Our counters' increments and D's handoffs to SGLang's ``/metrics`` (if enabled)."""
        if self.metrics is None:
            self.handoffs_s.clear()
            return
        now = time.monotonic()
        if not force and now - self.published < PUBLISH_INTERVAL_S:
            return
        self.published = now
        totals = transport_totals(self.sender, self.receiver, self.channel)
        self.metrics.publish(totals, self.handoffs_s)

    def _drive_sender(self) -> bool:
        """Returns whether a transfer settled."""
        assert self.sender is not None
        settled = self.sender.poll_settled()
        for transfer_id, record in settled.items():
            self.transfers.pop(transfer_id, None)
            if record.state is TransferState.COMPLETED:
                self.timeline.event(transfer_id, "p_sent")
                stats = self.sender.stats
                logger.info(
                    "splitserve: transfer %s sent (totals: %d transfers, %d WRITEs, %d bytes, "
                    "%d layer stores hooked, layers_posted_in_forward=%d "
                    "layers_posted_at_step_end=%d)",
                    transfer_id,
                    stats.transfers_completed,
                    stats.writes_posted,
                    stats.bytes_sent,
                    self.layers_hooked,
                    stats.layers_posted_in_forward,
                    stats.layers_posted_at_step_end,
                )
                self._set_status(transfer_id, KVPoll.Success)
            else:
                self.timeline.event(transfer_id, "p_failed", state=record.state.value)
                self._fail(
                    transfer_id, f"splitserve transfer {record.state.value}: {record.reason}"
                )
        # Between D's registration and ``init`` nothing is kept here (SGLang clears only
        # senders that succeeded, so a record there could outlive a failed request).
        awaiting = [
            transfer_id
            for transfer_id, transfer in self.transfers.items()
            if transfer.phase is Phase.AWAITING_REGISTRATION
        ]
        for transfer_id in awaiting:
            room = _room(transfer_id)
            if self.request_status.get(room) != KVPoll.Bootstrapping:
                del self.transfers[transfer_id]  # concluded by SGLang: nothing to wait for
                continue
            reg = self.sender.registration_of(transfer_id)
            if reg is None and self.sender.cancelled(transfer_id):
                del self.transfers[transfer_id]
                self._fail(transfer_id, "splitserve: aborted by the decode side")
            elif reg is not None:
                del self.transfers[transfer_id]
                self.req_to_decode_prefix_len[room] = reg.token_offset
                self.update_status(room, KVPoll.WaitingForInput)
                self.timeline.event(transfer_id, "p_registered", prefix=reg.token_offset)
        return bool(settled)

    def _drive_receiver(self) -> bool:
        """Returns whether a load settled."""
        assert self.receiver is not None
        outcomes = self.receiver.poll()
        for transfer_id, outcome in outcomes.items():
            if not outcome.ok:
                self.timeline.event(transfer_id, "d_failed")
                self._fail(transfer_id, f"splitserve: {outcome.reason}")
                continue
            if self.timeline.enabled:
                handoff = outcome.exposed_handoff_s
                self.timeline.event(transfer_id, "d_done", handoff=handoff or 0.0)
                self.timeline.loaded(_room(transfer_id))
            if outcome.exposed_handoff_s is not None:
                self.handoffs_s.append(outcome.exposed_handoff_s)
                logger.info(
                    "splitserve: transfer %s received, exposed handoff %.4f s",
                    transfer_id,
                    outcome.exposed_handoff_s,
                )
            self._set_status(transfer_id, KVPoll.Success)
        return bool(outcomes)

    # -- prefill side ---------------------------------------------------------------------------

    def await_registration(self, transfer_id: str) -> None:
        """A sender was made for this transfer: watch for D's registration."""
        with self.lock:
            self.transfers[transfer_id] = _Transfer(Phase.AWAITING_REGISTRATION)

    def start_request(self, transfer_id: str, num_pages: int, aux_index: int | None) -> None:
        """``init``: the request's pages to send are known; its registration has arrived."""
        assert self.sender is not None
        page = self.kv_args.page_size
        prefix = self.req_to_decode_prefix_len.get(_room(transfer_id))
        if prefix is None:
            reg = self.sender.registration_of(transfer_id)
            prefix = reg.token_offset if reg is not None else 0
        first_page = prefix // page
        num_tokens = (first_page + num_pages) * page
        self.timeline.event(transfer_id, "p_init", pages=num_pages, prefix=prefix)
        with self.lock:
            self.transfers[transfer_id] = _Transfer(Phase.SENDING, first_page, num_tokens)
            try:
                self.sender.add_request(transfer_id, num_tokens, aux_row=aux_index)
            except ValueError as exc:
                del self.transfers[transfer_id]
                self._fail(transfer_id, f"splitserve: {exc}")

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices=None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ):
        """``send`` of one chunk: its pages join the page table; every layer not yet posted for
        them is written; the last chunk lets the final WRITE (aux rows + DONE) go."""
        assert self.sender is not None
        transfer_id = str(bootstrap_room)
        transfer = self.transfers.get(transfer_id)
        if transfer is None or transfer.phase is not Phase.SENDING:
            return None
        pages = np.asarray(kv_indices).astype(np.int64).tolist()
        start = index_slice.start
        if start != len(transfer.pages):
            # SGLang sends consecutive slices; anything else is a bug we must not paper over.
            self._fail(transfer_id, f"chunk starts at page {start}, {len(transfer.pages)} sent")
            self.sender.cancel(transfer_id, "non-consecutive chunk")
            return None
        transfer.pages.extend(pages)
        computed = (
            transfer.num_tokens
            if is_last_chunk
            else (transfer.first_page + len(transfer.pages)) * self.kv_args.page_size
        )
        with self.lock:
            if not self.forward_open:
                self.sender.begin_step([StepUpdate(transfer_id, transfer.page_table(), computed)])
                self.sender.end_step()
            # else: SGLang's early send of a cached prefix, from inside ``run_batch``: the open
            # layer-wise step (page table from page 0) posts those pages; a step of its own
            # would close the forward's. The next ``send`` catches up on anything left.
            if is_last_chunk:
                self.sender.finish_request(transfer_id)
        if is_last_chunk:
            self.timeline.event(transfer_id, "p_last_chunk")
        self._set_status(transfer_id, KVPoll.Transferring)
        return None

    # -- prefill side, layer-wise (splitserve.connectors.sglang.layerwise) ---------------------

    def begin_forward(self, scheduler, batch) -> bool:
        """Before a batch runs (the ``run_batch`` hook). P, prefill (extend) batch: the page
        tables and computed tokens of the batch's requests whose transfer has started go to
        the sender (layer-wise on). D, decode batch: its loaded requests' first decode step
        (timeline on). Returns whether a layer-wise step was opened."""
        if self.sender is None:
            if self.timeline.awaiting_decode and batch.forward_mode.is_decode():
                self.timeline.decode_batch(batch.reqs)
            return False
        if not batch.forward_mode.is_extend():
            return False
        if self.timeline.enabled:  # ours only (not SGLang's fake transfers: warm-up, health)
            senders = [(r, getattr(r, "disagg_kv_sender", None)) for r in batch.reqs]
            ours = [r for r, sender in senders if isinstance(sender, SplitserveKVSender)]
            self.timeline.forward_started(ours)
        if not self.settings.layerwise:
            return False
        page = self.kv_args.page_size
        updates = []
        for req in batch.reqs:
            room = getattr(req, "bootstrap_room", None)
            if room is None or req.extend_end is None:
                continue
            transfer_id = str(room)
            transfer = self.transfers.get(transfer_id)
            if transfer is None or transfer.phase is not Phase.SENDING:
                continue
            prompt = len(req.origin_input_ids)
            end = min(req.extend_end, prompt)
            tokens = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :end]
            translate = getattr(
                scheduler.token_to_kv_pool_allocator, "translate_kv_indices_for_transfer", None
            )
            if translate is not None:
                tokens = translate(tokens)
            pages = (tokens[::page] // page).cpu().numpy().astype(np.int64).tolist()
            computed = transfer.num_tokens if end >= prompt else end
            updates.append(StepUpdate(transfer_id, pages, computed))
        if not updates:
            return False
        with self.lock:
            self.sender.begin_step(updates)
        self.forward_open = True
        return True

    def layer_stored(self, layer_id: int) -> None:
        """The KV pool stored model layer ``layer_id`` for the running forward."""
        assert self.sender is not None
        self.layers_hooked += 1
        self.timeline.last_layer_wall = time.time()
        with self.lock:
            for index in self.layer_map.get(layer_id, ()):
                self.sender.layer_done(index)

    def end_forward(self, opened: bool) -> None:
        """After the batch ``begin_forward`` saw: the layer-wise step it opened is closed."""
        if opened:
            assert self.sender is not None
            self.forward_open = False
            with self.lock:
                self.sender.end_step()
        if self.timeline.forward_rooms:
            self.timeline.forward_ended(layerwise=opened)

    def cancel(self, transfer_id: str, reason: str) -> None:
        """P: SGLang aborted or cleared the request; D is told, the record is gone."""
        if self.sender is None:
            return
        with self.lock:
            self.transfers.pop(transfer_id, None)
            self.sender.cancel(transfer_id, reason)

    # -- decode side ----------------------------------------------------------------------------

    def expect(
        self,
        transfer_id: str,
        side_channel_host: str,
        side_channel_port: int,
        pages,
        prefix_len: int,
        aux_index: int | None,
    ) -> bool:
        assert self.receiver is not None
        block_ids = np.asarray(pages).astype(np.int64).tolist()
        with self.lock:
            try:
                self.receiver.expect(
                    transfer_id,
                    side_channel_host,
                    int(side_channel_port),
                    block_ids,
                    int(prefix_len),
                    aux_row=aux_index,
                )
            except ValueError as exc:
                self._fail(transfer_id, f"splitserve: {exc}")
                return False
        return True

    def abort_transfer(
        self,
        transfer_id: str,
        reason: str,
        side_channel_host: str | None = None,
        side_channel_port: int | None = None,
    ) -> None:
        if self.receiver is None:
            return
        with self.lock:
            self.receiver.abort(transfer_id, reason, side_channel_host, side_channel_port)

    def close(self) -> None:
        if layerwise.ACTIVE is self:
            layerwise.ACTIVE = None
        if self.channel is not None:
            self.channel.close()
        if self.agent is not None:
            self.agent.close()


class _TransferIdOfRoom:
    """SGLang's per-request objects know their ``bootstrap_room``; ours is its ``str()``."""

    bootstrap_room: int

    @property
    def transfer_id(self) -> str:
        return str(self.bootstrap_room)


class SplitserveKVSender(_TransferIdOfRoom, CommonKVSender):
    """P: one per request (see module docstring)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        mgr.timeline.event(bootstrap_room, "p_request")
        if self.conclude_state is None:
            mgr.await_registration(self.transfer_id)

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        super().init(num_kv_indices, aux_index)
        self.kv_mgr.start_request(self.transfer_id, num_kv_indices, aux_index)

    def abort(self):
        super().abort()
        self.kv_mgr.cancel(self.transfer_id, "aborted on the prefill side")

    def clear(self) -> None:
        # A transfer we settled is gone from the sender already (this only leaves a tombstone);
        # one SGLang concluded itself (bootstrap timeout, abort) stops here and D is told.
        self.kv_mgr.cancel(self.transfer_id, "cleared on the prefill side")
        super().clear()


class SplitserveKVReceiver(_TransferIdOfRoom, CommonKVReceiver):
    """D: one per request (see module docstring)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None, *args, **kwargs):
        mgr.timeline.event(bootstrap_room, "d_request")
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)

    def init(self, prefill_dp_rank: int):
        super().init(prefill_dp_rank)
        if self.conclude_state != KVPoll.Failed:
            self.kv_mgr.timeline.event(self.bootstrap_room, "d_bootstrapped")

    def _register_kv_args(self) -> bool:
        # HELLO (our agent metadata and layout) goes with our first REGISTER to each P.
        return self.bootstrap_infos is not None

    def send_metadata(
        self,
        kv_indices,
        aux_index=None,
        state_indices=None,
        decode_prefix_len=None,
        destination=None,
        device_kv_indices=None,
    ):
        mgr, transfer_id = self.kv_mgr, self.transfer_id
        if self.bootstrap_infos is None:
            mgr._fail(
                transfer_id,
                f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}",
            )
            return
        if state_indices and any(s is not None for s in state_indices):
            mgr._fail(transfer_id, "splitserve: state buffers unsupported")
            return
        targets = [info for info in self.bootstrap_infos if not info.get("is_dummy")]
        if len(targets) != 1:
            mgr._fail(transfer_id, f"splitserve: {len(targets)} prefill ranks, supports one")
            return
        info = targets[0]
        allowlist = prefill_allowlist(mgr.settings)
        if allowlist is not None and not allowlist.allows(str(info["rank_ip"])):
            mgr._fail(
                transfer_id,
                f"splitserve: prefill side channel host {info['rank_ip']!r} is not allowed "
                f"(SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS: {allowlist})",
            )
            return
        # SGLang's rank_ip / rank_port name P's side channel (its port is ours).
        if mgr.expect(
            transfer_id,
            info["rank_ip"],
            info["rank_port"],
            kv_indices,
            decode_prefix_len or 0,
            aux_index,
        ):
            self.init_time = time.time()
            mgr.timeline.event(self.bootstrap_room, "d_registered", pages=len(kv_indices))

    def _send_abort_notification(self, *, force_arm: bool = False):
        targets = [i for i in self.bootstrap_infos or () if not i.get("is_dummy")]
        host, port = (targets[0]["rank_ip"], targets[0]["rank_port"]) if targets else (None, None)
        self.kv_mgr.abort_transfer(self.transfer_id, "aborted on the decode side", host, port)


class SplitserveKVBootstrapServer(CommonKVBootstrapServer):
    pass


def classes() -> dict[str, type]:
    """The backend's classes by ``KVClassType`` member name (for the plugin's registry)."""
    return {
        "MANAGER": SplitserveKVManager,
        "SENDER": SplitserveKVSender,
        "RECEIVER": SplitserveKVReceiver,
        "BOOTSTRAP_SERVER": SplitserveKVBootstrapServer,
    }
