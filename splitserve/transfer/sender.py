"""The prefill side (P) of the layer-wise transfer: makes a request's KV blocks D's as it computes.

Engine-agnostic; runs in the thread that runs the model (vLLM worker, SGLang scheduler). The
engine adapter drives it per step:

    begin_step(updates)      before the forward: block tables and tokens this step completes
    layer_done(layer)        after each layer: WRITE (push) or ANNOUNCE (pull) this layer's
                             newly completed blocks
    end_step()               after the forward: advance the watermarks
    finish_request / cancel  the engine finished (lease starts; with the request's first
                             output token when it has one) or dropped the request
    poll() -> released ids   control messages, completions, DONE, leases; ids whose blocks may
                             be freed now (``poll_settled``: with their final records)
    registration_of(tid)     D's REGISTER for an id, even before ``add_request`` (an engine
                             that learns the request's length only after D registered)

Block arithmetic (B tokens per block, N prompt tokens, c tokens computed so far): blocks
``[0, c // B)`` are complete, all ``ceil(N / B)`` once ``c >= N``. D registers its blocks for
logical blocks ``[first, first + len(ids))``; every (layer, block) in that range is written
exactly once, when it is complete and registered, so no block is written twice and a partially
filled block is never sent. Blocks P did not compute (its own prefix-cache hits) are complete
from the start and go out in the first step. DONE is a NIXL notification on one final WRITE
posted after every other WRITE of the transfer has completed, so it arrives after the data.
When D's registration asks for the first output token (``Register.first_token``), DONE also
waits for ``finish_request`` to bring it (the engine knows the token only once the step that
completed the prompt has sampled it) and carries it to D.

Pull (``direction=Direction.PULL``, strategy.py): every place that would post a WRITE sends an
ANNOUNCE of the same (layers, P blocks, D blocks) on the side channel instead, and D READs them.
DONE then goes on the side channel after the last ANNOUNCE (same socket: in order), and the
transfer completes only when D answers PULLED (every READ of it done): only then may P free.
A D that asked for the first token usually answers PULLED before DONE: the engine's
FIRST_TOKEN reaches it through the side channel's relay (set up here at registration) as soon
as the token is sampled, and D needs nothing more once every block is announced.
While a pull is open the agent's progress thread calls into NIXL (``hold_progress``), so D's
READs complete while this thread computes; every 20 ms while the request computes, every 1 ms
once all is announced (FLUSHING: D's last READs are then what D waits for). No PULLED within
``lease_s`` of DONE (D died): EXPIRED, freed. The HELLO_ACK carries P's agent metadata and
layout for D to read from.

Aux rows (layouts with ``aux_layers``, e.g. SGLang's metadata buffers): the request's row
(``add_request(..., aux_row=)``) is written into D's row (``Register.aux_row``) by the final
WRITE itself, which carries DONE; it is posted once every KV WRITE completed and the engine
called ``finish_request`` (the engine fills the row when it samples the first token).

Invariants:
- Nothing is posted for a block id that fails validation against either cache.
- A request's blocks are released only when its transfer is terminal and none of its WRITEs is
  in flight; an ABORT or ABORT_ACK is sent to D only then, so D never frees blocks that a WRITE
  of ours may still fill.
- Registrations for transfer ids we do not know yet are held for the lease, then refused.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent, TransferPostError, XferHandle
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import PeerRef, SideChannel
from splitserve.transfer.state import Transfer, TransferState
from splitserve.transfer.strategy import Direction

logger = logging.getLogger(__name__)
S = TransferState


@dataclass
class StepUpdate:
    """One producing request's state for the step about to run."""

    transfer_id: str
    block_ids: list[int]  # P's block ids for the request, logical order, at least as many as used
    computed_after_step: int  # tokens whose KV is complete once this step's forward ends


