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
    registration_of(id)      D's REGISTER for an id, even before ``add_request`` (an engine
                             that learns the request's length only after D registered)

Block arithmetic (B tokens per block, N prompt tokens, c tokens computed so far): blocks
``[0, c // B)`` are complete, all ``ceil(N / B)`` once ``c >= N``. D registers its blocks for
logical blocks ``[first, first + len(ids))``; every (layer, block) in that range is written
exactly once, when it is complete and registered, so no block is written twice and a partially
filled block is never sent. Blocks P did not compute (its own prefix-cache hits) are complete
from the start and go out in the first step. DONE is a NIXL notification on one final WRITE
posted after every other WRITE of the transfer has completed, so it arrives after the data
(pull: a message after the last ANNOUNCE). When D's registration asks for the first output
token (``Register.first_token``), DONE also waits for ``finish_request`` to bring it (the
engine knows the token only once the step that completed the prompt has sampled it) and
carries it to D.

How a layer's blocks reach D is the direction's strategy (strategy.py), chosen once per
sender or per receiver (``send_direction``): ``send_push.PushSending`` posts WRITEs and rides
DONE on a final WRITE; ``send_pull.PullSending`` ANNOUNCEs the blocks on the side channel for
D to READ, sends DONE after the last ANNOUNCE and waits for D's PULLED. Everything else (block
arithmetic, steps, registrations, leases, aborts, the states) is here, once, for both: this
module is over 500 lines because those are one state machine whose invariants (below) span
its methods; the parts that stand alone live beside it (outgoing.py: the records and their
checks; peering.py: admission; send_direction.py: the direction per receiver).

