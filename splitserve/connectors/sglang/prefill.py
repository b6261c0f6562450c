"""The prefill (P) side of the ``splitserve`` SGLang transfer backend: the manager's sender half
and SGLang's per-request ``SplitserveKVSender``.

Runs in SGLang's scheduler process of a prefill server, on the scheduler thread. A module of its
own so that a reader knows from the file name that a line runs on P (the decode side is
``splitserve.connectors.sglang.decode``; what both share, and the one manager class SGLang
instantiates, is ``splitserve.connectors.sglang.conn``). SGLang's ``get_kv_class`` answers one
manager class for both modes, so this side's part of it is ``PrefillManagerMixin``, a base of
``conn.SplitserveKVManager``. What P does, in SGLang's names:

- ``poll`` while ``Bootstrapping``: D's REGISTER arrived -> ``WaitingForInput`` (its token
  offset is SGLang's ``decode_prefix_len``).
- ``init(num_pages, aux_index)``: ``KVSender.add_request``.
- ``send(kv_indices)`` per chunk: the chunk's pages join the request's page table and every
  layer not yet posted is written (with the layer-wise hooks on, see
  ``splitserve.connectors.sglang.layerwise``, the layers already went out during the forward);
  the last chunk calls ``finish_request`` (the aux row is filled by then), and the final WRITE
  carries the aux rows and DONE.
- ``Success`` / ``Failed`` once the transfer is settled and none of its WRITEs is in flight; P
  logs its sender's totals with every completed transfer ("splitserve: transfer ... sent
  (totals: ...)"), the overlap proof ``layers_posted_in_forward`` / ``layers_posted_at_step_end``
  among them.

Invariants: P's state is one ``PrefillTransfer`` record per transfer id with a ``Phase``, kept
only while it is awaited or sending; every failure goes through the manager's ``_fail`` (SGLang's
``record_failure`` and ``Failed``).
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
from sglang.srt.disaggregation.common.conn import CommonKVSender

from splitserve.connectors.sglang.rooms import TransferIdOfRoom, room_of
from splitserve.connectors.sglang.timeline import Timeline
from splitserve.connectors.sglang.transport import BackendSettings
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.state import TransferState

logger = logging.getLogger(__name__)


class Phase(Enum):
    """Where P's transfer stands (one ``PrefillTransfer`` record per transfer id)."""

    AWAITING_REGISTRATION = "awaiting_registration"  # bootstrapped; D's REGISTER not seen yet
    SENDING = "sending"  # ``init`` done: chunks join the page table as ``send`` brings them


@dataclass
class PrefillTransfer:
    """P's view of one transfer: its pages in logical order from ``first_page``."""

    phase: Phase
    first_page: int = 0
    num_tokens: int = 0  # page-aligned: (first_page + pages to send) * page_size
    pages: list[int] = field(default_factory=list)

    def page_table(self) -> list[int]:
        """P's pages by logical page index (pages below ``first_page`` are never read)."""
        return [0] * self.first_page + self.pages


class PrefillManagerMixin:
    """P's half of ``conn.SplitserveKVManager``: the sender's outcomes, D's registrations, the
    chunks SGLang sends and the layer-wise step of a prefill forward.

    Relies on the manager for the attributes below (set in its ``__init__`` or by SGLang's
    ``CommonKVManager``) and for ``_fail``, ``_set_status`` and SGLang's ``update_status``."""

    lock: threading.RLock
    settings: BackendSettings
    sender: KVSender | None
    transfers: dict[str, PrefillTransfer]
    layer_map: dict[int, list[int]]
    forward_open: bool
    layers_hooked: int
    timeline: Timeline
    kv_args: Any
    request_status: dict[int, KVPoll]
    req_to_decode_prefix_len: dict[int, int]

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
            room = room_of(transfer_id)
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

    def await_registration(self, transfer_id: str) -> None:
        """A sender was made for this transfer: watch for D's registration."""
        with self.lock:
            self.transfers[transfer_id] = PrefillTransfer(Phase.AWAITING_REGISTRATION)

    def start_request(self, transfer_id: str, num_pages: int, aux_index: int | None) -> None:
        """``init``: the request's pages to send are known; its registration has arrived."""
        assert self.sender is not None
        page = self.kv_args.page_size
        prefix = self.req_to_decode_prefix_len.get(room_of(transfer_id))
        if prefix is None:
            reg = self.sender.registration_of(transfer_id)
            prefix = reg.token_offset if reg is not None else 0
        first_page = prefix // page
        num_tokens = (first_page + num_pages) * page
        self.timeline.event(transfer_id, "p_init", pages=num_pages, prefix=prefix)
        with self.lock:
            self.transfers[transfer_id] = PrefillTransfer(Phase.SENDING, first_page, num_tokens)
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

    # -- layer-wise (splitserve.connectors.sglang.layerwise) ------------------------------------

    def _begin_prefill_forward(self, scheduler, batch) -> bool:
        """``begin_forward`` on P: for a prefill (extend) batch, the page tables and computed
        tokens of the batch's requests whose transfer has started go to the sender (layer-wise
        on). Returns whether a layer-wise step was opened."""
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

    def cancel(self, transfer_id: str, reason: str) -> None:
        """P: SGLang aborted or cleared the request; D is told, the record is gone."""
        if self.sender is None:
            return
        with self.lock:
            self.transfers.pop(transfer_id, None)
            self.sender.cancel(transfer_id, reason)


class SplitserveKVSender(TransferIdOfRoom, CommonKVSender):
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
