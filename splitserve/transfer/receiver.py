"""The decode side (D) of the layer-wise transfer: registers blocks with P and waits for DONE.

Engine-agnostic; runs in the thread that owns D's KV cache (vLLM worker, SGLang scheduler). The
sender's direction (strategy.py) rules, and it says which in its HELLO_ACK, so one receiver
serves both, per P: ``recv_push.PushReceiving`` takes DONE from the NIXL notification on P's
last WRITE (D posts nothing); ``recv_pull.PullReceiving`` READs what P ANNOUNCEs and takes DONE
(or P's engine's FIRST_TOKEN) on the side channel. Either marks the load ready; everything else
(registration, aborts, timeouts, the one load-completion path ``_progress_load``, the states)
is here, once, for both.

    expect(id, host, port, block_ids, token_offset, first_token=False, aux_row=None)
                                                       HELLO (first contact) + REGISTER to P;
                                                       first_token: DONE must bring P's first
                                                       output token (Outcome.first_token);
                                                       aux_row: our row in the aux layers
    release_remote(id, host, port)                    tell P we need nothing (empty REGISTER)
    abort(id, reason, host=None, port=None)            our request is gone: ABORT to P (also
                                                       before we registered, given P's address)
    poll() -> {id: Outcome}                            transfers settled since the last call

Invariants:
- Every expected transfer settles exactly once: DONE (ok), ABORT from P, P's process lost, no
  DONE within ``done_timeout_s`` (then ABORT to P), or our own abort.
- After a timeout or our own abort, the outcome is held back until P answers ABORT_ACK (no
  WRITE of P's is in flight any more) or ``abort_ack_timeout_s`` passes, so the engine never
  reuses blocks that a late WRITE could still fill. A lost peer settles at once (it cannot
  write any more).
- A DONE must carry a valid MAC (when a key is set), name an expected transfer, and come from
  the agent P named in its HELLO_ACK; anything else is dropped with a log line.
- A transfer registered with ``first_token`` completes only with a DONE that carries the token;
  a DONE without it (a P that predates the field) fails the transfer at once.
- Pull: no outcome is given to the engine while a READ of that transfer is in flight (it would
  free blocks a READ still fills); a failed READ or an invalid ANNOUNCE fails the load and
  ABORTs P, settled like a timeout (ABORT_ACK or ``abort_ack_timeout_s``, and no READ in flight).
"""

from __future__ import annotations

import logging
import time

from splitserve.transfer import messages, strategy
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.incoming import Incoming, Outcome, ReceiverStats
from splitserve.transfer.recv_pull import PullReceiving
from splitserve.transfer.recv_push import PushReceiving
from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef, SideChannel
from splitserve.transfer.state import Transfer, TransferState

__all__ = ["KVReceiver", "Outcome", "ReceiverStats"]

logger = logging.getLogger(__name__)
S = TransferState


