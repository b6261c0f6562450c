"""Which direction a sender (P) uses towards each receiver, and what it says about far ones.

Engine-agnostic; owned by ``sender.KVSender``, asked at every receiver's HELLO (before the
HELLO_ACK that tells the receiver the direction) and for every transfer's strategy. With
``per_peer`` (the connector's ``direction: auto``) each receiver gets the direction of the
transport that reaches it (``strategy.choose``: pull for host memory over ``cma``, i.e. a
receiver on our host by the ``host`` its HELLO carries; push otherwise, and push whenever our
layout has aux rows, which only a WRITE carries). Without it, every receiver gets the default.

Why here and not in the sender: this is the one piece of the sender's state that is about
receivers rather than transfers; kept apart, the sender is the transfer state machine alone.

Invariants:
- ``direction_of`` answers what the receiver was told in its HELLO_ACK (the default until its
  HELLO was seen).
- Bounded: at most ``MAX_REMEMBERED`` receivers are remembered; past that, names that are no
  longer loaded (``loaded()``) are forgotten first; each far receiver is warned about once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from splitserve.transfer import messages, strategy
from splitserve.transfer.strategy import Direction

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 4096


class ReceiverDirections:
    """The direction per receiver agent (see module docstring)."""

    def __init__(
        self,
        default: Direction,
        *,
        per_peer: bool,
        memory: str,
        has_aux: bool,
        loaded: Callable[[], Collection[str]],
    ) -> None:
        self.default = default
        self.per_peer = per_peer
        self._memory = memory
        self._has_aux = has_aux
        self._loaded = loaded  # agent names still referred to (loaded or in use)
        self._chosen: dict[str, Direction] = {}  # agent -> told in its HELLO_ACK
        self._warned: set[str] = set()  # receivers told about (cross-host pull)

    def direction_of(self, agent_name: str) -> Direction:
        """The direction the receiver ``agent_name`` was told in its HELLO_ACK."""
        return self._chosen.get(agent_name, self.default)

    def on_hello(self, hello: messages.Hello) -> None:
        """A receiver's HELLO: choose its direction (``per_peer``) and, for a receiver on
        another host, say once what will not work with it (a UCX_TLS without a network
        transport) or is the same-host choice (a pull chosen for ``cma``)."""
        transport = strategy.transport_to(hello.host)
        if self.per_peer:
            self._choose(hello.agent_name, transport)
        if transport == "cma" or hello.agent_name in self._warned:
            return
        if len(self._warned) < MAX_REMEMBERED:  # bounded: a peer may send many names
            self._warned.add(hello.agent_name)
        problem = strategy.cross_host_tls_problem()
        if problem:
            logger.warning(
                "receiver %s is on another host: %s (docs/deployment.md)", hello.agent_name, problem
            )
        if self.direction_of(hello.agent_name) is Direction.PULL:
            logger.warning(
                "receiver %s is on another host (reached over %s) but this sender pulls, "
                "the direction for same-host cma; set direction=push for cross-host "
                "deployments (docs/deployment.md)",
                hello.agent_name,
                transport,
            )

    def _choose(self, agent_name: str, transport: str) -> None:
        direction = strategy.choose(transport, self._memory)
        if direction is Direction.PULL and self._has_aux:
            direction = Direction.PUSH
        if len(self._chosen) >= MAX_REMEMBERED and agent_name not in self._chosen:
            loaded = set(self._loaded())
            self._chosen = {name: d for name, d in self._chosen.items() if name in loaded}
        if self._chosen.get(agent_name) is not direction:
            logger.info("receiver %s: %s over %s", agent_name, direction.value, transport)
        self._chosen[agent_name] = direction
