"""The ``splitserve`` SGLang transfer backend: SGLang's ``Common*`` disaggregation classes over
``splitserve.transfer``; this module is the one SGLang loads, and holds what both sides share.

Runs in SGLang's scheduler process of a prefill (P) or decode (D) server; every method here is
called from the scheduler thread (SGLang's own worker threads are not started). SGLang selects
these classes through ``--disaggregation-transfer-backend splitserve`` (registered by the plugin,
``splitserve.connectors.sglang.registry``, which asks ``classes()`` here on the first lookup).

Split by side, so that a reader knows from the file name which server a line runs on:

- here: ``SplitserveKVManager``, one per scheduler on either side (SGLang's ``get_kv_class``
  answers one manager class for both modes): it opens the transport, drives the sender or the
  receiver, publishes metrics, and is the entry of the ``run_batch`` hook; its per-side halves
  are its bases ``PrefillManagerMixin`` and ``DecodeManagerMixin``. Also the bootstrap server
  and ``classes()``; ``SplitserveKVSender``, ``SplitserveKVReceiver`` and ``Phase`` are
  importable from here too.
- ``splitserve.connectors.sglang.prefill``: P's half of the manager and ``SplitserveKVSender``.
- ``splitserve.connectors.sglang.decode``: D's half of the manager and ``SplitserveKVReceiver``.
- ``splitserve.connectors.sglang.rooms``: ``bootstrap_room`` <-> ``transfer_id``.

Bootstrap (``CommonKVBootstrapServer``, unchanged): P registers its rank with the bootstrap
server; the rank's port is our side channel's (a ZMQ ROUTER), so D's ``bootstrap_infos`` name it.
The router's ``bootstrap_room`` is the transfer id.

Ids: SGLang's ``bootstrap_room`` (an int) becomes our ``transfer_id`` with ``str()`` once, where
SGLang calls us; ``rooms.room_of`` turns it back only to call SGLang's own bookkeeping. Every
failure, on either side, goes through ``SplitserveKVManager._fail``.

Between polls: while the scheduler only waits on transfers (nothing to run, a request in its
disaggregation queues) SGLang busy-polls; the manager makes it nap up to
``SPLITSERVE_SGLANG_IDLE_NAP_MS`` instead (``splitserve.connectors.sglang.idle``), checking
every ``SPLITSERVE_SGLANG_IDLE_CHECK_MS`` whether a drive of the transport changed a room's
status (``idle_check``), so DONE and REGISTER end the nap.

Stats: with SGLang's ``--enable-metrics`` the transport's counters and D's exposed handoff go to
the server's ``/metrics`` (``splitserve.connectors.sglang.stats``), published when a transfer
settles and at most once a second otherwise. With ``SPLITSERVE_SGLANG_TIMELINE=1`` both sides log
a per-request timeline (``splitserve.connectors.sglang.timeline``).

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
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from splitserve.connectors.sglang import idle, layerwise
from splitserve.connectors.sglang.decode import DecodeManagerMixin, SplitserveKVReceiver
from splitserve.connectors.sglang.prefill import (
    Phase,
    PrefillManagerMixin,
    PrefillTransfer,
    SplitserveKVSender,
)
from splitserve.connectors.sglang.rooms import room_of
from splitserve.connectors.sglang.stats import open_metrics, transport_totals
from splitserve.connectors.sglang.timeline import Timeline
from splitserve.connectors.sglang.transport import (
    BackendSettings,
    check_supported,
    layout_layers_of_model_layers,
    open_transport,
)
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender
from splitserve.transfer.side_channel import SideChannel

__all__ = [
    "PUBLISH_INTERVAL_S",
    "Phase",
    "SplitserveKVBootstrapServer",
    "SplitserveKVManager",
    "SplitserveKVReceiver",
    "SplitserveKVSender",
    "classes",
]

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0  # metrics between settled transfers (the counters of a running one)


class SplitserveKVManager(PrefillManagerMixin, DecodeManagerMixin, CommonKVManager):
    """One per scheduler: owns the NIXL agent, the side channel and the sender or receiver."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **_: Any):
        self.settings = BackendSettings.from_env()
        self.lock = threading.RLock()
        self.agent: KVAgent | None = None
        self.channel: SideChannel | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.transfers: dict[str, PrefillTransfer] = {}  # P, by transfer id
        self.handoffs_s: list[float] = []
        self.layer_map: dict[int, list[int]] = {}
        self.forward_open = False
        self.layers_hooked = 0  # layer stores seen by the layer-wise hook (P)
        self.timeline = Timeline(self.settings.timeline)
        self.nap_s = self.settings.idle_nap_ms / 1e3  # idle.py: between polls while waiting
        self.check_s = self.settings.idle_check_ms / 1e3  # idle.py: a nap's slices
        self.status_changes = 0  # update_status calls: what ends a nap early (idle_check)
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self.metrics = open_metrics(server_args, prefill=prefill)
        self.published = 0.0  # monotonic time of the last metrics publication
        check_supported(args, server_args)
        # For P, CommonKVManager.__init__ registers with the bootstrap server: our override of
        # register_to_bootstrap opens the transport first, so the port it names is ours.
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._open_transport()
        if self.nap_s > 0:
            idle.ACTIVE = self
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
        room = room_of(transfer_id)
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def _set_status(self, transfer_id: str, status: KVPoll) -> None:
        self.update_status(room_of(transfer_id), status)

    def update_status(self, bootstrap_room: int, status: KVPoll):
        self.status_changes += 1
        return super().update_status(bootstrap_room, status)

    def idle_check(self) -> bool:
        """Between a nap's slices (``idle``): drive the transport; whether it changed a room's
        status (DONE, D's REGISTER, a transfer settled or failed), i.e. SGLang's loop has
        something to do now."""
        before = self.status_changes
        self.drive()
        return self.status_changes != before

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

    # -- the run_batch hook (splitserve.connectors.sglang.layerwise), either side ---------------

    def begin_forward(self, scheduler, batch) -> bool:
        """Before a batch runs (the ``run_batch`` hook). P, prefill (extend) batch: the page
        tables and computed tokens of the batch's requests whose transfer has started go to
        the sender (layer-wise on). D, decode batch: its loaded requests' first decode step
        (timeline on). Returns whether a layer-wise step was opened."""
        if self.sender is None:
            self._begin_decode_forward(batch)
            return False
        return self._begin_prefill_forward(scheduler, batch)

    def end_forward(self, opened: bool) -> None:
        """After the batch ``begin_forward`` saw: the layer-wise step it opened is closed."""
        if opened:
            assert self.sender is not None
            self.forward_open = False
            with self.lock:
                self.sender.end_step()
        if self.timeline.forward_rooms:
            self.timeline.forward_ended(layerwise=opened)
        if self.timeline.decode_rooms:
            self.timeline.decode_ended()

    def close(self) -> None:
        if layerwise.ACTIVE is self:
            layerwise.ACTIVE = None
        if idle.ACTIVE is self:
            idle.ACTIVE = None
        if self.channel is not None:
            self.channel.close()
        if self.agent is not None:
            self.agent.close()


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
