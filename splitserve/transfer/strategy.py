"""Who copies the bytes of a layer: the sender (push, WRITE) or the receiver (pull, READ).

Engine-agnostic; consulted once per process at start-up. DESIGN.md measured it on host memory:
over ``cma`` the initiator's CPU does the copy, so a pull by D costs P nothing while a push costs
P a share of its compute; over ``tcp`` a push costs P less than a pull; over RDMA and device
memory the NIC copies, so both cost the same and push needs one message less (the figures are
in DESIGN.md and docs/benchmarks.md).

The protocol, states and leases are the same for both directions. The sender's direction
rules a transfer: a pushing sender WRITEs each layer's blocks and sends DONE on its last
WRITE; a pulling sender ANNOUNCEs them on the side channel (``Announce``, in the thread that
would have posted the WRITE), sends DONE after the last ANNOUNCE, and frees once D says
``Pulled``. It tells the receiver in its HELLO_ACK, so one receiver serves both. The
difference lives in the direction strategies: ``send_push`` / ``send_pull`` under ``KVSender``
and ``recv_push`` / ``recv_pull`` under ``KVReceiver``.
"""

from __future__ import annotations

import enum
import os


class Direction(enum.Enum):
    PUSH = "push"  # P WRITEs each layer's blocks into D
    PULL = "pull"  # P ANNOUNCEs each layer's blocks, D READs them


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


def effective(transport: str, memory: str, setting: str = "auto") -> Direction:
    """The direction the sender uses: ``setting`` ("push" / "pull", the connector's
    ``direction`` key) when given, else the preferred one."""
    if setting != "auto":
        return Direction(setting)
    return choose(transport, memory)
