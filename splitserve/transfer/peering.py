"""Which receiver a sender's connection speaks for: HELLO admission on P's side.

Engine-agnostic; used by ``KVSender`` in the thread that drives it. A receiver's HELLO carries
its NIXL metadata and KV layout; P admits it only on the connection whose ZMQ routing id is
derived from the agent's name and the address it dialled (``messages.routing_id``), only if the
metadata inside names that same agent, and only if its layout is compatible with ours (checked
before anything is allocated for it: ``KVLayout.incompatibility``). From then on that
connection may register transfers for that agent, and no other. docs/security.md says why.

Invariants:
- ``agent_of`` answers an agent only for a connection whose HELLO was admitted.
- A refused HELLO is answered with ``Abort(transfer_id="*")`` naming the reason, counted, and
  logged once per peer (a hostile peer cannot flood the log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.auth import PeerLog
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import PeerRef, SideChannel

logger = logging.getLogger(__name__)


class PeerAdmission:
    """The receivers P has admitted, by connection (see module docstring)."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        hello_ack: Callable[[], messages.HelloAck],
        on_refused: Callable[[], None],
    ) -> None:
        self.agent = agent
        self.channel = channel
        self._hello_ack = hello_ack
        self._on_refused = on_refused
        self._agents: dict[bytes, str] = {}  # ROUTER identity -> admitted agent name
        self._log = PeerLog(logger)

    def agent_of(self, peer: PeerRef) -> str | None:
        """The agent ``peer``'s connection was admitted for (None: no valid HELLO on it)."""
        return self._agents.get(peer.inbound or b"")

    def on_hello(self, peer: PeerRef, hello: messages.Hello) -> None:
        if peer.inbound is None or peer.inbound != messages.routing_id(
            hello.agent_name, hello.target
        ):
            self._refuse(peer, hello, "the connection does not belong to this agent")
            return
        try:
            layout = KVLayout.model_validate(hello.layout)
            name = self.agent.add_peer(hello.agent_metadata, layout)
        except Exception as exc:  # bad metadata or layout: refuse this peer, keep serving
            self._refuse(peer, hello, str(exc)[:300])
            return
        if name != hello.agent_name:
            self._refuse(peer, hello, f"its metadata names agent {name[:128]!r}")
            return
        self.admit(peer, name)
        self.channel.send(peer, self._hello_ack())

    def admit(self, peer: PeerRef, agent_name: str) -> None:
        """Bind ``peer``'s connection to ``agent_name`` (what an accepted HELLO does)."""
        assert peer.inbound is not None
        self._agents[peer.inbound] = agent_name

    def _refuse(self, peer: PeerRef, hello: messages.Hello, reason: str) -> None:
        self._on_refused()
        self._log.warn(
            str(peer), "hello", "refusing HELLO from %s (%s): %s", peer, hello.agent_name, reason
        )
        self.channel.send(peer, messages.Abort(transfer_id="*", reason=f"hello: {reason}"))
