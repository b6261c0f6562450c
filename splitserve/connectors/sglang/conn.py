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

Invariants:
- Only full-attention KV pools (no state buffers: Mamba, SWA, ...), attention TP, CP and PP of 1
  on both sides; anything else stops start-up with a message.
- A room reaches ``Success`` or ``Failed`` only through ``KVSender`` / ``KVReceiver`` outcomes,
  SGLang's own timeouts or an abort; no path leaves a room without one (each side has a deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
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
from splitserve.connectors.sglang.transport import (
    BackendSettings,
    agent_name,
    layout_from_buffers,
    layout_layers_of_model_layers,
)
from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, StepUpdate
from splitserve.transfer.side_channel import SideChannel
from splitserve.transfer.state import TransferState

logger = logging.getLogger(__name__)


@dataclass
class _Room:
    """P's view of one request: its pages in logical order from ``first_page``."""

    first_page: int
    num_tokens: int  # page-aligned: (first_page + pages to send) * page_size
    pages: list[int] = field(default_factory=list)


class SplitserveKVManager(CommonKVManager):
    """One per scheduler: owns the NIXL agent, the side channel and the sender or receiver."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **_: Any):
        self.settings = BackendSettings.from_env()
        self.lock = threading.RLock()
        self.agent: KVAgent | None = None
        self.channel: SideChannel | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.rooms: dict[int, _Room] = {}
        self.awaiting_registration: set[int] = set()
        self.handoffs_s: list[float] = []
        self.layer_map: dict[int, list[int]] = {}
        self.forward_open = False
        self.layers_hooked = 0  # layer stores seen by the layer-wise hook (P)
        _check_supported(args, server_args)
        # For P, CommonKVManager.__init__ registers with the bootstrap server: our override of
        # register_to_bootstrap opens the transport first, so the port it names is ours.
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._open_transport()
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._start_heartbeat_checker_thread()
        elif self.settings.layerwise:
            self.layer_map = layout_layers_of_model_layers(
                len(args.kv_data_ptrs), args.kv_layer_ids, args.prefill_start_layer or 0
            )
            layerwise.ACTIVE = self
            logger.info("splitserve: layer-wise posting on (%d model layers)", len(self.layer_map))

    # -- transport ------------------------------------------------------------------------------

    def _open_transport(self) -> None:
        if self.agent is not None:
            return
        args = self.kv_args
        prefill = self.disaggregation_mode == DisaggregationMode.PREFILL
        layout = layout_from_buffers(
            kv_ptrs=args.kv_data_ptrs,
            kv_lens=args.kv_data_lens,
            kv_item_lens=args.kv_item_lens,
            aux_ptrs=args.aux_data_ptrs,
            aux_lens=args.aux_data_lens,
            aux_item_lens=args.aux_item_lens,
            page_size=args.page_size,
            memory="DRAM",
        )
        name = agent_name("prefill" if prefill else "decode")
        self.agent = KVAgent(name, layout, backend_params=self.settings.ucx_params)
        key = messages.key_bytes(self.settings.auth_key)
        if prefill:
            self.channel = SideChannel(self.local_ip, 0, key, name="splitserve-sglang-sc")
            self.sender = KVSender(self.agent, self.channel, lease_s=self.settings.lease_s)
        else:
            self.channel = SideChannel(None, None, key, name="splitserve-sglang-sc")
            self.receiver = KVReceiver(
                self.agent,
                self.channel,
                done_timeout_s=self.settings.done_timeout_s,
                abort_ack_timeout_s=self.settings.abort_ack_timeout_s,
            )
        logger.info(
            "splitserve SGLang backend (%s): %d KV buffers, %d aux buffers, %d pages of %d "
            "tokens, %s memory%s",
            "prefill" if prefill else "decode",
            layout.num_kv_layers,
            layout.aux_layers,
            layout.num_blocks,
            layout.block_size,
            layout.memory,
            f", side channel {self.local_ip}:{self.channel.bound_port}" if prefill else "",
        )

    def register_to_bootstrap(self):
        self._open_transport()
        assert self.channel is not None and self.channel.bound_port is not None
        self.rank_port = self.channel.bound_port
        super().register_to_bootstrap()

    def check_status(self, bootstrap_room: int) -> KVPoll:
        self.drive()
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def drive(self) -> None:
        """Read control messages and completions; conclude the rooms they settle."""
        with self.lock:
            if self.sender is not None:
                self._drive_sender()
            if self.receiver is not None:
                self._drive_receiver()

    def _drive_sender(self) -> None:
        assert self.sender is not None
        for tid, record in self.sender.poll_settled().items():
            room = int(tid)
            self.rooms.pop(room, None)
            if record.state is TransferState.COMPLETED:
                stats = self.sender.stats
                logger.info(
                    "splitserve: room %s sent (totals: %d transfers, %d WRITEs, %d bytes, "
                    "%d layer stores hooked)",
                    room,
                    stats.transfers_completed,
                    stats.writes_posted,
                    stats.bytes_sent,
                    self.layers_hooked,
                )
                self.update_status(room, KVPoll.Success)
            else:
                reason = f"splitserve transfer {record.state.value}: {record.reason}"
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)
        for room in list(self.awaiting_registration):
            if self.request_status.get(room) != KVPoll.Bootstrapping:
                self.awaiting_registration.discard(room)
                continue
            reg = self.sender.registration_of(str(room))
            if reg is None and self.sender.cancelled(str(room)):
                self.awaiting_registration.discard(room)
                self.record_failure(room, "splitserve: aborted by the decode side")
                self.update_status(room, KVPoll.Failed)
            elif reg is not None:
                self.awaiting_registration.discard(room)
                self.req_to_decode_prefix_len[room] = reg.token_offset
                self.update_status(room, KVPoll.WaitingForInput)

    def _drive_receiver(self) -> None:
        assert self.receiver is not None
        for tid, outcome in self.receiver.poll().items():
            room = int(tid)
            if outcome.ok:
                if outcome.exposed_handoff_s is not None:
                    self.handoffs_s.append(outcome.exposed_handoff_s)
                    logger.info(
                        "splitserve: room %s received, exposed handoff %.4f s",
                        room,
                        outcome.exposed_handoff_s,
                    )
                self.update_status(room, KVPoll.Success)
            else:
                self.record_failure(room, f"splitserve: {outcome.reason}")
                self.update_status(room, KVPoll.Failed)

    # -- prefill side ---------------------------------------------------------------------------

    def start_request(self, room: int, num_pages: int, aux_index: int | None) -> None:
        """``init``: the request's pages to send are known; its registration has arrived."""
        assert self.sender is not None
        page = self.kv_args.page_size
        prefix = self.req_to_decode_prefix_len.get(room)
        if prefix is None:
            reg = self.sender.registration_of(str(room))
            prefix = reg.token_offset if reg is not None else 0
        first_page = prefix // page
        num_tokens = (first_page + num_pages) * page
        with self.lock:
            self.rooms[room] = _Room(first_page, num_tokens)
            try:
                self.sender.add_request(str(room), num_tokens, aux_row=aux_index)
            except ValueError as exc:
                self.rooms.pop(room, None)
                self.record_failure(room, f"splitserve: {exc}")
                self.update_status(room, KVPoll.Failed)

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
        room = self.rooms.get(bootstrap_room)
        if room is None:
            return None
        pages = np.asarray(kv_indices).astype(np.int64).tolist()
        start = index_slice.start
        if start != len(room.pages):
            # SGLang sends consecutive slices; anything else is a bug we must not paper over.
            self.record_failure(
                bootstrap_room, f"chunk starts at page {start}, {len(room.pages)} sent"
            )
            self.update_status(bootstrap_room, KVPoll.Failed)
            self.sender.cancel(str(bootstrap_room), "non-consecutive chunk")
            return None
        room.pages.extend(pages)
        computed = (
            room.num_tokens
            if is_last_chunk
            else (room.first_page + len(room.pages)) * self.kv_args.page_size
        )
        tid = str(bootstrap_room)
        with self.lock:
            self.sender.begin_step([StepUpdate(tid, self.page_table(room), computed)])
            self.sender.end_step()
            if is_last_chunk:
                self.sender.finish_request(tid)
        self.update_status(bootstrap_room, KVPoll.Transferring)
        return None

    @staticmethod
    def page_table(room: _Room) -> list[int]:
        """P's pages by logical page index (pages below ``first_page`` are never read)."""
        return [0] * room.first_page + room.pages

    # -- prefill side, layer-wise (splitserve.connectors.sglang.layerwise) ---------------------

    def begin_forward(self, scheduler, batch) -> bool:
        """Before a prefill forward: the page tables and computed tokens of the batch's
        requests whose transfer has started. Returns whether a step was opened."""
        assert self.sender is not None
        page = self.kv_args.page_size
        updates = []
        for req in batch.reqs:
            room_id = getattr(req, "bootstrap_room", None)
            room = self.rooms.get(room_id)
            if room is None or req.extend_end is None:
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
            computed = room.num_tokens if end >= prompt else end
            updates.append(StepUpdate(str(room_id), pages, computed))
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
        with self.lock:
            for index in self.layer_map.get(layer_id, ()):
                self.sender.layer_done(index)

    def end_forward(self) -> None:
        assert self.sender is not None
        self.forward_open = False
        with self.lock:
            self.sender.end_step()

    def cancel(self, room: int, reason: str) -> None:
        if self.sender is None:
            return
        with self.lock:
            self.awaiting_registration.discard(room)
            self.sender.cancel(str(room), reason)

    # -- decode side ----------------------------------------------------------------------------

    def expect(
        self, room: int, host: str, port: int, pages, prefix_len: int, aux_index: int | None
    ) -> bool:
        assert self.receiver is not None
        block_ids = np.asarray(pages).astype(np.int64).tolist()
        with self.lock:
            try:
                self.receiver.expect(
                    str(room), host, int(port), block_ids, int(prefix_len), aux_row=aux_index
                )
            except ValueError as exc:
                self.record_failure(room, f"splitserve: {exc}")
                self.update_status(room, KVPoll.Failed)
                return False
        return True

    def abort_transfer(
        self, room: int, reason: str, host: str | None = None, port: int | None = None
    ) -> None:
        if self.receiver is None:
            return
        with self.lock:
            self.receiver.abort(str(room), reason, host, port)

    def close(self) -> None:
        if layerwise.ACTIVE is self:
            layerwise.ACTIVE = None
        if self.channel is not None:
            self.channel.close()
        if self.agent is not None:
            self.agent.close()


