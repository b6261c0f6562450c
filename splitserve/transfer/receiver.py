"""The decode side (D) of the layer-wise transfer: registers blocks with P and waits for DONE.

Engine-agnostic; runs in the thread that owns D's KV cache (vLLM worker, SGLang scheduler). The
sender's direction (strategy.py) rules, and it says which in its HELLO_ACK:

- push: D posts nothing. P writes into D's registered memory and D only learns, from the DONE
  notification that rides on P's last WRITE, that its blocks are filled.
- pull: the HELLO_ACK brings P's agent metadata and layout (D adds P as a NIXL peer). For each
  ANNOUNCE (layers, P's blocks, D's blocks) D checks the ids (P's against P's layout, D's
  against the blocks it registered for that transfer, each (layer, block) at most once) and
  posts one READ; its agent's progress thread drives it. DONE then comes on the side channel;
  the load completes when DONE arrived, every registered (layer, block) was announced and
  every READ is done; D then sends PULLED so P may free. With the first token, P's engine's
  FIRST_TOKEN (relayed by P's side channel as soon as the token is sampled) stands in for DONE
  once every registered (layer, block) was announced: the load completes without waiting for
  P's next engine step, and a DONE that arrives later is ignored.

    expect(tid, host, port, block_ids, token_offset, first_token=False, aux_row=None)
                                                       HELLO (first contact) + REGISTER to P;
                                                       first_token: DONE must bring P's first
                                                       output token (Outcome.first_token);
                                                       aux_row: our row in the aux layers
    release_remote(tid, host, port)                   tell P we need nothing (empty REGISTER)
    abort(tid, reason, host=None, port=None)           our request is gone: ABORT to P (also
                                                       before we registered, given P's address)
    poll() -> {tid: Outcome}                           transfers settled since the last call

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
from dataclasses import dataclass, field

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent, TransferPostError, XferHandle
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef, SideChannel
from splitserve.transfer.state import Transfer, TransferState

logger = logging.getLogger(__name__)
S = TransferState


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reason: str = ""
    exposed_handoff_s: float | None = None  # P's last forward returned -> DONE seen here
    first_token: int | None = None  # P's first output token, when the registration asked


@dataclass
class ReceiverStats:
    transfers_completed: int = 0
    transfers_failed: int = 0
    done_timeouts: int = 0
    messages_rejected: int = 0
    reads_posted: int = 0  # pull: one READ per ANNOUNCE
    bytes_read: int = 0
    post_seconds: float = 0.0  # pull: seconds inside READ posts (over cma: the copy, on D)
    completed_on_first_token: int = 0  # pull: completed on P's FIRST_TOKEN, not its DONE
    handoffs_s: list[float] = field(default_factory=list)


@dataclass
class _Incoming:
    record: Transfer
    peer: PeerRef
    num_blocks: int
    wants_token: bool = False
    outcome: Outcome | None = None  # decided, possibly held back until ABORT_ACK
    dst_blocks: frozenset[int] = frozenset()  # what we registered (pull: READ targets)
    reads: list[XferHandle] = field(default_factory=list)  # pull: posted, not settled
    read_pairs: set[tuple[int, int]] = field(default_factory=set)  # (layer, our block) read
    done: messages.Done | None = None  # pull: P's DONE, completing once the READs are done
    early_token: messages.FirstToken | None = None  # pull: P's engine's token, before DONE
    final: Outcome | None = None  # settled, given to the engine once no READ is in flight


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
        self._transfers: dict[str, _Incoming] = {}
        self._hello_sent: set[PeerRef] = set()
        self._sender_agents: dict[PeerRef, str] = {}
        self._pull_peers: dict[PeerRef, str] = {}  # P that announces -> its NIXL agent name
        self._settled: dict[str, Outcome] = {}
        # pull: loads completed on P's FIRST_TOKEN, until P's DONE for them (if it was sent
        # before our PULLED reached P) arrives and is ignored, or the bound passes
        self._completed_early: dict[str, float] = {}

    def _peer(self, host: str, port: int) -> PeerRef:
        peer = PeerRef(host=host, port=int(port))
        if peer not in self._hello_sent:
            self._hello_sent.add(peer)
            hello = messages.Hello(
                agent_name=self.agent.name,
                agent_metadata=self.agent.metadata(),
                layout=self.agent.layout.model_dump(),
            )
            self.channel.send(peer, hello)
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
        self._transfers[transfer_id] = _Incoming(
            record, peer, len(block_ids), first_token, dst_blocks=frozenset(block_ids)
        )
        self.channel.send(
            peer,
            messages.Register(
                transfer_id=transfer_id,
                agent_name=self.agent.name,
                block_ids=[list(block_ids)],
                token_offset=token_offset,
                first_token=True if first_token else None,
                aux_row=aux_row,
            ),
        )

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
        events = self.channel.receive_connected()
        # Notifications first, and a few extra progress rounds when a peer is gone: a P that
        # wrote DONE and then exited must not read as "lost" because its FIN came first.
        rounds = 3 if any(isinstance(event, PeerLost) for event in events) else 1
        for _ in range(rounds):
            for sender_agent, notifs in self.agent.notifications().items():
                name = sender_agent.decode() if isinstance(sender_agent, bytes) else sender_agent
                for notif in notifs:
                    self._on_notification(name, notif)
        for event in events:
            if isinstance(event, PeerLost):
                self._on_peer_lost(event.peer)
            elif isinstance(event, Inbound):
                self._on_message(event.peer, event.message)
        now = self.clock()
        for inc in list(self._transfers.values()):
            if inc.reads or inc.final is not None or inc.done is not None:
                self._progress_pull(inc)
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
        for tid, until in list(self._completed_early.items()):
            if now >= until:
                del self._completed_early[tid]
        settled, self._settled = self._settled, {}
        return settled

    def pending(self) -> int:
        return len(self._transfers)

    # -- internals ---------------------------------------------------------------------------

    def _hold_until_ack(self, inc: _Incoming, outcome: Outcome) -> None:
        inc.outcome = outcome
        inc.record.deadline = self.clock() + self.abort_ack_timeout_s
        self.channel.send(
            inc.peer, messages.Abort(transfer_id=inc.record.transfer_id, reason=outcome.reason)
        )

    def _settle(self, inc: _Incoming, outcome: Outcome) -> None:
        if inc.reads:  # a READ of ours may still fill the blocks: hold the outcome back
            inc.final = outcome
            return
        tid = inc.record.transfer_id
        if self._transfers.get(tid) is not inc:
            return
        self._transfers.pop(tid, None)
        self._settled[tid] = outcome
        if outcome.ok:
            self.stats.transfers_completed += 1
            if outcome.exposed_handoff_s is not None:
                self.stats.handoffs_s.append(outcome.exposed_handoff_s)
        else:
            self.stats.transfers_failed += 1

    def _fail(self, inc: _Incoming, reason: str) -> None:
        if inc.record.state is S.REGISTERED:
            inc.record.transition(S.FAILED, reason)
        self._settle(inc, Outcome(False, reason))

    def _on_peer_lost(self, peer: PeerRef) -> None:
        self._hello_sent.discard(peer)  # a restarted P needs our metadata again
        self._sender_agents.pop(peer, None)
        self._pull_peers.pop(peer, None)
        for inc in list(self._transfers.values()):
            if inc.peer == peer:
                self._fail(inc, f"lost connection to prefill side {peer}")

    def _on_message(self, peer: PeerRef, message: messages.Message) -> None:
        if isinstance(message, messages.HelloAck):
            self._sender_agents[peer] = message.agent_name
            self._on_hello_ack(peer, message)
            return
        if isinstance(message, messages.Announce):
            self._on_announce(peer, message)
            return
        if isinstance(message, messages.Done):
            self._on_pull_done(peer, message)
            return
        if isinstance(message, messages.FirstToken):
            self._on_first_token(peer, message)
            return
        if isinstance(message, (messages.Abort, messages.AbortAck)):
            tid = message.transfer_id
            if tid == "*" and isinstance(message, messages.Abort):  # P refused our HELLO
                for inc in list(self._transfers.values()):
                    if inc.peer == peer and inc.outcome is None:
                        self._fail(inc, f"prefill side refused: {message.reason}")
                return
            inc = self._transfers.get(tid)
            if inc is None or inc.peer != peer:
                return
            if isinstance(message, messages.AbortAck):
                if inc.outcome is not None:
                    self._settle(inc, inc.outcome)
            elif inc.outcome is not None:
                self._settle(inc, inc.outcome)  # P aborted too: nothing of its is in flight
            else:
                self._fail(inc, f"prefill side aborted: {message.reason}")
            return
        logger.warning("receiver: unexpected %s from %s", message.type, peer)

    def _on_notification(self, sender_agent: str, notif: bytes) -> None:
        try:
            message = messages.decode(notif, self.channel.auth_key)
        except messages.MessageError as exc:
            self.stats.messages_rejected += 1
            logger.warning("receiver: rejected a notification from %s: %s", sender_agent, exc)
            return
        if not isinstance(message, messages.Done):
            logger.warning("receiver: unexpected %s notification", message.type)
            return
        inc = self._transfers.get(message.transfer_id)
        if inc is None:
            logger.warning("receiver: DONE for unknown transfer %s", message.transfer_id)
            return
        expected_agent = self._sender_agents.get(inc.peer)
        if expected_agent is not None and expected_agent != sender_agent:
            self.stats.messages_rejected += 1
            logger.warning(
                "receiver: DONE for %s from agent %s, expected %s",
                message.transfer_id,
                sender_agent,
                expected_agent,
            )
            return
        if inc.peer in self._pull_peers:  # a pulling P sends DONE on the side channel
            self.stats.messages_rejected += 1
            logger.warning("receiver: DONE notification for pulled %s", message.transfer_id)
            return
        if inc.record.state is not S.REGISTERED:
            return  # already timed out or aborted: the held outcome stands
        if message.num_blocks != inc.num_blocks:
            self._fail(inc, f"DONE covers {message.num_blocks} blocks, expected {inc.num_blocks}")
            return
        if inc.wants_token and message.first_token is None:
            self._fail(inc, "DONE carries no first token (does the prefill side predate it?)")
            return
        inc.record.transition(S.COMPLETED)
        handoff = max(0.0, time.time() - message.prefill_end_wall)
        token = message.first_token if inc.wants_token else None
        self._settle(inc, Outcome(True, exposed_handoff_s=handoff, first_token=token))

    # -- pull ---------------------------------------------------------------------------------

    def _on_hello_ack(self, peer: PeerRef, ack: messages.HelloAck) -> None:
        if ack.direction != "pull":
            self._pull_peers.pop(peer, None)
            return
        try:
            if ack.agent_metadata is None or ack.layout is None:
                raise ValueError("no agent metadata or layout")
            name = self.agent.add_peer(ack.agent_metadata, KVLayout.model_validate(ack.layout))
            if name != ack.agent_name:
                raise ValueError(f"metadata names agent {name}, HELLO_ACK {ack.agent_name}")
        except Exception as exc:  # bad metadata or layout: no READ from this peer
            self.stats.messages_rejected += 1
            logger.warning("receiver: refusing pull from %s: %s", peer, exc)
            for inc in list(self._transfers.values()):
                if inc.peer == peer and inc.record.state is S.REGISTERED:
                    self._fail_pull(inc, f"prefill side's pull offer refused: {exc}")
            return
        self._pull_peers[peer] = name

    def _pulled_transfer(self, peer: PeerRef, message) -> _Incoming | None:
        """The transfer a pull message names, if it is ours from that peer and still live."""
        inc = self._transfers.get(message.transfer_id)
        if inc is None or inc.peer != peer:
            self.stats.messages_rejected += 1
            logger.warning(
                "receiver: %s for unknown transfer %s", message.type, message.transfer_id
            )
            return None
        if inc.record.state is not S.REGISTERED or inc.done is not None:
            return None  # settled or settling: nothing more is read
        if peer not in self._pull_peers:
            self._fail_pull(inc, f"{message.type} from a prefill side that did not offer pull")
            return None
        return inc

    def _on_announce(self, peer: PeerRef, announce: messages.Announce) -> None:
        inc = self._pulled_transfer(peer, announce)
        if inc is None:
            return
        src, dst, layers = announce.src_block_ids, announce.dst_block_ids, announce.layers
        pairs = {(layer, block) for layer in layers for block in dst}
        problem = None
        if len(src) != len(dst):
            problem = f"{len(src)} source blocks for {len(dst)} destinations"
        elif len(set(layers)) != len(layers) or len(set(dst)) != len(dst):
            problem = "duplicate layers or destination blocks"
        elif any(layer >= self.agent.layout.num_kv_layers for layer in layers):
            problem = f"layer outside 0..{self.agent.layout.num_kv_layers - 1}"
        elif not inc.dst_blocks.issuperset(dst):
            problem = "destination blocks this transfer did not register"
        elif pairs & inc.read_pairs:
            problem = "a (layer, block) announced twice"
        if problem:
            self._fail_pull(inc, f"invalid ANNOUNCE: {problem}")
            return
        all_layers = [layer for layer in layers for _ in dst]
        t0 = time.perf_counter()  # a cost, not a deadline
        try:  # validates P's ids against P's layout and ours against our cache
            handle = self.agent.post(
                "READ", self._pull_peers[peer], all_layers, dst * len(layers), src * len(layers)
            )
        except (TransferPostError, ValueError) as exc:
            self._fail_pull(inc, f"READ not posted: {exc}")
            return
        finally:
            self.stats.post_seconds += time.perf_counter() - t0
        inc.reads.append(handle)
        inc.read_pairs |= pairs
        self.stats.reads_posted += 1
        self.stats.bytes_read += handle.num_bytes
        self._complete_early(inc)

    def _on_first_token(self, peer: PeerRef, message: messages.FirstToken) -> None:
        inc = self._transfers.get(message.transfer_id)
        if inc is None or inc.peer != peer or not inc.wants_token or peer not in self._pull_peers:
            logger.debug("receiver: FIRST_TOKEN for %s ignored", message.transfer_id)
            return
        if inc.record.state is S.REGISTERED and inc.done is None:
            inc.early_token = message
            self._complete_early(inc)

    def _complete_early(self, inc: _Incoming) -> None:
        """Pull with the first token: once P's engine sent the token and every registered
        (layer, block) was announced, DONE would tell us nothing more; complete (when the
        READs are done) without waiting for it."""
        token = inc.early_token
        if token is None or inc.done is not None or inc.record.state is not S.REGISTERED:
            return
        if len(inc.read_pairs) != inc.num_blocks * self.agent.layout.num_kv_layers:
            return
        tid = inc.record.transfer_id
        inc.done = messages.Done(
            transfer_id=tid,
            num_blocks=inc.num_blocks,
            prefill_end_wall=token.sampled_wall,
            first_token=token.token,
        )
        self._completed_early[tid] = self.clock() + self.done_timeout_s
        self._progress_pull(inc)

    def _on_pull_done(self, peer: PeerRef, done: messages.Done) -> None:
        if self._completed_early.pop(done.transfer_id, None) is not None:
            return  # completed on P's FIRST_TOKEN; this DONE crossed our PULLED
        inc = self._pulled_transfer(peer, done)
        if inc is None:
            return
        if done.num_blocks != inc.num_blocks:
            self._fail_pull(inc, f"DONE covers {done.num_blocks} blocks, expected {inc.num_blocks}")
        elif inc.wants_token and done.first_token is None:
            self._fail_pull(inc, "DONE carries no first token (does the prefill side predate it?)")
        elif len(inc.read_pairs) != inc.num_blocks * self.agent.layout.num_kv_layers:
            self._fail_pull(inc, "DONE before every registered block was announced")
        else:
            inc.done = done
            self._progress_pull(inc)

    def _progress_pull(self, inc: _Incoming) -> None:
        """Settle finished READs; complete on DONE with none in flight; release a held outcome
        once the last READ is done."""
        inc.reads, failed = self.agent.settle(inc.reads)
        if failed and inc.record.state is S.REGISTERED:
            self._fail_pull(inc, f"READ from prefill side {inc.peer} failed")
        if inc.reads:
            return
        if inc.final is not None:
            final, inc.final = inc.final, None
            self._settle(inc, final)
        elif inc.done is not None and inc.record.state is S.REGISTERED:
            inc.record.transition(S.COMPLETED)
            tid = inc.record.transfer_id
            self.channel.send(inc.peer, messages.Pulled(transfer_id=tid))
            handoff = max(0.0, time.time() - inc.done.prefill_end_wall)
            token = inc.done.first_token if inc.wants_token else None
            if tid in self._completed_early:
                self.stats.completed_on_first_token += 1
            self._settle(inc, Outcome(True, exposed_handoff_s=handoff, first_token=token))

    def _fail_pull(self, inc: _Incoming, reason: str) -> None:
        """Fail a pulled load: ABORT P (it may free) and settle like a timeout, once P answers
        (or ``abort_ack_timeout_s``) and no READ of ours is in flight."""
        if inc.record.state is not S.REGISTERED:
            return
        inc.record.transition(S.FAILED, reason)
        self._hold_until_ack(inc, Outcome(False, reason))
