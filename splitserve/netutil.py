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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (held open together while chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A base port with ``count`` consecutive free ports (a tensor-parallel server's side
    channels: rank r binds base + r). ``count`` 1 is ``free_port``."""
    if count <= 1:
        return free_port(host)
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 60000 - count)
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