class KVReceiver:
    """D's half of the protocol (see module docstring)."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        *,
        done_timeout_s: float,
        abort_ack_timeout_s: float = 5.0,
        clock=time.monotonic,
    ) -> None:
        self.agent = agent
        self.channel = channel
        self.done_timeout_s = done_timeout_s
        self.abort_ack_timeout_s = abort_ack_timeout_s
        self.clock = clock
        self.stats = ReceiverStats()
        self._transfers: dict[str, Incoming] = {}
        self._hello_sent: set[PeerRef] = set()
        self._hellos: dict[PeerRef, int] = {}  # HELLOs said to each P (bounded by the Ps)
        self._sender_agents: dict[PeerRef, str] = {}
        self._settled: dict[str, Outcome] = {}
        self._pull = PullReceiving(
            agent,
            channel,
            self.stats,
            transfers=self._transfers,
            clock=clock,
            done_timeout_s=done_timeout_s,
            fail=self._fail_and_abort,
            ready=self._progress_load,
        )
        self._push = PushReceiving(
            agent,
            channel,
            self.stats,
            transfers=self._transfers,
            sender_agents=self._sender_agents,
            pulling=self._pull.pulling,
            fail=self._fail,
            ready=self._progress_load,
        )

    def _peer(self, host: str, port: int, catch_up: bool = True) -> PeerRef:
        if catch_up:  # (not while handling events: they stay in order)
            self._catch_up()
        peer = PeerRef(host=host, port=int(port))
        if peer not in self._hello_sent:
            self._hello_sent.add(peer)
            hello = messages.Hello(
                agent_name=self.agent.name,
                agent_metadata=self.agent.metadata(),
                layout=self.agent.layout.wire(),
                target=f"{host}:{int(port)}",
                host=strategy.host_identity(),
            )
            self.channel.send(peer, hello)
            self._hellos[peer] = self._hellos.get(peer, 0) + 1
        return peer

    def expect(
        self,
        transfer_id: str,
        host: str,
        port: int,
        block_ids: list[int],
        token_offset: int,
        first_token: bool = False,
        aux_row: int | None = None,
    ) -> None:
        """Register ``block_ids`` (ours, for logical blocks from ``token_offset // B``) with P;
        ``first_token``: ask P to send its first output token with DONE; ``aux_row``: our row
        in the layout's aux layers, which P fills with the final WRITE (required when the
        layout has aux layers)."""
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id} already expected")
        layout = self.agent.layout
        layout.validate_block_ids(block_ids, "local block to receive")
        if (aux_row is None) != (layout.aux_layers == 0):
            raise ValueError(f"aux_row {aux_row!r} with {layout.aux_layers} aux layers")
        if aux_row is not None:
            layout.validate_block_ids([aux_row], "local aux row", layout.num_kv_layers)
        peer = self._peer(host, port)
        record = Transfer(transfer_id, S.REGISTERED, deadline=self.clock() + self.done_timeout_s)
        register = messages.Register(
            transfer_id=transfer_id,
            agent_name=self.agent.name,
            block_ids=[list(block_ids)],
            token_offset=token_offset,
            first_token=True if first_token else None,
            aux_row=aux_row,
        )
        self._transfers[transfer_id] = Incoming(
            record,
            peer,
            len(block_ids),
            first_token,
            dst_blocks=frozenset(block_ids),
            register=register,
            hello_count=self._hellos[peer],
        )
        self.channel.send(peer, register)

    def release_remote(self, transfer_id: str, host: str, port: int) -> None:
        """We need none of P's blocks (e.g. a full local prefix hit): let P free them now."""
        peer = self._peer(host, port)
        reg = messages.Register(
            transfer_id=transfer_id, agent_name=self.agent.name, block_ids=[[]], token_offset=0
        )
        self.channel.send(peer, reg)

    def abort(
        self, transfer_id: str, reason: str, host: str | None = None, port: int | None = None
    ) -> None:
        """Our request is gone: ask P to stop; the outcome comes once P acknowledges. For a
        transfer we never registered, ``host``/``port`` (P's side channel) still tell P, so it
        drops the request instead of waiting for a registration."""
        inc = self._transfers.get(transfer_id)
        if inc is None and host is not None and port is not None:
            abort = messages.Abort(transfer_id=transfer_id, reason=reason)
            self.channel.send(self._peer(host, port), abort)
            return
        if inc is None or inc.record.state.terminal:
            return
        inc.record.transition(S.ABORTED, reason)
        self._hold_until_ack(inc, Outcome(False, f"aborted: {reason}"))

    def poll(self) -> dict[str, Outcome]:
        self._handle_events(self.channel.receive_connected())
        now = self.clock()
        for inc in list(self._transfers.values()):
            if inc.reads or inc.final is not None or inc.ready is not None:
                self._progress_load(inc)
            if inc.record.state is S.REGISTERED and inc.record.expired(now):
                inc.record.transition(S.EXPIRED, f"no DONE within {self.done_timeout_s}s")
                self.stats.done_timeouts += 1
                self._hold_until_ack(inc, Outcome(False, inc.record.reason))
            elif inc.outcome is not None and inc.record.expired(now):
                logger.warning(
                    "transfer %s: no ABORT_ACK from %s within %ss; settling anyway",
                    inc.record.transfer_id,
                    inc.peer,
                    self.abort_ack_timeout_s,
                )
                self._settle(inc, inc.outcome)
        self._pull.expire(now)
        settled, self._settled = self._settled, {}
        return settled

    def pending(self) -> int:
        return len(self._transfers)

    def _handle_events(self, events: list[Inbound | PeerLost]) -> None:
        # Notifications first, and a few extra progress rounds when a peer is gone: a P that
        # wrote DONE and then exited must not read as "lost" because its FIN came first.
        rounds = 3 if any(isinstance(event, PeerLost) for event in events) else 1
        for _ in range(rounds):
            self._push.receive()
        for event in events:
            if isinstance(event, PeerLost):
                self._on_peer_lost(event.peer)
            elif isinstance(event, Inbound):
                self._on_message(event.peer, event.message)

    def _catch_up(self) -> None:
        """Handle what the channel reported since the last poll before contacting a P: an
        engine idle for a while polls nothing, and a loss reported meanwhile (P restarted)
        must not be taken for the loss of the connection the next REGISTER goes out on (it
        would fail that load, and it would have been sent without a HELLO)."""
        events = self.channel.receive_connected()
        if events:
            self._handle_events(events)

    # -- the load's end ----------------------------------------------------------------------

    def _progress_load(self, inc: Incoming) -> None:
        """The one load-completion path, for both directions: settle finished READs; complete
        a ready load with none in flight; release a held outcome once the last READ is done."""
        inc.reads, failed = self.agent.settle(inc.reads)
        if failed and inc.record.state is S.REGISTERED:
            self._fail_and_abort(inc, f"READ from prefill side {inc.peer} failed")
        if inc.reads:
            self._watch_reads(inc)
            if inc.reads:
                return
        if inc.final is not None:
            final, inc.final = inc.final, None
            self._settle(inc, final)
        elif inc.ready is not None and inc.record.state is S.REGISTERED:
            inc.record.transition(S.COMPLETED)
            if self._pull.pulling(inc.peer):
                self._pull.completed(inc)
            handoff = max(0.0, time.time() - inc.ready.prefill_end_wall)
            token = inc.ready.first_token if inc.wants_token else None
            self._settle(inc, Outcome(True, exposed_handoff_s=handoff, first_token=token))

    def _watch_reads(self, inc: Incoming) -> None:
        """An ended load (its outcome held back for its READs) whose READs have not settled
        within ``abort_ack_timeout_s`` (a transport gone silent) cancels them, so its blocks
        are not held forever. A live load's READs are bounded by ``done_timeout_s`` instead.
        A READ NIXL cannot cancel keeps the blocks held (tried again after another period)."""
        if inc.final is None:
            return
        now = self.clock()
        if inc.reads_deadline is None:
            inc.reads_deadline = now + self.abort_ack_timeout_s
            return
        if now < inc.reads_deadline:
            return
        logger.warning(
            "transfer %s: %d READs from %s did not settle within %ss of the load's end: cancelling",
            inc.record.transfer_id,
            len(inc.reads),
            inc.peer,
            self.abort_ack_timeout_s,
        )
        self.stats.reads_cancelled += len(inc.reads)
        inc.reads = self.agent.abandon(inc.reads)
        inc.reads_deadline = None

    def _hold_until_ack(self, inc: Incoming, outcome: Outcome) -> None:
        inc.outcome = outcome
        inc.record.deadline = self.clock() + self.abort_ack_timeout_s
        self.channel.send(
            inc.peer, messages.Abort(transfer_id=inc.record.transfer_id, reason=outcome.reason)
        )

    def _settle(self, inc: Incoming, outcome: Outcome) -> None:
        if inc.reads:  # a READ of ours may still fill the blocks: hold the outcome back
            inc.final = outcome
            return
        transfer_id = inc.record.transfer_id
        if self._transfers.get(transfer_id) is not inc:
            return
        self._transfers.pop(transfer_id, None)
        self._settled[transfer_id] = outcome
        if outcome.ok:
            self.stats.transfers_completed += 1
            if outcome.exposed_handoff_s is not None:
                self.stats.handoffs_s.append(outcome.exposed_handoff_s)
        else:
            self.stats.transfers_failed += 1

    def _fail(self, inc: Incoming, reason: str) -> None:
        """Fail a load that nothing of P's fills any more (P aborted, P is gone): at once."""
        if inc.record.state is S.REGISTERED:
            inc.record.transition(S.FAILED, reason)
        self._settle(inc, Outcome(False, reason))

    def _fail_and_abort(self, inc: Incoming, reason: str) -> None:
        """Fail a load P may still be serving: ABORT P (it may free) and settle like a timeout,
        once P answers (or ``abort_ack_timeout_s``) and no READ of ours is in flight."""
        if inc.record.state is not S.REGISTERED:
            return
        inc.record.transition(S.FAILED, reason)
        self._hold_until_ack(inc, Outcome(False, reason))

    # -- control messages --------------------------------------------------------------------

    def _on_peer_lost(self, peer: PeerRef) -> None:
        self._hello_sent.discard(peer)  # a restarted P needs our metadata again
        self._sender_agents.pop(peer, None)
        self._pull.forget(peer)
        for inc in list(self._transfers.values()):
            if inc.peer == peer:
                self._fail(inc, f"lost connection to prefill side {peer}")

    def _on_message(self, peer: PeerRef, message: messages.Message) -> None:
        if isinstance(message, messages.HelloAck):
            self._sender_agents[peer] = message.agent_name
            self._pull.on_hello_ack(peer, message)
        elif isinstance(message, messages.Announce):
            self._pull.on_announce(peer, message)
        elif isinstance(message, messages.Done):
            self._pull.on_done(peer, message)
        elif isinstance(message, messages.FirstToken):
            self._pull.on_first_token(peer, message)
        elif isinstance(message, (messages.Abort, messages.AbortAck)):
            self._on_abort(peer, message)
        elif isinstance(message, messages.Confirm):
            self._on_confirm(peer, message)
        else:
            logger.warning("receiver: unexpected %s from %s", message.type, peer)

    def _on_confirm(self, peer: PeerRef, ask: messages.Confirm) -> None:
        """P asks whether another connection speaking for our agent is ours (``peering``):
        only our side channel knows the routing ids it dials with."""
        try:
            routing_id = bytes.fromhex(ask.routing_id)
        except ValueError:
            routing_id = b""
        owned = bool(routing_id) and self.channel.owns(routing_id, ask.target)
        if not owned:
            logger.warning(
                "receiver: %s asked about a connection in our name that is not ours (%s): "
                "someone replayed our HELLO; answered no",
                peer,
                ask.target,
            )
        self.channel.send(peer, messages.Confirmed(nonce=ask.nonce, owned=owned))

    def _on_abort(self, peer: PeerRef, message: messages.Abort | messages.AbortAck) -> None:
        transfer_id = message.transfer_id
        if isinstance(message, messages.Abort) and message.reason.startswith(
            messages.HELLO_REFUSAL
        ):
            self._on_hello_refusal(peer, message)
            return
        if transfer_id == "*" and isinstance(message, messages.Abort):  # P refused us
            self._hello_sent.discard(peer)  # the next load to this P says HELLO again
            for inc in list(self._transfers.values()):
                if inc.peer == peer and inc.outcome is None:
                    self._fail(inc, f"prefill side refused: {message.reason}")
            return
        inc = self._transfers.get(transfer_id)
        if inc is None or inc.peer != peer:
            return
        if inc.outcome is not None:  # ABORT_ACK, or P aborted too: nothing of its is in flight
            self._settle(inc, inc.outcome)
        elif isinstance(message, messages.Abort):
            self._fail(inc, f"prefill side aborted: {message.reason}")

    def _on_hello_refusal(self, peer: PeerRef, refusal: messages.Abort) -> None:
        """P has no valid HELLO on our connection (it restarted, pruned our admission, or
        refused our HELLO): say HELLO again and register again, once per transfer. For one
        transfer (its REGISTER came before any HELLO P holds), or ``*``: every transfer to
        that P it has not started serving (one it serves keeps going: the refusal is older)."""
        if refusal.transfer_id == "*":
            self._hello_sent.discard(peer)
            for inc in list(self._transfers.values()):
                if inc.peer == peer and not inc.started:
                    self._register_again(inc, refusal.reason)
            return
        inc = self._transfers.get(refusal.transfer_id)
        if inc is None or inc.peer != peer:
            return
        if inc.hello_count == self._hellos.get(peer):  # no HELLO said since that REGISTER
            self._hello_sent.discard(peer)
        self._register_again(inc, refusal.reason)

    def _register_again(self, inc: Incoming, reason: str) -> None:
        """HELLO (unless said since the refusal) and the same REGISTER again; a transfer
        refused a second time, or already being served, fails."""
        if inc.outcome is not None or inc.record.state is not S.REGISTERED:
            return
        if inc.registered_again or inc.register is None or inc.started:
            self._fail(inc, f"prefill side refused: {reason}")
            return
        assert inc.peer.host is not None and inc.peer.port is not None
        inc.registered_again = True
        self.stats.registered_again += 1
        peer = self._peer(inc.peer.host, inc.peer.port, catch_up=False)
        inc.hello_count = self._hellos[peer]
        logger.info(
            "transfer %s: %s refused its registration (%s): HELLO and REGISTER again",
            inc.record.transfer_id,
            peer,
            reason,
        )
        self.channel.send(peer, inc.register)