@dataclass
class SenderStats:
    bytes_sent: int = 0  # written (push) or announced for D to read (pull)
    writes_posted: int = 0
    announces_sent: int = 0  # pull: one per layer per step, or one per catch-up
    transfers_completed: int = 0
    transfers_failed: int = 0
    transfers_aborted: int = 0
    lease_expiries: int = 0
    registrations_received: int = 0
    registrations_rejected: int = 0
    # Seconds this side spent inside WRITE posts (pull: ANNOUNCE sends), on the thread that
    # posts (the forward's, or the GPU poster's). Over UCX's cma a WRITE's copy runs inside the
    # post, so this is what the transfer costs the prefill side's CPU; over tcp the bytes move
    # later, in progress. A pull leaves the copy to D: here only the message's cost remains.
    post_seconds: float = 0.0


@dataclass
class _Outgoing:
    record: Transfer
    num_tokens: int
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0
    step_computed: int | None = None
    # registration
    peer: PeerRef | None = None
    peer_agent: str | None = None
    first: int = 0
    dst_blocks: list[int] = field(default_factory=list)
    sent_upto: int = 0
    handles: list[XferHandle] = field(default_factory=list)
    carrier: XferHandle | None = None
    request_finished: bool = False
    abort_from_peer: bool = False
    notified_peer: bool = False
    prefill_end_wall: float | None = None
    wants_token: bool = False  # D asked for the first output token in DONE
    first_token: int | None = None
    aux_row: int | None = None  # P's row in the aux layers
    dst_aux_row: int | None = None  # D's row, from its registration
    registration: messages.Register | None = None
    done_sent: bool = False  # pull: DONE went out, waiting for D's PULLED
    holds_progress: bool = False  # pull: the agent keeps progressing for D's READs
    holds_urgent: bool = False  # ... at the fast rate (everything announced)

    @property
    def end(self) -> int:
        return self.first + len(self.dst_blocks)


@dataclass
class _Orphan:
    peer: PeerRef
    message: messages.Register
    deadline: float


