"""Small local-network helpers: free ports and a plain HTTP readiness check.

Neutral and low in the stack (standard library only): the launcher, the proxy's CLI, the planner's
NIXL probe, the tests and the benchmarks all choose ports and probe servers this one way, and none
of them has to import another's module (the launcher in particular) to do so.

A port that was free when chosen can be taken before it is bound; callers that start servers
retry on a fresh port (``splitserve.launch.group``).
"""

from __future__ import annotations

import ipaddress
import random
import socket
import urllib.error
import urllib.request

# Where chosen ports come from: below the kernel's ephemeral range (the local ports it gives
# outgoing connections, ``ip_local_port_range``), so that a port chosen here cannot be taken by
# some process's outgoing connection between choosing and binding it (a kernel-chosen port, from
# binding port 0, lies inside that range: a busy machine's HTTP and UCX clients took such ports
# before the servers chosen them could bind, seen in the test suite as "Address already in use").
_LOW_PORT = 10000
# SGLang picks the port its scheduler binds later (``nccl_port``) the same way, from
# 22000-29999 (``sglang.srt.utils.network.get_free_port_below_ephemeral``): ports chosen here
# stay out of that span too, so that neither can choose a port the other chose and has not
# bound yet.
_SGLANG_SPAN = range(22000, 30000)
_EPHEMERAL_FALLBACK = (32768, 60999)
_PICK_ATTEMPTS = 500
_HIGHEST_BASE = 65000 - 64  # room for a server's consecutive ports (ranks, pools)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_FALLBACK


def _candidate_ports() -> range:
    """The ports to pick from: below the ephemeral range and SGLang's span when that leaves
    room (it does with Linux's default range, 32768-60999), else below the ephemeral range,
    else above it, short of the top (a chosen port is often
    a base that consecutive ports follow, and settings cap bases at 65000)."""
    low, high = _ephemeral_range()
    below = range(_LOW_PORT, min(low, _SGLANG_SPAN.start))
    for span in (below, range(_LOW_PORT, low), range(high + 1, _HIGHEST_BASE)):
        if len(span) >= 1000:
            return span
    return range(_LOW_PORT, _HIGHEST_BASE)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, outside the kernel's ephemeral range."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (held open together while chosen, so they differ), outside the
    kernel's ephemeral range."""
    rng = random.Random()
    span = _candidate_ports()
    socks: list[socket.socket] = []
    limit = _PICK_ATTEMPTS + 4 * n
    tries = 0
    try:
        while len(socks) < n:
            if tries == limit:
                raise RuntimeError(f"no {n} free ports on {host} in {limit} tries")
            tries += 1
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, rng.choice(span)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port with ``count`` consecutive free ports (a tensor-parallel server's side
    channels: rank r binds base + r), outside the kernel's ephemeral range. ``count`` 1 is
    ``free_port``."""
    if count <= 1:
        return free_port(host)
    rng = random.Random()
    span = _candidate_ports()
    for _ in range(attempts):
        base = rng.randrange(span.start, span.stop - count)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {count} free ports on {host} in {attempts} tries")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``host:port`` cannot be bound right now (someone listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses: only this machine's processes reach a
    socket bound there (the one case a side channel or proxy may run without a key)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost, or "" (every address)
