"""This machine among a deployment's hosts: which host's share of a deployment placed on hosts
(``PoolSettings.hosts``, ``proxy.host``) one ``splitserve up`` runs.

Runs in the ``splitserve up`` process, before anything starts (docs/deployment.md, "Across
hosts"). Split from ``deployment.py`` so that the one decision that reads this machine's
network interfaces sits apart from turning a deployment into servers; ``deployment.py`` starts
the share this module picked.

Invariant: ``local_host`` answers one host, or raises ``DeploymentError`` saying why there is no
one answer: ``up`` never guesses.
"""

from __future__ import annotations

import contextlib
import ipaddress

import psutil

from splitserve.config import Deployment, DeploymentError


def local_addresses() -> set[str]:
    """The IP addresses of this machine's interfaces (of the calling network namespace)."""
    found = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            with contextlib.suppress(ValueError):
                found.add(str(ipaddress.ip_address(a.address.split("%", 1)[0])))
    return found


def local_host(dep: Deployment, requested: str | None = None) -> str | None:
    """The host whose share of ``dep`` this ``up`` runs: ``requested`` (``--host``), else the
    one of the deployment's hosts that is an address of this machine; None when the deployment
    is not placed on hosts (everything on loopback). Raises ``DeploymentError`` saying why
    when there is no one answer."""
    hosts = dep.host_addresses()
    if not dep.placed:
        if requested is not None:
            raise DeploymentError(
                f"--host {requested}: this deployment places nothing on hosts (prefill.hosts, "
                "decode.hosts, proxy.host); start it without --host"
            )
        return None
    if requested is not None:
        try:
            wanted = str(ipaddress.ip_address(requested))
        except ValueError:
            raise DeploymentError(f"--host: {requested!r} is not an IP address") from None
        for h in hosts:
            if str(ipaddress.ip_address(h)) == wanted:
                return h
        raise DeploymentError(
            f"--host {requested}: nothing of this deployment is placed there; its hosts: "
            + ", ".join(hosts)
        )
    mine = local_addresses()
    matches = [h for h in hosts if str(ipaddress.ip_address(h)) in mine]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise DeploymentError(
            f"none of this deployment's hosts ({', '.join(hosts)}) is an address of this "
            f"machine ({', '.join(sorted(mine)) or 'none'}); give --host ADDR"
        )
    raise DeploymentError(
        f"several of this deployment's hosts are addresses of this machine "
        f"({', '.join(matches)}): give --host ADDR, one `up` per host"
    )