class KVSender:
    """P's half of the protocol (see module docstring)."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        *,
        lease_s: float,
        direction: Direction = Direction.PUSH,
        clock=time.monotonic,
    ) -> None:
        self.agent = agent
        self.channel = channel
        self.layout: KVLayout = agent.layout
        self.block_size = agent.layout.block_size
        self.num_layers = agent.layout.num_kv_layers
        self.aux_layers = list(range(self.num_layers, len(agent.layout.layers)))
        self.lease_s = lease_s
        self.pull = direction is Direction.PULL
        if self.pull and self.aux_layers:
            raise ValueError("the pull direction does not carry aux rows; use push")
        self.clock = clock
        self.stats = SenderStats()
        self._transfers: dict[str, _Outgoing] = {}
        self._orphans: dict[str, _Orphan] = {}
        self._tombstones: dict[str, float] = {}  # cancelled ids -> until when to refuse them
        self._peer_agents: dict[bytes, str] = {}  # ROUTER identity -> agent name
        self._in_step: list[_Outgoing] = []
        self._layers_seen: set[int] = set()
        self._stepping = False

    # -- engine-driven lifecycle -------------------------------------------------------------

    def add_request(self, transfer_id: str, num_tokens: int, aux_row: int | None = None) -> None:
        """A request whose KV goes to a D; ``num_tokens`` is the prompt length P computes,
        ``aux_row`` its row in the aux layers (layouts with aux layers only)."""
        if transfer_id in self._transfers:
            return
        if (aux_row is None) != (not self.aux_layers):
            n_aux = len(self.aux_layers)
            raise ValueError(f"transfer {transfer_id}: aux_row {aux_row!r} with {n_aux} aux layers")
        if aux_row is not None:
            self.layout.validate_block_ids([aux_row], "local aux row", self.aux_layers[0])
        out = _Outgoing(
            Transfer(transfer_id, S.AWAITING_REGISTRATION), num_tokens=num_tokens, aux_row=aux_row
        )
        self._transfers[transfer_id] = out
        if transfer_id in self._tombstones:  # D aborted before we heard of the request
            out.record.transition(S.ABORTED, "receiver aborted before the request arrived")
            out.notified_peer = True
            return
        orphan = self._orphans.pop(transfer_id, None)
        if orphan is not None:
            self._on_register(orphan.peer, orphan.message)

    def begin_step(self, updates: Iterable[StepUpdate]) -> None:
        self._process_inbox()
        self._in_step = []
        self._layers_seen = set()
        for update in updates:
            out = self._transfers.get(update.transfer_id)
            if out is None or out.record.state.terminal:
                continue
            out.block_ids = list(update.block_ids)
            out.step_computed = min(update.computed_after_step, out.num_tokens)
            self._in_step.append(out)
        self._stepping = True

    def layer_done(self, layer: int) -> None:
        """Post this layer's blocks completed by the running step, for registered transfers.
        A layer reported twice in one step is posted once.

        While a request of this step still awaits D's registration, the side channel is read
        here, per layer: in the concurrent flow P often starts the forward before D's REGISTER
        arrives, and waiting for the step's end would turn the whole forward's KV into one
        exposed bulk transfer. A registration that arrives mid-forward catches up on the layers
        this step already computed (``_on_register``) and streams the rest."""
        if layer in self._layers_seen:
            return
        if any(out.record.state is S.AWAITING_REGISTRATION for out in self._in_step):
            self._process_inbox()
        self._layers_seen.add(layer)
        for out in self._in_step:
            if out.record.state is not S.STREAMING or out.step_computed is None:
                continue
            hi = min(self._ready_blocks(out, out.step_computed), out.end)
            if hi > out.sent_upto:
                self._post(out, [layer], out.sent_upto, hi)

    def end_step(self) -> None:
        """The forward returned. For a request whose prompt it completed, this instant is the
        start of the exposed handoff (what D waits for beyond P's own compute): the last
        layer's WRITE was posted when its attention ran, during the rest of the forward."""
        forward_end = time.time()
        # A layer the engine did not report (no per-layer hook ran for it) is posted now, so
        # the watermark below never runs ahead of what was written.
        for layer in range(self.num_layers):
            if layer not in self._layers_seen and self._in_step:
                self.layer_done(layer)
        self._layers_seen = set()
        for out in self._in_step:
            if out.step_computed is None:
                continue
            out.computed = max(out.computed, out.step_computed)
            if out.computed >= out.num_tokens and out.prefill_end_wall is None:
                out.prefill_end_wall = forward_end
            if out.record.state is S.STREAMING:
                out.sent_upto = max(out.sent_upto, min(self._ready_blocks(out), out.end))
                if out.sent_upto >= out.end:
                    out.record.transition(S.FLUSHING)
            out.step_computed = None
        self._in_step = []
        self._stepping = False

    def finish_request(self, transfer_id: str, first_token: int | None = None) -> None:
        """The engine finished the request and holds its blocks for us: start the lease.
        ``first_token``: the output token it sampled (for a D that continues from it)."""
        out = self._transfers.get(transfer_id)
        if out is None:
            return
        out.request_finished = True
        out.first_token = first_token
        if out.record.state is S.AWAITING_REGISTRATION:
            out.record.deadline = self.clock() + self.lease_s

    def cancel(self, transfer_id: str, reason: str) -> None:
        """The engine dropped the request (aborted, preempted): stop and tell D."""
        self._tombstones[transfer_id] = self.clock() + self.lease_s
        orphan = self._orphans.pop(transfer_id, None)
        if orphan is not None:  # D registered already: it must not wait for DONE
            self._refuse(orphan.peer, transfer_id, f"cancelled on the prefill side: {reason}")
        out = self._transfers.get(transfer_id)
        if out is None:
            return
        out.request_finished = True
        if not out.record.state.terminal:
            out.record.transition(S.ABORTED, reason)
            self.stats.transfers_aborted += 1

    def poll(self) -> set[str]:
        """Drive messages, completions and leases; ids whose blocks may be freed now."""
        return set(self.poll_settled())

    def poll_settled(self) -> dict[str, Transfer]:
        """``poll``, answering each released id's final record (state and reason)."""
        if not self._stepping:
            self._process_inbox()
        now = self.clock()
        for out in list(self._transfers.values()):
            self._settle_handles(out)
            if out.holds_progress and out.record.state is S.FLUSHING:
                self._hold_progress(out, urgent=True)
            idle = not out.handles and out.carrier is None and not out.done_sent
            if out.record.state is S.FLUSHING and idle:
                aux_ready = out.dst_aux_row is None or out.request_finished
                if aux_ready and (not out.wants_token or out.first_token is not None):
                    if self.pull:
                        self._send_done(out)
                    else:
                        self._post_carrier(out)
                elif out.request_finished:
                    self._fail(out, "the request finished without a first token for D")
            if out.record.state is S.AWAITING_REGISTRATION and out.record.expired(now):
                out.record.transition(S.EXPIRED, f"no registration within {self.lease_s}s lease")
                self.stats.lease_expiries += 1
            elif out.done_sent and out.record.state is S.FLUSHING and out.record.expired(now):
                out.record.transition(S.EXPIRED, f"no PULLED within {self.lease_s}s of DONE")
                self.stats.lease_expiries += 1
        for tid, orphan in list(self._orphans.items()):
            if now >= orphan.deadline:
                del self._orphans[tid]
                self._refuse(orphan.peer, tid, "unknown transfer id")
        for tid, until in list(self._tombstones.items()):
            if now >= until:
                del self._tombstones[tid]
        released: dict[str, Transfer] = {}
        for tid, out in list(self._transfers.items()):
            if not out.record.state.terminal or out.handles or out.carrier is not None:
                continue
            self._notify_peer_of_end(out)
            if out.request_finished:
                if out.holds_progress and out.record.state is not S.COMPLETED:
                    # D may still have READs of these blocks in flight (it aborted, or we
                    # failed): they complete only while we call into NIXL.
                    self.agent.linger_progress(self.lease_s)
                self._hold_progress(out, None)
                if self.pull and out.wants_token:
                    self.channel.relay_first_token(tid, None)
                released[tid] = out.record
                del self._transfers[tid]
        return released

    def registration_of(self, transfer_id: str) -> messages.Register | None:
        """D's registration for ``transfer_id`` if one arrived (also while the request is not
        known here yet); reads the side channel first when no step is running."""
        if not self._stepping:
            self._process_inbox()
        out = self._transfers.get(transfer_id)
        if out is not None:
            return out.registration
        orphan = self._orphans.get(transfer_id)
        return orphan.message if orphan is not None else None

    def cancelled(self, transfer_id: str) -> bool:
        """D aborted, or the engine cancelled, this id before it was settled here."""
        return transfer_id in self._tombstones

    def state_of(self, transfer_id: str) -> TransferState | None:
        out = self._transfers.get(transfer_id)
        return out.record.state if out else None

    def has_work(self) -> bool:
        return bool(self._transfers or self._orphans)

    # -- internals ---------------------------------------------------------------------------

    def _ready_blocks(self, out: _Outgoing, computed: int | None = None) -> int:
        c = out.computed if computed is None else computed
        if c >= out.num_tokens:
            return math.ceil(out.num_tokens / self.block_size)
        return c // self.block_size

    def _post(self, out: _Outgoing, layers: list[int], lo: int, hi: int) -> None:
        if hi > len(out.block_ids):
            self._fail(out, f"block table has {len(out.block_ids)} blocks, need {hi}")
            return
        src = out.block_ids[lo:hi]
        dst = out.dst_blocks[lo - out.first : hi - out.first]
        if self.pull:
            self._announce(out, layers, src, dst)
            return
        all_layers = [layer for layer in layers for _ in src]
        t0 = time.perf_counter()  # a cost, not a deadline: the real clock, not self.clock
        try:
            handle = self.agent.post(
                "WRITE", out.peer_agent, all_layers, src * len(layers), dst * len(layers)
            )
        except (TransferPostError, ValueError) as exc:
            self._fail(out, f"WRITE not posted: {exc}")
            return
        finally:
            self.stats.post_seconds += time.perf_counter() - t0
        out.handles.append(handle)
        self.stats.writes_posted += 1
        self.stats.bytes_sent += handle.num_bytes

    def _announce(self, out: _Outgoing, layers: list[int], src: list[int], dst: list[int]) -> None:
        """Pull: tell D these (layers x blocks) are complete; D READs them."""
        t0 = time.perf_counter()
        try:
            for layer in layers:
                self.layout.validate_block_ids(src, "local block", layer)
        except ValueError as exc:
            self._fail(out, f"ANNOUNCE not sent: {exc}")
            return
        if not out.holds_progress:
            self._hold_progress(out, urgent=False)
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
        self.stats.bytes_sent += len(src) * sum(self.layout.layers[i].block_bytes for i in layers)

    def _hold_progress(self, out: _Outgoing, urgent: bool | None) -> None:
        """Pull: hold the agent's progress for D's READs (``urgent``: at the fast rate), or
        drop the hold (``None``)."""
        if out.holds_progress and (urgent is None or urgent != out.holds_urgent):
            self.agent.drop_progress(urgent=out.holds_urgent)
            out.holds_progress = out.holds_urgent = False
        if urgent is not None and not out.holds_progress:
            self.agent.hold_progress(urgent=urgent)
            out.holds_progress, out.holds_urgent = True, urgent

    def _send_done(self, out: _Outgoing) -> None:
        """Pull: DONE after the last ANNOUNCE (same socket, so D sees it after them); the
        transfer completes when D says PULLED, or expires a lease later."""
        done = messages.Done(
            transfer_id=out.record.transfer_id,
            num_blocks=len(out.dst_blocks),
            prefill_end_wall=out.prefill_end_wall or time.time(),
            first_token=out.first_token if out.wants_token else None,
        )
        assert out.peer is not None
        self.channel.send(out.peer, done)
        out.done_sent = True
        out.record.deadline = self.clock() + self.lease_s

    def _on_pulled(self, peer: PeerRef, pulled: messages.Pulled) -> None:
        out = self._transfers.get(pulled.transfer_id)
        # Before our DONE only when D had the first token from the engine's FIRST_TOKEN (and
        # so needed no DONE): it completes once all is announced (FLUSHING) and read.
        early = out is not None and out.wants_token and out.record.state is S.FLUSHING
        if out is None or out.peer != peer or not (out.done_sent or early):
            logger.warning("sender: PULLED for %s from %s ignored", pulled.transfer_id, peer)
            return
        if out.record.state is S.FLUSHING:
            out.record.transition(S.COMPLETED)
            out.notified_peer = True  # DONE itself told D
            self.stats.transfers_completed += 1

    def _post_carrier(self, out: _Outgoing) -> None:
        """The final WRITE with DONE: the aux rows when the transfer has them, else the last
        block of the last layer again (already sent: an idempotent copy)."""
        done = messages.Done(
            transfer_id=out.record.transfer_id,
            num_blocks=len(out.dst_blocks),
            prefill_end_wall=out.prefill_end_wall or time.time(),
            first_token=out.first_token if out.wants_token else None,
        )
        notif = messages.encode(done, self.channel.auth_key)
        last = self.num_layers - 1
        if out.dst_aux_row is not None:
            n_aux = len(self.aux_layers)
            layers, src, dst = self.aux_layers, [out.aux_row] * n_aux, [out.dst_aux_row] * n_aux
        else:
            layers, src, dst = [last], [out.block_ids[out.end - 1]], [out.dst_blocks[-1]]
        try:
            out.carrier = self.agent.post("WRITE", out.peer_agent, layers, src, dst, notif=notif)
        except (TransferPostError, ValueError) as exc:
            self._fail(out, f"DONE not posted: {exc}")

    def _settle_handles(self, out: _Outgoing) -> None:
        pending = []
        for handle in out.handles:
            state = self.agent.check(handle)
            if state == "PROC":
                pending.append(handle)
                continue
            self.agent.release(handle)
            if state == "ERR":
                self._fail(out, f"WRITE to {handle.peer} failed")
        out.handles = pending
        if out.carrier is not None:
            state = self.agent.check(out.carrier)
            if state != "PROC":
                self.agent.release(out.carrier)
                out.carrier = None
                if state == "DONE" and out.record.state is S.FLUSHING:
                    out.record.transition(S.COMPLETED)
                    out.notified_peer = True  # DONE itself told D
                    self.stats.transfers_completed += 1
                elif state == "ERR":
                    self._fail(out, "DONE WRITE failed")

    def _fail(self, out: _Outgoing, reason: str) -> None:
        if not out.record.state.terminal:
            out.record.transition(S.FAILED, reason)
            self.stats.transfers_failed += 1

    def _notify_peer_of_end(self, out: _Outgoing) -> None:
        """Once nothing is in flight: ABORT_ACK if D aborted, else ABORT if we failed."""
        if out.notified_peer or out.peer is None:
            return
        out.notified_peer = True
        tid = out.record.transfer_id
        if out.abort_from_peer:
            self.channel.send(out.peer, messages.AbortAck(transfer_id=tid))
        elif out.record.state is not S.COMPLETED:
            reason = f"{out.record.state.value}: {out.record.reason}"
            self.channel.send(out.peer, messages.Abort(transfer_id=tid, reason=reason))

    def _refuse(self, peer: PeerRef, transfer_id: str, reason: str) -> None:
        self.stats.registrations_rejected += 1
        logger.warning("refusing registration %s from %s: %s", transfer_id, peer, reason)
        self.channel.send(peer, messages.Abort(transfer_id=transfer_id, reason=reason))

    def _process_inbox(self) -> None:
        for event in self.channel.receive_bound():
            message, peer = event.message, event.peer
            if isinstance(message, messages.Hello):
                self._on_hello(peer, message)
            elif isinstance(message, messages.Register):
                self.stats.registrations_received += 1
                self._on_register(peer, message)
            elif isinstance(message, messages.Abort):
                self._on_abort(peer, message)
            elif isinstance(message, messages.Pulled):
                self._on_pulled(peer, message)
            else:
                logger.warning("sender: unexpected %s from %s", message.type, peer)

    def _on_hello(self, peer: PeerRef, hello: messages.Hello) -> None:
        try:
            layout = KVLayout.model_validate(hello.layout)
            name = self.agent.add_peer(hello.agent_metadata, layout)
        except Exception as exc:  # bad metadata or layout: refuse this peer, keep serving
            logger.warning("refusing HELLO from %s (%s): %s", peer, hello.agent_name, exc)
            self.channel.send(peer, messages.Abort(transfer_id="*", reason=f"hello: {exc}"))
            return
        if name != hello.agent_name:
            logger.warning(
                "HELLO from %s names %s, metadata names %s", peer, hello.agent_name, name
            )
        assert peer.inbound is not None
        self._peer_agents[peer.inbound] = name
        if self.pull:  # D reads from us: it needs our metadata and layout
            ack = messages.HelloAck(
                agent_name=self.agent.name,
                direction="pull",
                agent_metadata=self.agent.metadata(),
                layout=self.layout.model_dump(mode="json"),
            )
        else:
            ack = messages.HelloAck(agent_name=self.agent.name)
        self.channel.send(peer, ack)

    def _on_register(self, peer: PeerRef, reg: messages.Register) -> None:
        tid = reg.transfer_id
        agent_name = self._peer_agents.get(peer.inbound or b"")
        if agent_name is None or agent_name != reg.agent_name:
            self._refuse(peer, tid, "registration before a valid HELLO")
            return
        if tid in self._tombstones:
            self._refuse(peer, tid, "transfer cancelled on the prefill side")
            return
        out = self._transfers.get(tid)
        if out is None:
            if tid in self._orphans:
                self._refuse(peer, tid, "duplicate registration")
                return
            self._orphans[tid] = _Orphan(peer, reg, self.clock() + self.lease_s)
            return
        if out.record.state is not S.AWAITING_REGISTRATION:
            self._refuse(peer, tid, f"registration in state {out.record.state.value}")
            return
        problem = self._registration_problem(out, reg)
        if problem:
            out.peer = peer  # so the ABORT reaches D
            self._fail(out, f"invalid registration: {problem}")
            self.stats.registrations_rejected += 1
            return
        out.peer, out.peer_agent = peer, agent_name
        out.first = reg.token_offset // self.block_size
        out.dst_blocks = list(reg.block_ids[0]) if reg.block_ids else []
        out.sent_upto = out.first
        out.wants_token = bool(reg.first_token)
        if self.pull and out.wants_token:  # the engine's FIRST_TOKEN goes straight to D
            self.channel.relay_first_token(tid, peer)
        out.dst_aux_row = reg.aux_row
        out.registration = reg
        out.record.deadline = None
        if not out.dst_blocks and out.dst_aux_row is None:
            out.record.transition(S.COMPLETED, "receiver needs no blocks")
            out.notified_peer = True
            self.stats.transfers_completed += 1
            return
        out.record.transition(S.STREAMING)
        if not out.dst_blocks:  # D needs only the aux rows
            out.record.transition(S.FLUSHING)
            return
        hi = min(self._ready_blocks(out), out.end)
        if hi > out.sent_upto:  # bulk: everything completed before the registration came
            self._post(out, list(range(self.num_layers)), out.sent_upto, hi)
            out.sent_upto = hi
        if self._stepping and self._layers_seen and any(o is out for o in self._in_step):
            # Registered mid-forward: this step's blocks of the layers already computed now;
            # ``layer_done`` posts the remaining layers and ``end_step`` moves the watermark.
            step_hi = min(self._ready_blocks(out, out.step_computed), out.end)
            if step_hi > out.sent_upto and out.record.state is S.STREAMING:
                self._post(out, sorted(self._layers_seen), out.sent_upto, step_hi)
            return
        if out.record.state is S.STREAMING and out.sent_upto >= out.end:
            out.record.transition(S.FLUSHING)

    def _registration_problem(self, out: _Outgoing, reg: messages.Register) -> str | None:
        if len(reg.block_ids) > 1:
            return f"{len(reg.block_ids)} KV cache groups, this sender supports one"
        if reg.token_offset % self.block_size:
            return f"token offset {reg.token_offset} not a multiple of block size"
        dst = reg.block_ids[0] if reg.block_ids else []
        first = reg.token_offset // self.block_size
        total = math.ceil(out.num_tokens / self.block_size)
        if first + len(dst) > total:
            return f"asks blocks {first}..{first + len(dst) - 1}, request has {total}"
        if len(set(dst)) != len(dst):
            return "duplicate destination block ids"
        if (reg.aux_row is None) != (out.aux_row is None):
            return f"aux row {reg.aux_row!r}, this request's is {out.aux_row!r}"
        try:
            peer = self.agent._peers[reg.agent_name].layout  # noqa: SLF001 (same package)
            peer.validate_block_ids(dst, "registered block")
            if reg.aux_row is not None:
                peer.validate_block_ids([reg.aux_row], "registered aux row", self.aux_layers[0])
        except (KeyError, ValueError) as exc:
            return str(exc)
        return None

    def _on_abort(self, peer: PeerRef, abort: messages.Abort) -> None:
        tid = abort.transfer_id
        self._orphans.pop(tid, None)
        out = self._transfers.get(tid)
        if out is None or out.peer is None or out.peer != peer:
            # Nothing of ours writes for this id on this peer's behalf: settled at once.
            self.channel.send(peer, messages.AbortAck(transfer_id=tid))
            if out is None:
                self._tombstones[tid] = self.clock() + self.lease_s
            if out is not None and out.record.state is S.AWAITING_REGISTRATION:
                self._tombstones[tid] = self.clock() + self.lease_s
                out.record.transition(S.ABORTED, f"receiver aborted: {abort.reason}")
                self.stats.transfers_aborted += 1
                out.notified_peer = True
            return
        out.abort_from_peer = True
        if out.record.state.terminal:
            out.notified_peer = False  # still owe the ACK
        else:
            out.record.transition(S.ABORTED, f"receiver aborted: {abort.reason}")
            self.stats.transfers_aborted += 1
