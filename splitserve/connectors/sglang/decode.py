"""The decode (D) side of the ``splitserve`` SGLang transfer backend: the manager's receiver half
and SGLang's per-request ``SplitserveKVReceiver``.

Runs in SGLang's scheduler process of a decode server, on the scheduler thread. A module of its
own so that a reader knows from the file name that a line runs on D (the prefill side is
``splitserve.connectors.sglang.prefill``; what both share, and the one manager class SGLang
instantiates, is ``splitserve.connectors.sglang.conn``). SGLang's ``get_kv_class`` answers one
manager class for both modes, so this side's part of it is ``DecodeManagerMixin``, a base of
``conn.SplitserveKVManager``. What D does, in SGLang's names:

- ``send_metadata(kv_indices, aux_index, ...)``: ``KVReceiver.expect`` (HELLO on first contact,
  then REGISTER with D's pages, its radix-cache prefix as the token offset, and its aux row), to
  the one prefill rank D's ``bootstrap_infos`` name (its ``rank_port`` is P's side channel),
  if ``SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS`` allows its host.
- ``abort`` sends our ABORT.
- ``poll`` drives the receiver: DONE -> ``Success`` (D logs the exposed handoff: "splitserve:
  transfer ... received, exposed handoff ... s"); P's ABORT, P's process lost or no DONE in time
  -> ``Failed`` with the reason.

A failed load drops SGLang's cached bootstrap info of its P (``poll``), so the next request
asks P's bootstrap server again: a P restarted on its same ports binds a new side-channel port.

Invariant: every refusal (no bootstrap info, state buffers, several prefill ranks, a prefill host
not allowed, a registration ``KVReceiver`` refuses) ends the transfer through the manager's
``_fail`` with the reason.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from splitserve.connectors.sglang.rooms import TransferIdOfRoom, room_of
from splitserve.connectors.sglang.timeline import Timeline
from splitserve.connectors.sglang.transport import prefill_allowlist
from splitserve.transfer.receiver import KVReceiver

logger = logging.getLogger(__name__)


class DecodeManagerMixin:
    """D's half of ``conn.SplitserveKVManager``: the receiver's outcomes, registrations with P,
    aborts and the timeline's first decode step.

    Relies on the manager for the attributes below (set in its ``__init__``) and for ``_fail`` /
    ``_set_status``."""

    lock: threading.RLock
    receiver: KVReceiver | None
    handoffs_s: list[float]
    timeline: Timeline

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
                self.timeline.loaded(room_of(transfer_id))
            if outcome.exposed_handoff_s is not None:
                self.handoffs_s.append(outcome.exposed_handoff_s)
                logger.info(
                    "splitserve: transfer %s received, exposed handoff %.4f s",
                    transfer_id,
                    outcome.exposed_handoff_s,
                )
            self._set_status(transfer_id, KVPoll.Success)
        return bool(outcomes)

    def _begin_decode_forward(self, batch) -> None:
        """``begin_forward`` on D: a decode batch's loaded requests' first decode step (timeline
        on)."""
        if self.timeline.awaiting_decode and batch.forward_mode.is_decode():
            self.timeline.decode_batch(batch.reqs)

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


class SplitserveKVReceiver(TransferIdOfRoom, CommonKVReceiver):
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

    def poll(self) -> KVPoll:
        state = super().poll()
        if state == KVPoll.Failed and self._connection_pool_entries:
            # As SGLang's own backends do when a send fails: the next request asks P's
            # bootstrap server again. A P restarted on its ports has a new side-channel port,
            # and P's bootstrap server may answer again before D's heartbeats saw it gone, so
            # the cached rank (the old port) would fail every next request.
            self.invalidate_cached_bootstrap_infos()
        return state

    def _send_abort_notification(self, *, force_arm: bool = False):
        targets = [i for i in self.bootstrap_infos or () if not i.get("is_dummy")]
        host, port = (targets[0]["rank_ip"], targets[0]["rank_port"]) if targets else (None, None)
        self.kv_mgr.abort_transfer(self.transfer_id, "aborted on the decode side", host, port)