Aux rows (layouts with ``aux_layers``, e.g. SGLang's metadata buffers): the request's row
(``add_request(..., aux_row=)``) is written into D's row (``Register.aux_row``) by the final
WRITE itself, which carries DONE; it is posted once every KV WRITE completed and the engine
called ``finish_request`` (the engine fills the row when it samples the first token).

Invariants:
- Nothing is posted for a block id that fails validation against either cache.
- A request's blocks are released only when its transfer is terminal and none of its WRITEs is
  in flight; an ABORT or ABORT_ACK is sent to D only then, so D never frees blocks that a WRITE
  of ours may still fill.
- Registrations for transfer ids we do not know yet are held for the lease, then refused; one
  for an id whose lease expired unregistered (within a lease of that) is refused at once.
- ``end_step`` posts a layer the engine's hook did not report, so no block is ever missed; the
  stats tell the two paths apart (``layers_posted_in_forward`` / ``layers_posted_at_step_end``).
- Every state has a deadline: a registration the lease, a pull's CLOSING the lease after DONE,
  and posts in flight (STREAMING, FLUSHING, CLOSING) the lease without a completion, after which
  they are cancelled and the transfer fails (``outgoing.stalled``).
- Only a connection admitted for an agent (``peering.PeerAdmission``) may register for it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.outgoing import (
    Outgoing,
    Reply,
    SenderStats,
    SendStrategy,
    StepUpdate,
    registration_problem,
    stalled,
)
from splitserve.transfer.peering import Held, PeerAdmission
from splitserve.transfer.send_direction import ReceiverDirections
from splitserve.transfer.send_pull import PullSending
from splitserve.transfer.send_push import PushSending
from splitserve.transfer.side_channel import PeerLost, PeerRef, SideChannel
from splitserve.transfer.state import Transfer, TransferState
from splitserve.transfer.strategy import Direction

__all__ = ["KVSender", "SenderStats", "StepUpdate"]

logger = logging.getLogger(__name__)
S = TransferState


@dataclass
class _Orphan:
    peer: PeerRef
    message: messages.Register
    deadline: float


class KVSender:
    """P's half of the protocol (see module docstring); ``direction`` picks the strategy."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        *,
        lease_s: float,
        direction: Direction = Direction.PUSH,
        per_peer: bool = False,
        clock=time.monotonic,
    ) -> None:
        self.agent = agent
        self.channel = channel
        self.layout: KVLayout = agent.layout
        self.block_size = agent.layout.block_size
        self.num_layers = agent.layout.num_kv_layers
        self.aux_layers = list(range(self.num_layers, len(agent.layout.layers)))
        self.lease_s = lease_s
        self.clock = clock
        self.stats = SenderStats()
        self._strategies: dict[Direction, SendStrategy] = {}
        self.directions = ReceiverDirections(
            direction,
            per_peer=per_peer,
            memory=self.layout.memory,
            has_aux=bool(self.aux_layers),
            loaded=lambda: set(self.agent.peer_names()) | self._agents_in_use(),
        )
        self.strategy: SendStrategy = self._strategy(direction)  # the default direction's
        self._transfers: dict[str, Outgoing] = {}
        self._orphans: dict[str, _Orphan] = {}
        self._tombstones: dict[str, float] = {}  # cancelled ids -> until when to refuse them
        # ids whose lease expired unregistered -> until when a late REGISTER is refused at once
        # (held as an unknown id it would wait another lease, and D with it)
        self._expired: dict[str, float] = {}
        self.peers = PeerAdmission(
            agent,
            channel,
            self._hello_ack,
            self._count_refused_hello,
            clock=clock,
            in_use=self._agents_in_use,
        )
        self._in_step: list[Outgoing] = []
        self._layers_seen: set[int] = set()
        self._last_hook_at: float | None = None  # perf_counter of this step's last layer hook
        self._stepping = False

    @property
    def direction(self) -> Direction:
        """The default direction (``per_peer``: a receiver's own is ``direction_of``)."""
        return self.strategy.direction

    def direction_of(self, agent_name: str) -> Direction:
        """The direction this sender told the receiver ``agent_name`` in its HELLO_ACK."""
        return self.directions.direction_of(agent_name)

    def _strategy(self, direction: Direction) -> SendStrategy:
        """The one strategy object of a direction, made when first needed."""
        made = self._strategies.get(direction)
        if made is None:
            if direction is Direction.PULL:
                made = PullSending(
                    self.agent, self.channel, self.stats, lease_s=self.lease_s, clock=self.clock
                )
            else:
                made = PushSending(self.agent, self.channel, self.stats)
            self._strategies[direction] = made
        return made

    def _strategy_of(self, out: Outgoing) -> SendStrategy:
        return self._strategy(self.direction_of(out.peer_agent or ""))

    def _hello_ack(self, agent_name: str) -> messages.HelloAck:
        return self._strategy(self.direction_of(agent_name)).hello_ack()

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
        out = Outgoing(
            Transfer(transfer_id, S.AWAITING_REGISTRATION), num_tokens=num_tokens, aux_row=aux_row
        )
        self._transfers[transfer_id] = out
        self._expired.pop(transfer_id, None)  # the id names this request now
        if transfer_id in self._tombstones:  # D aborted before we heard of the request
            out.record.transition(S.ABORTED, "receiver aborted before the request arrived")
            out.reply = Reply.SENT
            return
        orphan = self._orphans.pop(transfer_id, None)
        if orphan is not None:
            self._on_register(orphan.peer, orphan.message)

    def begin_step(self, updates: Iterable[StepUpdate]) -> None:
        self._process_inbox()
        self._in_step = []
        self._layers_seen = set()
        self._last_hook_at = None
        for update in updates:
            out = self._transfers.get(update.transfer_id)
            if out is None or out.record.state.terminal:
                continue
            out.block_ids = list(update.block_ids)
            out.step_computed = min(update.computed_after_step, out.num_tokens)
            self._in_step.append(out)
        self._stepping = True

    def layer_done(self, layer: int) -> None:
        """The engine's per-layer hook: post this layer's blocks completed by the running
        step, for registered transfers. A layer reported twice in one step is posted once.

        While a request of this step still awaits D's registration, the side channel is read
        here, per layer: in the concurrent flow P often starts the forward before D's REGISTER
        arrives, and waiting for the step's end would turn the whole forward's KV into one
        exposed bulk transfer. A registration that arrives mid-forward catches up on the layers
        this step already computed (``_on_register``) and streams the rest."""
        self._post_layer(layer, in_forward=True)

    def end_step(self) -> None:
        """The forward returned. For a request whose prompt it completed, this instant is the
        start of the exposed handoff (what D waits for beyond P's own compute): the last
        layer's WRITE was posted when its attention ran, during the rest of the forward."""
        forward_end = time.time()
        tail = None if self._last_hook_at is None else time.perf_counter() - self._last_hook_at
        # A layer the engine did not report (no per-layer hook ran for it) is posted now, so
        # the watermark below never runs ahead of what was written.
        for layer in range(self.num_layers):
            if layer not in self._layers_seen and self._in_step:
                self._post_layer(layer, in_forward=False)
        self._layers_seen = set()
        for out in self._in_step:
            if out.step_computed is None:
                continue
            out.computed = max(out.computed, out.step_computed)
            if out.computed >= out.num_tokens and out.prefill_end_wall is None:
                out.prefill_end_wall = forward_end
                if tail is not None:
                    self.stats.forward_tails_s.append(tail)
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
            in_flight = list(out.handles)
            failure = self._strategy_of(out).progress(out)
            if failure is not None:
                self._fail(out, failure)
            elif self._strategy_of(out).delivered(out):
                self._complete(out)
            if stalled(out, in_flight, now, self.lease_s):
                self._cancel_stalled(out, now)
            if out.record.state is S.FLUSHING and not out.handles:
                self._close(out)
            if out.record.state is S.AWAITING_REGISTRATION and out.record.expired(now):
                out.record.transition(S.EXPIRED, f"no registration within {self.lease_s}s lease")
                self.stats.lease_expiries += 1
                self._expired[out.record.transfer_id] = now + self.lease_s
            elif out.record.state is S.CLOSING and out.record.expired(now):
                # only a pull arms this deadline: its DONE awaits D's PULLED
                out.record.transition(S.EXPIRED, f"no PULLED within {self.lease_s}s of DONE")
                self.stats.lease_expiries += 1
        for transfer_id, orphan in list(self._orphans.items()):
            if now >= orphan.deadline:
                del self._orphans[transfer_id]
                self._refuse(orphan.peer, transfer_id, "unknown transfer id")
        for ended in (self._tombstones, self._expired):
            for transfer_id, until in list(ended.items()):
                if now >= until:
                    del ended[transfer_id]
        released: dict[str, Transfer] = {}
        for transfer_id, out in list(self._transfers.items()):
            if not out.record.state.terminal or out.handles:
                continue
            self._notify_peer_of_end(out)
            if out.request_finished:
                self._strategy_of(out).release(out)
                released[transfer_id] = out.record
                del self._transfers[transfer_id]
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

    # -- posting -----------------------------------------------------------------------------

    def _post_layer(self, layer: int, *, in_forward: bool) -> None:
        """Post ``layer``'s newly completed blocks for the step's transfers: reported by the
        engine's hook (``in_forward``) or caught up by ``end_step``."""
        if layer in self._layers_seen:
            return
        if any(out.record.state is S.AWAITING_REGISTRATION for out in self._in_step):
            self._process_inbox()
        self._layers_seen.add(layer)
        if in_forward:
            self._last_hook_at = time.perf_counter()  # the slice can leave from here
        if self._in_step and in_forward:
            self.stats.layers_posted_in_forward += 1
        posted = False
        for out in self._in_step:
            if out.record.state is not S.STREAMING or out.step_computed is None:
                continue
            hi = min(self._ready_blocks(out, out.step_computed), out.end)
            if hi > out.sent_upto:
                self._post(out, [layer], out.sent_upto, hi)
                posted = True
        # Counted only when the catch-up posted something: a step opened after a forward the
        # hook covered (SGLang's ``send`` per chunk) finds nothing left and is no bulk transfer.
        if posted and not in_forward:
            self.stats.layers_posted_at_step_end += 1

    def _ready_blocks(self, out: Outgoing, computed: int | None = None) -> int:
        c = out.computed if computed is None else computed
        if c >= out.num_tokens:
            return math.ceil(out.num_tokens / self.block_size)
        return c // self.block_size

    def _post(self, out: Outgoing, layers: list[int], lo: int, hi: int) -> None:
        if hi > len(out.block_ids):
            self._fail(out, f"block table has {len(out.block_ids)} blocks, need {hi}")
            return
        src = out.block_ids[lo:hi]
        dst = out.dst_blocks[lo - out.first : hi - out.first]
        failure = self._strategy_of(out).post(out, layers, src, dst)
        if failure is not None:
            self._fail(out, failure)

    def _close(self, out: Outgoing) -> None:
        """Every block is out and nothing is in flight: send DONE once it can say all D
        asked for (the aux row filled, the first token sampled)."""
        aux_ready = out.dst_aux_row is None or out.request_finished
        if aux_ready and (not out.wants_token or out.first_token is not None):
            failure = self._strategy_of(out).close(out, self._done_message(out))
            if failure is not None:
                self._fail(out, failure)
            else:
                out.record.transition(S.CLOSING)
        elif out.request_finished:
            self._fail(out, "the request finished without a first token for D")

    def _done_message(self, out: Outgoing) -> messages.Done:
        """The one DONE of a transfer, whichever way it travels."""
        return messages.Done(
            transfer_id=out.record.transfer_id,
            num_blocks=len(out.dst_blocks),
            prefill_end_wall=out.prefill_end_wall or time.time(),
            first_token=out.first_token if out.wants_token else None,
        )

    # -- ends --------------------------------------------------------------------------------

    def _complete(self, out: Outgoing, reason: str = "") -> None:
        out.record.transition(S.COMPLETED, reason)
        out.reply = Reply.SENT  # DONE itself told D (or D needs nothing)
        self.stats.transfers_completed += 1

    def _cancel_stalled(self, out: Outgoing, now: float) -> None:
        """No post of ``out`` completed within ``lease_s`` (a transport gone silent): fail it
        and cancel its posts, so no state waits for them forever; a post NIXL cannot cancel
        keeps its blocks held (and is tried again after another lease)."""
        logger.warning(
            "transfer %s: no post completed in %ss", out.record.transfer_id, self.lease_s
        )
        self.stats.transfers_stalled += not out.record.state.terminal
        self._fail(out, f"no post completed within {self.lease_s}s: the transport stalled")
        out.handles = self.agent.abandon(out.handles)
        out.stall_mark = now if out.handles else None

    def _fail(self, out: Outgoing, reason: str) -> None:
        if not out.record.state.terminal:
            out.record.transition(S.FAILED, reason)
            self.stats.transfers_failed += 1

    def _notify_peer_of_end(self, out: Outgoing) -> None:
        """Once nothing is in flight: ABORT_ACK if D aborted, else ABORT if we failed."""
        if out.reply is Reply.SENT or out.peer is None:
            return
        reply, out.reply = out.reply, Reply.SENT
        transfer_id = out.record.transfer_id
        if reply is Reply.ABORT_ACK:
            self.channel.send(out.peer, messages.AbortAck(transfer_id=transfer_id))
        elif out.record.state is not S.COMPLETED:
            reason = f"{out.record.state.value}: {out.record.reason}"
            self.channel.send(out.peer, messages.Abort(transfer_id=transfer_id, reason=reason))

    def _agents_in_use(self) -> set[str]:
        """Receivers' agents a live transfer or a held registration refers to: their
        admissions and NIXL metadata are not pruned (``peering``)."""
        live = {out.peer_agent for out in self._transfers.values() if out.peer_agent}
        return live | {orphan.message.agent_name for orphan in self._orphans.values()}

    def _count_refused_hello(self) -> None:
        self.stats.registrations_rejected += 1

    def _refuse(self, peer: PeerRef, transfer_id: str, reason: str) -> None:
        self.stats.registrations_rejected += 1
        logger.warning("refusing registration %s from %s: %s", transfer_id, peer, reason)
        self.channel.send(peer, messages.Abort(transfer_id=transfer_id, reason=reason))

    # -- control messages --------------------------------------------------------------------

    def _process_inbox(self) -> None:
        for event in self.channel.receive_bound():
            if isinstance(event, PeerLost):
                self._dispatch_all(self.peers.lost(event.peer))
            else:
                self._dispatch(event.peer, event.message)
        self._dispatch_all(self.peers.expire())

    def _dispatch_all(self, held: Held) -> None:
        for peer, message in held:
            self._dispatch(peer, message)

    def _dispatch(self, peer: PeerRef, message: messages.Message) -> None:
        if isinstance(message, messages.Hello):
            self.directions.on_hello(message)
            self.peers.on_hello(peer, message)
        elif isinstance(message, messages.Confirmed):
            self._dispatch_all(self.peers.on_confirmed(peer, message))
        elif self.peers.hold(peer, message):
            return  # its connection awaits the agent's confirmation (``peering``)
        elif isinstance(message, messages.Register):
            self.stats.registrations_received += 1
            self._on_register(peer, message)
        elif isinstance(message, messages.Abort):
            self._on_abort(peer, message)
        elif isinstance(message, messages.Pulled):
            self._on_pulled(peer, message)
        else:
            logger.warning("sender: unexpected %s from %s", message.type, peer)

    def _on_register(self, peer: PeerRef, reg: messages.Register) -> None:
        transfer_id = reg.transfer_id
        agent_name = self.peers.agent_of(peer)
        if agent_name is None or agent_name != reg.agent_name:
            # The receiver believes it was admitted (we restarted, or pruned its binding): it
            # says HELLO again and registers this transfer again (``messages.HELLO_REFUSAL``).
            reason = "no valid HELLO on this connection; say HELLO again"
            self._refuse(peer, transfer_id, messages.HELLO_REFUSAL + reason)
            return
        if transfer_id in self._tombstones:
            self._refuse(peer, transfer_id, "transfer cancelled on the prefill side")
            return
        out = self._transfers.get(transfer_id)
        if out is None and transfer_id in self._expired:
            reason = f"registration after the prefill side's {self.lease_s:g}s lease expired"
            self._refuse(peer, transfer_id, reason)
            return
        if out is None:
            orphan = self._orphans.get(transfer_id)
            if orphan is not None and orphan.peer == peer and orphan.message == reg:
                return  # the same registration again (D's retry after a HELLO refusal)
            if orphan is not None:
                self._refuse(peer, transfer_id, "duplicate registration")
                return
            self._orphans[transfer_id] = _Orphan(peer, reg, self.clock() + self.lease_s)
            return
        if out.record.state is not S.AWAITING_REGISTRATION:
            if out.peer == peer and out.registration == reg:
                return  # the same registration again (D's retry after a HELLO refusal)
            self._refuse(peer, transfer_id, f"registration in state {out.record.state.value}")
            return
        problem = registration_problem(
            out, reg, self.block_size, self.agent.peer_layout(reg.agent_name), self.aux_layers
        )
        if problem:
            out.peer = peer  # so the ABORT reaches D
            self._fail(out, f"invalid registration: {problem}")
            self.stats.registrations_rejected += 1
            return
        out.peer, out.peer_agent, out.registration = peer, agent_name, reg
        out.first = reg.token_offset // self.block_size
        out.sent_upto = out.first
        out.record.deadline = None
        self._strategy_of(out).registered(out)
        if not out.dst_blocks and out.dst_aux_row is None:
            self._complete(out, "receiver needs no blocks")
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

    def _on_abort(self, peer: PeerRef, abort: messages.Abort) -> None:
        transfer_id = abort.transfer_id
        orphan = self._orphans.get(transfer_id)
        if orphan is not None and orphan.peer == peer:  # only its registrant withdraws it
            del self._orphans[transfer_id]
        out = self._transfers.get(transfer_id)
        if out is None or out.peer is None or out.peer != peer:
            # Nothing of ours writes for this id on this peer's behalf: settled at once.
            self.channel.send(peer, messages.AbortAck(transfer_id=transfer_id))
            if out is None:
                self._tombstones[transfer_id] = self.clock() + self.lease_s
            if out is not None and out.record.state is S.AWAITING_REGISTRATION:
                self._tombstones[transfer_id] = self.clock() + self.lease_s
                out.record.transition(S.ABORTED, f"receiver aborted: {abort.reason}")
                self.stats.transfers_aborted += 1
                out.reply = Reply.SENT
            return
        out.reply = Reply.ABORT_ACK  # owed even if the transfer ended already
        if not out.record.state.terminal:
            out.record.transition(S.ABORTED, f"receiver aborted: {abort.reason}")
            self.stats.transfers_aborted += 1

    def _on_pulled(self, peer: PeerRef, pulled: messages.Pulled) -> None:
        out = self._transfers.get(pulled.transfer_id)
        if out is None or out.peer != peer or not self._strategy_of(out).pulled(out):
            logger.warning("sender: PULLED for %s from %s ignored", pulled.transfer_id, peer)
            return
        self._complete(out)
