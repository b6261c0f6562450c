"""Which prefill side channels a decode server may contact: an allowlist of hosts and networks.

Pure (no engine, no I/O), used where a request's ``kv_transfer_params`` name the prefill side
channel (the vLLM scheduler half; the SGLang backend's bootstrap address). Why: a request's
params come from whoever reaches D's HTTP port; without a check D would open a connection to
any address they name and hold the request's blocks while it waits (docs/security.md).

An entry is an IP address, a CIDR network (``10.0.0.0/8``, ``fd00::/8``) or a host name. A host
name matches only the same name (case-insensitive): names are not resolved here, so list the
names the proxy uses, or the networks their addresses are in.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class PeerAllowlist:
    networks: tuple[IPNetwork, ...]
    names: frozenset[str]

    @classmethod
    def parse(cls, entries: list[str]) -> PeerAllowlist:
        """Parse entries; raise ``ValueError`` naming the first one that is neither an address,
        a network nor a plausible host name."""
        networks: list[IPNetwork] = []
        names: set[str] = set()
        for entry in entries:
            text = entry.strip()
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            if not text or "/" in text or any(c.isspace() for c in text) or len(text) > 253:
                raise ValueError(f"allowed host {entry!r} is not an address, network or name")
            names.add(text.lower())
        return cls(tuple(networks), frozenset(names))

    def allows(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.lower() in self.names
        return any(address in network for network in self.networks)

    def __str__(self) -> str:
        return ", ".join([str(n) for n in self.networks] + sorted(self.names)) or "(nothing)"
