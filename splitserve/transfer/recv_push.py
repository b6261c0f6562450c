"""Push, D's side: P WRITEs into D's registered blocks; D posts nothing and waits for DONE.

Engine-agnostic; runs in the thread that polls ``KVReceiver``. DONE rides as a NIXL
notification on P's last WRITE, so it arrives after the data; D reads it from its agent's
notifications. A DONE is accepted only with a valid MAC (when a key is set), for an expected
transfer, from the NIXL agent P named in its HELLO_ACK, and from a P that did not offer pull
(a pulling P sends DONE on the side channel); anything else is dropped with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from splitserve.transfer import messages
from splitserve.transfer.agent import KVAgent
from splitserve.transfer.incoming import Incoming, Ready, ReceiverStats, done_problem
from splitserve.transfer.side_channel import PeerRef, SideChannel
from splitserve.transfer.state import TransferState

logger = logging.getLogger(__name__)


class PushReceiving:
    """DONE from P's final WRITE (see module docstring)."""

    def __init__(
        self,
        agent: KVAgent,
        channel: SideChannel,
        stats: ReceiverStats,
        *,
        transfers: dict[str, Incoming],
        sender_agents: dict[PeerRef, str],
        pulling: Callable[[PeerRef], bool],
        fail: Callable[[Incoming, str], None],
        ready: Callable[[Incoming], None],
    ) -> None:
        self.agent = agent
        self.channel = channel  # for its auth key: a DONE's MAC is checked as a message's
        self.stats = stats
        self._transfers = transfers  # the receiver's, read here
        self._sender_agents = sender_agents  # the receiver's: P's NIXL agent per side channel
        self._pulling = pulling
        self._fail = fail  # settles at once: nothing of P's writes any more
        self._ready = ready

    def receive(self) -> None:
        """Read the agent's new notifications (this also drives NIXL progress)."""
        for sender_agent, notifs in self.agent.notifications().items():
            name = sender_agent.decode() if isinstance(sender_agent, bytes) else sender_agent
            for notif in notifs:
                self._on_notification(name, notif)

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
        if self._pulling(inc.peer):  # a pulling P sends DONE on the side channel
            self.stats.messages_rejected += 1
            logger.warning("receiver: DONE notification for pulled %s", message.transfer_id)
            return
        if inc.record.state is not TransferState.REGISTERED:
            return  # already timed out or aborted: the held outcome stands
        problem = done_problem(inc, message)
        if problem is not None:
            self._fail(inc, problem)
            return
        inc.ready = Ready(message.prefill_end_wall, message.first_token)
        self._ready(inc)