def _check_supported(args, server_args) -> None:
    problems = []
    if getattr(args, "state_types", None):
        problems.append(f"state buffers {[str(t) for t in args.state_types]}")
    for name in ("tp_size", "pp_size", "dp_size"):
        value = getattr(server_args, name, 1) or 1
        if value != 1:
            problems.append(f"{name}={value}")
    device = getattr(server_args, "device", "cpu")
    if device != "cpu":
        problems.append(f"device {device!r} (the aux buffers live in host memory; mixed memory")
        problems[-1] += " kinds in one agent are not built yet)"
    if problems:
        raise NotImplementedError(
            "the splitserve SGLang transfer backend supports full-attention KV pools with "
            "TP=PP=DP=1 on host memory; this server has " + ", ".join(problems)
        )


class SplitserveKVSender(CommonKVSender):
    """P: one per request (see module docstring)."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if self.conclude_state is None:
            mgr.awaiting_registration.add(bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        super().init(num_kv_indices, aux_index)
        self.kv_mgr.start_request(self.bootstrap_room, num_kv_indices, aux_index)

    def abort(self):
        super().abort()
        self.kv_mgr.cancel(self.bootstrap_room, "aborted on the prefill side")

    def clear(self) -> None:
        # A transfer we settled is gone from the sender already (this only leaves a tombstone);
        # one SGLang concluded itself (bootstrap timeout, abort) stops here and D is told.
        self.kv_mgr.cancel(self.bootstrap_room, "cleared on the prefill side")
        self.kv_mgr.rooms.pop(self.bootstrap_room, None)
        super().clear()


class SplitserveKVReceiver(CommonKVReceiver):
    """D: one per request (see module docstring)."""

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
        if self.bootstrap_infos is None:
            self.kv_mgr.record_failure(
                self.bootstrap_room,
                f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}",
            )
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        if state_indices and any(s is not None for s in state_indices):
            self.kv_mgr.record_failure(self.bootstrap_room, "splitserve: state buffers unsupported")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        targets = [info for info in self.bootstrap_infos if not info.get("is_dummy")]
        if len(targets) != 1:
            self.kv_mgr.record_failure(
                self.bootstrap_room, f"splitserve: {len(targets)} prefill ranks, supports one"
            )
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        info = targets[0]
        if self.kv_mgr.expect(
            self.bootstrap_room,
            info["rank_ip"],
            info["rank_port"],
            kv_indices,
            decode_prefix_len or 0,
            aux_index,
        ):
            self.init_time = time.time()

    def _send_abort_notification(self, *, force_arm: bool = False):
        targets = [i for i in self.bootstrap_infos or () if not i.get("is_dummy")]
        host, port = (targets[0]["rank_ip"], targets[0]["rank_port"]) if targets else (None, None)
        self.kv_mgr.abort_transfer(self.bootstrap_room, "aborted on the decode side", host, port)


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
