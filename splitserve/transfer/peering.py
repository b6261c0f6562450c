"""Which receiver a sender's connection speaks for: HELLO admission on P's side.

Engine-agnostic; used by ``KVSender`` in the thread that drives it. A receiver's HELLO carries
its NIXL metadata and KV layout; P admits it only if the metadata inside names the agent the
HELLO claims, and only if its layout is compatible with ours (checked before anything is
allocated for it: ``KVLayout.incompatibility``; a receiver of a tensor parallel size that
cannot pair with ours is refused first, ``tp.tp_mismatch``). From then on that connection (its
ZMQ routing id) may register transfers for that agent, and no other connection may.

Why the binding holds (docs/security.md, "Bound to a peer"): a receiver gives each address it
dials its own random routing id (``messages.new_routing_id``), kept for the life of its process
(a reconnection after a partition hands the same id over). Nobody else learns the id it uses
towards us, so nobody else can speak on that connection. An agent is bound to ONE connection:
a HELLO for an already admitted agent on another connection is admitted only when the agent
itself confirms, over the connection already admitted, that the new one is its own
(``Confirm`` / ``Confirmed``: the receiver checks the new routing id against its own sockets);
a replayed HELLO on an attacker's connection gets no confirmation and is refused. While a
confirmation is pending, what the new connection sends (its first REGISTER, pipelined behind
the HELLO) waits here, in order, bounded. When the admitted connection is gone (a send to it
finds no such peer) its binding stays: the receiver reconnects with the same routing id;
an idle binding is pruned, and a connection waiting on a pruned one is bound.

Pruning (docs/security.md): P cannot see a receiver's connection close (ZMQ's ROUTER reports
no per-peer disconnect), so an admission goes when its connection has been idle: no HELLO or
REGISTER on it for ``idle_s`` while no live transfer used its agent (``in_use``). The default is
twice the receiver's own idle close (``SideChannel.idle_close_s``), so the receiver has closed
that connection first and says HELLO again on its next one; a receiver that did not is told so
(``Abort("*")``, on which it says HELLO again). A NIXL agent is unloaded once no admission,
pending confirmation or live transfer refers to it. At most ``max_admitted`` connections are
admitted: a HELLO beyond, after pruning, is refused before its metadata is loaded.

Invariants:
- ``agent_of`` answers an agent only for a connection whose HELLO was admitted.
- One connection per agent at a time, except those the agent confirmed itself.
- A refused HELLO is answered with ``Abort(transfer_id="*")`` naming the reason, counted, and
  logged once per peer (a hostile peer cannot flood the log).
- Nothing waits forever: a confirmation not answered within ``confirm_timeout_s`` refuses the
  connection and hands its held messages back to be refused.
- Bounded: at most ``max_admitted`` admitted connections; every loaded NIXL agent is referred
  to by an admission, a pending confirmation or a live transfer, or is unloaded at the next
  prune (at most once a second, from ``expire``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.auth import PeerLog
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import PeerRef, SideChannel
from splitserve.transfer.tp import tp_mismatch

logger = logging.getLogger(__name__)

MAX_HELD_MESSAGES = 1024  # per connection awaiting confirmation
MAX_PENDING = 256  # connections awaiting confirmation at once
MAX_ADMITTED = 4096  # admitted connections (each may hold one loaded NIXL agent)
# An admission unused this long is pruned: twice the receiver's idle close (SideChannel's
# idle_close_s, 600 s), so the receiver closed its side first.
PEER_IDLE_S = 1200.0
_PRUNE_EVERY_S = 1.0

# Messages a connection sent while its confirmation was pending, released in order when it is
# settled: the caller handles each as if it had just arrived (an unbound connection's REGISTER
# is then refused as any other).
Held = list[tuple[PeerRef, messages.Message]]


@dataclass
class _Pending:
    """A connection whose HELLO names an agent already bound elsewhere: asked, not yet known."""

    agent_name: str
    nonce: str
    deadline: float
    held: list[messages.Message] = field(default_factory=list)


class PeerAdmission:
    """The receivers P has admitted, by connection (see module docstring)."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        hello_ack: Callable[[str], messages.HelloAck],  # the answer for this agent name
        on_refused: Callable[[], None],
        *,
        confirm_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        in_use: Callable[[], Collection[str]] = frozenset,
        idle_s: float = PEER_IDLE_S,
        max_admitted: int = MAX_ADMITTED,
    ) -> None:
        self.agent = agent
        self.channel = channel
        self._hello_ack = hello_ack
        self._on_refused = on_refused
        self.confirm_timeout_s = confirm_timeout_s
        self.clock = clock
        self._in_use = in_use  # the agents the sender's live transfers refer to
        self.idle_s = idle_s
        self.max_admitted = max_admitted
        self._last_used: dict[bytes, float] = {}  # admitted connection -> when last seen used
        self._touched: set[bytes] = set()  # used since the last prune (timed by the prune)
        self._next_prune = 0.0
        self._later: Held = []  # released by a prune inside on_hello; handed out by expire
        self._refs: dict[str, int] = {}  # agent -> our add_peer calls not yet undone
        self._agents: dict[bytes, str] = {}  # ROUTER identity -> admitted agent name
        self._home: dict[str, bytes] = {}  # agent -> the connection it was first admitted on
        self._pending: dict[bytes, _Pending] = {}
        self._log = PeerLog(logger)

    @property
    def admitted(self) -> int:
        """Connections admitted now."""
        return len(self._agents)

    def agent_of(self, peer: PeerRef) -> str | None:
        """The agent ``peer``'s connection was admitted for (None: no valid HELLO on it); asked
        for every REGISTER, so it also marks the connection used."""
        inbound = peer.inbound or b""
        name = self._agents.get(inbound)
        if name is not None:
            self._touched.add(inbound)
        return name

    def hold(self, peer: PeerRef, message: messages.Message) -> bool:
        """Keep ``message`` until ``peer``'s confirmation is settled; False when ``peer`` awaits
        none (the caller handles the message now)."""
        pending = self._pending.get(peer.inbound or b"")
        if pending is None:
            return False
        if len(pending.held) >= MAX_HELD_MESSAGES:
            return False  # the caller refuses it: a connection may not queue without bound
        pending.held.append(message)
        return True

    def on_hello(self, peer: PeerRef, hello: messages.Hello) -> None:
        """Admit ``peer``'s connection, ask the agent to confirm it, or refuse it."""
        if peer.inbound is None:
            self._refuse(peer, hello.agent_name, "a HELLO must come on an inbound connection")
            return
        if peer.inbound not in self._agents and len(self._agents) >= self.max_admitted:
            self._dispatch_later(self.prune(self.clock(), force=True))
            if len(self._agents) >= self.max_admitted:
                self._refuse(
                    peer,
                    hello.agent_name,
                    f"too many receivers admitted ({self.max_admitted}); try again later",
                )
                return
        try:
            layout = KVLayout.model_validate(hello.layout)
            # We send, the peer receives: sizes the connector cannot pair are refused first,
            # with both named (not as a run-length mismatch).
            mismatch = tp_mismatch(self.agent.layout.tp_size, layout.tp_size)
            if mismatch is not None:
                raise ValueError(f"peer KV layout incompatible: {mismatch}")
            name = self.agent.add_peer(hello.agent_metadata, layout)
            self._refs[name] = self._refs.get(name, 0) + 1
        except Exception as exc:  # bad metadata or layout: refuse this peer, keep serving
            self._refuse(peer, hello.agent_name, str(exc)[:300])
            return
        if name != hello.agent_name:
            self._refuse(peer, hello.agent_name, f"its metadata names agent {name[:128]!r}")
            return
        bound = self._agents.get(peer.inbound)
        if bound is not None and bound != name:
            self._refuse(peer, name, f"this connection speaks for agent {bound!r}")
            return
        home = self._home.get(name)
        if home is None or home == peer.inbound or bound == name:
            self.admit(peer, name)
            self.channel.send(peer, self._hello_ack(name))
            return
        if peer.inbound in self._pending:
            return  # a repeated HELLO while asking: the question stands
        if len(self._pending) >= MAX_PENDING:
            self._refuse(peer, name, "too many connections awaiting confirmation")
            return
        nonce = secrets.token_hex(16)
        self._pending[peer.inbound] = _Pending(name, nonce, self.clock() + self.confirm_timeout_s)
        ask = messages.Confirm(nonce=nonce, routing_id=peer.inbound.hex(), target=hello.target)
        self.channel.send(PeerRef(inbound=home), ask)  # gone? the channel reports it: ``lost``

    def on_confirmed(self, peer: PeerRef, answer: messages.Confirmed) -> Held:
        """The agent answered over its admitted connection ``peer``: bind or refuse the
        connection it was asked about."""
        name = self.agent_of(peer)
        for inbound, pending in list(self._pending.items()):
            if pending.agent_name == name and hmac.compare_digest(pending.nonce, answer.nonce):
                return self._settle(inbound, confirmed=answer.owned)
        self._log.warn(str(peer), "confirmed", "unexpected CONFIRMED from %s: ignored", peer)
        return []

    def expire(self) -> Held:
        """Refuse connections whose confirmation did not come in time; prune (see module
        docstring) at most once a second."""
        now = self.clock()
        out: Held = self._take_later()
        for inbound, pending in list(self._pending.items()):
            if now >= pending.deadline:
                out += self._settle(inbound, confirmed=False)
        return out + self.prune(now)

    def prune(self, now: float, force: bool = False) -> Held:
        """Drop admissions idle for ``idle_s`` whose agent no live transfer uses, then unload
        the NIXL agents nothing refers to any more. Answers what a connection that waited on a
        dropped one sent meanwhile (see ``lost``)."""
        if not force and now < self._next_prune:
            return []
        self._next_prune = now + _PRUNE_EVERY_S
        out: Held = []
        busy = set(self._in_use())
        for inbound in self._touched:
            self._last_used[inbound] = now
        self._touched.clear()
        for inbound, name in list(self._agents.items()):
            if name in busy:
                self._last_used[inbound] = now
            elif now - self._last_used.get(inbound, now) >= self.idle_s:
                peer = PeerRef(inbound=inbound)
                out += self._drop(peer)
                # Gone already: the send reports it (``lost`` again, a no-op). Still there (a
                # receiver that keeps connections longer): it says HELLO again on its next load.
                reason = f"hello: admission expired after {self.idle_s:g} s unused"
                self.channel.send(peer, messages.Abort(transfer_id="*", reason=reason))
                logger.info("peer %s (%s): admission pruned (idle)", peer, name)
        self._unload_unreferenced(busy)
        return out

    def _dispatch_later(self, held: Held) -> None:
        self._later += held

    def _take_later(self) -> Held:
        out, self._later = self._later, []
        return out

    def _unload_unreferenced(self, busy: set[str]) -> None:
        """Drop our references to agents no admission, pending confirmation or live transfer
        refers to (the agent may stay loaded for the receiving side of the same server)."""
        wanted = set(self._agents.values()) | {p.agent_name for p in self._pending.values()}
        for name in list(self._refs):
            if name in wanted or name in busy:
                continue
            try:
                while self._refs[name] > 0:
                    self.agent.remove_peer(name)
                    self._refs[name] -= 1
                del self._refs[name]
            except Exception as exc:  # NIXL refused: tried again at the next prune
                logger.warning("could not unload peer agent %s: %s", name, exc)

    def lost(self, peer: PeerRef) -> Held:
        """A reply to ``peer``'s connection found no such peer. That happens to a live
        receiver too, between its reconnections (it keeps its routing id, so it comes back as
        itself): its binding stays (an idle one is pruned, ``prune``), and a connection that
        waits for its confirmation keeps waiting until its deadline (binding it now would let a
        replayed HELLO in whenever the agent's connection blinks). Only a confirmation that
        this connection itself was waiting for is dropped."""
        self._pending.pop(peer.inbound or b"", None)
        return []

    def _drop(self, peer: PeerRef) -> Held:
        """Forget ``peer``'s connection (pruned): drop its binding. A connection that was
        waiting for the dropped one's confirmation is bound now (nothing competes for the
        agent any more); returns what it sent meanwhile, to handle."""
        inbound = peer.inbound or b""
        self._pending.pop(inbound, None)
        self._last_used.pop(inbound, None)
        self._touched.discard(inbound)
        name = self._agents.pop(inbound, None)
        if name is None or self._home.get(name) != inbound:
            return []
        del self._home[name]
        for other, other_name in self._agents.items():  # another confirmed one becomes home
            if other_name == name:
                self._home[name] = other
                return []
        for waiting, pending in list(self._pending.items()):
            if pending.agent_name == name:  # the first becomes home; others wait for theirs
                return self._settle(waiting, confirmed=True)
        return []

    def admit(self, peer: PeerRef, agent_name: str) -> None:
        """Bind ``peer``'s connection to ``agent_name`` (what an accepted HELLO does)."""
        assert peer.inbound is not None
        self._agents[peer.inbound] = agent_name
        self._touched.add(peer.inbound)
        self._home.setdefault(agent_name, peer.inbound)

    def _settle(self, inbound: bytes, confirmed: bool) -> Held:
        pending = self._pending.pop(inbound)
        peer = PeerRef(inbound=inbound)
        if confirmed:
            self.admit(peer, pending.agent_name)
            self.channel.send(peer, self._hello_ack(pending.agent_name))
        else:
            self._refuse(
                peer,
                pending.agent_name,
                "the agent is bound to another connection and did not confirm this one "
                "(a replayed HELLO?)",
            )
        return [(peer, message) for message in pending.held]

    def _refuse(self, peer: PeerRef, agent_name: str, reason: str) -> None:
        self._on_refused()
        self._log.warn(
            str(peer), "hello", "refusing HELLO from %s (%s): %s", peer, agent_name, reason
        )
        self.channel.send(peer, messages.Abort(transfer_id="*", reason=f"hello: {reason}"))
