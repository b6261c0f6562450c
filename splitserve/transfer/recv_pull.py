"""Pull, D's side: P ANNOUNCEs its completed blocks on the side channel and D READs them.

Engine-agnostic; runs in the thread that polls ``KVReceiver``. A pulling P says so in its
HELLO_ACK, which brings P's agent metadata and layout (D adds P as a NIXL peer). For each
ANNOUNCE (layers, P's blocks, D's blocks) D checks the ids (P's against P's layout, D's against
the blocks it registered for that transfer, each (layer, block) at most once) and posts one
READ; its agent's progress thread drives it. DONE then comes on the side channel; the load is
ready when DONE arrived and every registered (layer, block) was announced, and completes once
every READ is done; D then sends PULLED so P may free. With the first token, P's engine's
FIRST_TOKEN (relayed by P's side channel as soon as the token is sampled) stands in for DONE
once every registered (layer, block) was announced: the load completes without waiting for P's
next engine step, and a DONE that arrives later is ignored.

Invariants:
- A failed READ or an invalid pull message fails the load through ``fail`` (ABORT to P, settled
  like a timeout); nothing is read for a transfer that is not REGISTERED or already ready.
- A P's NIXL agent stays loaded (for us: ``_refs``, the ``add_peer`` calls we made) only while
  a connection to it offers pull or a READ of ours from it is in flight: when its connection
  is lost (``forget``) our references are dropped at the next ``expire`` after its last READ
  settled, so a D that outlives many P restarts (a new agent each) does not keep their
  metadata forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent, TransferPostError
from splitserve.transfer.incoming import Incoming, Ready, ReceiverStats, done_problem
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import PeerRef, SideChannel
from splitserve.transfer.state import TransferState

logger = logging.getLogger(__name__)
S = TransferState


class PullReceiving:
    """D READs what P ANNOUNCEs (see module docstring)."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        stats: ReceiverStats,
        *,
        transfers: dict[str, Incoming],
        clock: Callable[[], float],
        done_timeout_s: float,
        fail: Callable[[Incoming, str], None],
        ready: Callable[[Incoming], None],
    ) -> None:
        self.agent = agent
        self.channel = channel
        self.stats = stats
        self.clock = clock
        self.done_timeout_s = done_timeout_s
        self._transfers = transfers  # the receiver's, read here
        self._fail = fail  # ABORT to P, settled on its ABORT_ACK
        self._ready = ready
        self._peers: dict[PeerRef, str] = {}  # P that announces -> its NIXL agent name
        self._unused: set[str] = set()  # agents loaded for a P no connection offers pull for
        self._refs: dict[str, int] = {}  # agent -> add_peer calls of ours not yet undone
        # loads completed on P's FIRST_TOKEN, until P's DONE for them (if it was sent before
        # our PULLED reached P) arrives and is ignored, or the bound passes
        self._completed_early: dict[str, float] = {}

    def pulling(self, peer: PeerRef) -> bool:
        return peer in self._peers

    def forget(self, peer: PeerRef) -> None:
        """``peer``'s connection is gone: its agent is unloaded once nothing reads from it."""
        name = self._peers.pop(peer, None)
        if name is not None:
            self._unused.add(name)

    def on_hello_ack(self, peer: PeerRef, ack: messages.HelloAck) -> None:
        if ack.direction != "pull":
            self.forget(peer)
            return
        try:
            if ack.agent_metadata is None or ack.layout is None:
                raise ValueError("no agent metadata or layout")
            name = self.agent.add_peer(ack.agent_metadata, KVLayout.model_validate(ack.layout))
            self._refs[name] = self._refs.get(name, 0) + 1
            if name != ack.agent_name:
                self._unused.add(name)  # loaded, but not for this peer
                raise ValueError(f"metadata names agent {name}, HELLO_ACK {ack.agent_name}")
        except Exception as exc:  # bad metadata or layout: no READ from this peer
            self.stats.messages_rejected += 1
            logger.warning("receiver: refusing pull from %s: %s", peer, exc)
            for inc in list(self._transfers.values()):
                if inc.peer == peer and inc.record.state is S.REGISTERED:
                    self._fail(inc, f"prefill side's pull offer refused: {exc}")
            return
        self._peers[peer] = name

    def on_announce(self, peer: PeerRef, announce: messages.Announce) -> None:
        inc = self._transfer(peer, announce)
        if inc is None:
            return
        src, dst, layers = announce.src_block_ids, announce.dst_block_ids, announce.layers
        pairs = {(layer, block) for layer in layers for block in dst}
        num_layers = self.agent.layout.num_kv_layers
        problem = None
        if len(src) != len(dst):
            problem = f"{len(src)} source blocks for {len(dst)} destinations"
        elif len(set(layers)) != len(layers) or len(set(dst)) != len(dst):
            problem = "duplicate layers or destination blocks"
        elif any(layer >= num_layers for layer in layers):
            problem = f"layer outside 0..{num_layers - 1}"
        elif not inc.dst_blocks.issuperset(dst):
            problem = "destination blocks this transfer did not register"
        elif pairs & inc.read_pairs:
            problem = "a (layer, block) announced twice"
        if problem:
            self._fail(inc, f"invalid ANNOUNCE: {problem}")
            return
        all_layers = [layer for layer in layers for _ in dst]
        t0 = time.perf_counter()  # a cost, not a deadline
        try:  # validates P's ids against P's layout and ours against our cache
            handle = self.agent.post(
                "READ", self._peers[peer], all_layers, dst * len(layers), src * len(layers)
            )
        except (TransferPostError, ValueError) as exc:
            self._fail(inc, f"READ not posted: {exc}")
            return
        finally:
            self.stats.post_seconds += time.perf_counter() - t0
        inc.reads.append(handle)
        inc.read_pairs |= pairs
        self.stats.reads_posted += 1
        self.stats.bytes_read += handle.num_bytes
        self._complete_early(inc)

    def on_first_token(self, peer: PeerRef, message: messages.FirstToken) -> None:
        inc = self._transfers.get(message.transfer_id)
        if inc is None or inc.peer != peer or not inc.wants_token or peer not in self._peers:
            logger.debug("receiver: FIRST_TOKEN for %s ignored", message.transfer_id)
            return
        if inc.record.state is S.REGISTERED and inc.ready is None:
            inc.early_token = message
            self._complete_early(inc)

    def on_done(self, peer: PeerRef, done: messages.Done) -> None:
        if self._completed_early.pop(done.transfer_id, None) is not None:
            return  # completed on P's FIRST_TOKEN; this DONE crossed our PULLED
        inc = self._transfer(peer, done)
        if inc is None:
            return
        problem = done_problem(inc, done)
        if problem is None and not self._all_announced(inc):
            problem = "DONE before every registered block was announced"
        if problem is not None:
            self._fail(inc, problem)
            return
        inc.ready = Ready(done.prefill_end_wall, done.first_token)
        self._ready(inc)

    def completed(self, inc: Incoming) -> None:
        """The load completed (every READ done): P may free."""
        transfer_id = inc.record.transfer_id
        self.channel.send(inc.peer, messages.Pulled(transfer_id=transfer_id))
        if transfer_id in self._completed_early:
            self.stats.completed_on_first_token += 1

    def expire(self, now: float) -> None:
        """Forget early completions whose late DONE can no longer come; unload the agents of
        Ps no connection offers pull for and no READ of ours still reads from."""
        for transfer_id, until in list(self._completed_early.items()):
            if now >= until:
                del self._completed_early[transfer_id]
        if self._unused:
            self._unload_unused()

    def _unload_unused(self) -> None:
        live = set(self._peers.values())
        reading = {h.peer for inc in self._transfers.values() for h in inc.reads}
        for name in list(self._unused):
            if name in live:
                self._unused.discard(name)  # offered pull again (a reconnection)
            elif name not in reading:
                self._unused.discard(name)
                try:
                    while self._refs.get(name, 0) > 0:
                        self.agent.remove_peer(name)
                        self._refs[name] -= 1
                    self._refs.pop(name, None)
                except Exception as exc:  # NIXL refused: keep it listed, try again later
                    self._unused.add(name)
                    logger.warning("receiver: could not unload agent %s: %s", name, exc)

    def _all_announced(self, inc: Incoming) -> bool:
        return len(inc.read_pairs) == inc.num_blocks * self.agent.layout.num_kv_layers

    def _transfer(self, peer: PeerRef, message) -> Incoming | None:
        """The transfer a pull message names, if it is ours from that peer and still live."""
        inc = self._transfers.get(message.transfer_id)
        if inc is None or inc.peer != peer:
            self.stats.messages_rejected += 1
            logger.warning(
                "receiver: %s for unknown transfer %s", message.type, message.transfer_id
            )
            return None
        if inc.record.state is not S.REGISTERED or inc.ready is not None:
            return None  # settled or settling: nothing more is read
        if peer not in self._peers:
            self._fail(inc, f"{message.type} from a prefill side that did not offer pull")
            return None
        return inc

    def _complete_early(self, inc: Incoming) -> None:
        """Pull with the first token: once P's engine sent the token and every registered
        (layer, block) was announced, DONE would tell us nothing more; complete (when the
        READs are done) without waiting for it."""
        token = inc.early_token
        if token is None or inc.ready is not None or inc.record.state is not S.REGISTERED:
            return
        if not self._all_announced(inc):
            return
        inc.ready = Ready(token.sampled_wall, token.token)
        self._completed_early[inc.record.transfer_id] = self.clock() + self.done_timeout_s
        self._ready(inc)
