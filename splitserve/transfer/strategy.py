"""Who copies the bytes of a layer: the sender (push, WRITE) or the receiver (pull, READ).

Engine-agnostic; consulted once per process at start-up (``transport_of``), and per peer
with the host identity the receiver sends in its HELLO (``transport_to``: a peer on another
host is reached over ``tcp`` or RDMA, never ``cma``). DESIGN.md measured it on host memory:
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
import functools
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
    if any(name in tls for name in _RDMA_TLS):
        return "rdma"
    return "tcp"


_RDMA_TLS = ("rc", "ud", "dc", "ib", "gdr")


@functools.cache
def host_identity() -> str:
    """Who shares memory with whom: the kernel's boot id and our network namespace's inode.

    Two processes with the same identity run on one kernel in one network namespace (``cma``
    and shared memory reach each other); any other pair is treated as separate hosts, which
    is what they are on a cluster and what the test bed's namespaces emulate (they share a
    kernel, so UCX would copy through ``cma`` between them unless told not to). Sent in the
    receiver's HELLO (``Hello.host``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "unknown-netns"
    return f"{boot}/{netns}"


def transport_to(peer_host: str | None, env: dict[str, str] | None = None) -> str:
    """The UCX transport that carries bytes to a peer whose ``host_identity`` is ``peer_host``.

    Same host (or a peer that did not say: a version-1 peer without the field): what
    ``transport_of`` reads from UCX_TLS. Another host: never ``cma`` (it copies between
    processes of one kernel): ``rdma`` when UCX_TLS names an RDMA transport, else ``tcp``."""
    if peer_host is None or peer_host == host_identity():
        return transport_of(env)
    tls = (env if env is not None else os.environ).get("UCX_TLS", "").lower()
    if any(name in tls for name in _RDMA_TLS):
        return "rdma"
    return "tcp"


def cross_host_tls_problem(env: dict[str, str] | None = None) -> str | None:
    """Why a UCX_TLS setting cannot reach another host (``None``: it can).

    A list of only same-host transports (``cma``, ``sm``/``shm``, ``self``, ``posix``,
    ``sysv``, ``xpmem``, ``knem``) leaves UCX nothing to reach a peer on another host."""
    tls = (env if env is not None else os.environ).get("UCX_TLS", "").lower().strip()
    if not tls or tls in ("all", "^cma"):
        return None
    names = [t.strip().lstrip("^") for t in tls.split(",") if t.strip()]
    if tls.startswith("^"):
        return None  # an exclusion list keeps the network transports
    local = {"cma", "sm", "shm", "self", "posix", "sysv", "xpmem", "knem", "mm"}
    if all(n in local for n in names):
        return f"UCX_TLS={tls} has no network transport (add tcp, or rc/ud/dc for RDMA)"
    return None


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
