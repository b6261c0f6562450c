"""Who copies the bytes of a layer: the sender (push, WRITE) or the receiver (pull, READ).

Engine-agnostic; consulted once per process at start-up. DESIGN.md measured on host memory:
over ``cma`` the initiator's CPU does the copy, so a pull by D costs P nothing while a push costs
P about 15% of its compute; over ``tcp`` a push costs P less than a pull; over RDMA and device
memory the NIC copies, so both cost the same and push needs one message less.

The protocol, states and messages are the same for both directions (``Announce`` is the pull
counterpart of a per-layer WRITE). This version implements the push data path only: ``choose``
reports the direction the design prefers and ``effective`` the one the sender will use, so the
difference stays visible in logs and docs instead of hidden in a second copy of the code.
"""

from __future__ import annotations

import enum
import os


class Direction(enum.Enum):
    PUSH = "push"  # P WRITEs each layer's blocks into D
    PULL = "pull"  # P ANNOUNCEs each layer's blocks, D READs them


IMPLEMENTED = frozenset({Direction.PUSH})


def transport_of(env: dict[str, str] | None = None) -> str:
    """The UCX transport the data path will most likely use: ``cma`` (host-memory default),
    ``tcp`` when UCX_TLS restricts to it, ``rdma`` when UCX_TLS names an RDMA transport."""
    tls = (env if env is not None else os.environ).get("UCX_TLS", "").lower()
    if not tls or "cma" in tls or tls == "all":
        return "cma"
    if any(name in tls for name in ("rc", "ud", "dc", "ib", "gdr")):
        return "rdma"
    return "tcp"


def choose(transport: str, memory: str) -> Direction:
    """The direction DESIGN.md prefers for a transport and memory kind."""
    if memory == "DRAM" and transport == "cma":
        return Direction.PULL
    return Direction.PUSH


def effective(transport: str, memory: str) -> Direction:
    """The direction the sender uses: the preferred one if implemented, else push."""
    preferred = choose(transport, memory)
    return preferred if preferred in IMPLEMENTED else Direction.PUSH
