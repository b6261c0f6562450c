"""Settings of dynamic pools (``ProxyConfig.discovery``): a pool given as a DNS name, or a static
pool file the proxy reads again on SIGHUP (``splitserve.proxy.discovery`` does the work).

Pure pydantic; runs wherever the proxy's settings are validated. Invariants: an ``A`` name has a
port (every address serves on it: a Kubernetes headless Service), an ``SRV`` name carries its
ports in its records; a pool file holds the same endpoint entries as the proxy's own
``prefill`` / ``decode`` lists and is checked by the same rules (``check_endpoints``;
the file itself is read by ``splitserve.proxy.discovery``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DnsPool(_Strict):
    """One pool's servers found by DNS: every address the name resolves to is a server."""

    name: str = Field(
        min_length=1,
        description="The DNS name, e.g. a headless Service 'splitserve-decode' (resolved with "
        "the resolver's search domains) or a fully qualified name.",
    )
    record: Literal["A", "SRV"] = Field(
        "A", description="'A': A and AAAA records, every server on 'port'; 'SRV': the records "
        "name each server's host and port.",
    )  # fmt: skip
    port: int | None = Field(None, ge=1, le=65535, description="HTTP port (A records).")
    scheme: Literal["http", "https"] = "http"
    side_channel_port: int | None = Field(
        None, ge=1, le=65535, description="Prefill, vLLM concurrent flow: P's side channel port "
        "(the same on every server of the name).",
    )  # fmt: skip
    bootstrap_port: int | None = Field(
        None, ge=1, le=65535, description="Prefill, SGLang: P's bootstrap port."
    )

    @model_validator(mode="after")
    def _port(self) -> DnsPool:
        if self.record == "A" and self.port is None:
            raise ValueError(f"port: required for the A records of {self.name!r}")
        if self.record == "SRV" and self.port is not None:
            raise ValueError("port: an SRV name's records carry the ports; remove it")
        return self

    def endpoint(self, host: str, port: int | None = None) -> dict[str, Any]:
        """The endpoint settings of one resolved address (a ``PrefillEndpoint`` mapping)."""
        shown = f"[{host}]" if ":" in host else host
        entry: dict[str, Any] = {"url": f"{self.scheme}://{shown}:{port or self.port}"}
        if self.side_channel_port is not None:
            entry["side_channel_port"] = self.side_channel_port
        if self.bootstrap_port is not None:
            entry["bootstrap_port"] = self.bootstrap_port
        return entry


class DiscoverySettings(_Strict):
    """Pools that change while the proxy serves (docs/proxy.md, "Dynamic pools")."""

    prefill: DnsPool | None = None
    decode: DnsPool | None = None
    ttl_s: float = Field(
        5.0, gt=0, le=3600, description="How long an answer is used: the names are resolved "
        "again this often.",
    )  # fmt: skip
    timeout_s: float = Field(2.0, gt=0, le=60, description="One resolution's limit.")
    nameservers: list[str] | None = Field(
        None, description="'host' or 'host:port' of the DNS servers to ask; default: the "
        "system's (/etc/resolv.conf).",
    )  # fmt: skip
    pool_file: str | None = Field(
        None, description="A YAML file with 'prefill' and 'decode' server lists, read at start "
        "and again on SIGHUP.",
    )  # fmt: skip
    drain_timeout_s: float | None = Field(
        None, gt=0, description="A removed server is dropped when its last request ends, or "
        "after this long (default: timeouts.total_s, the longest a request may take).",
    )  # fmt: skip

    @model_validator(mode="after")
    def _servers(self) -> DiscoverySettings:
        for addr in self.nameservers or []:
            parse_nameserver(addr)
        return self

    def covers(self, pool: str) -> bool:
        """Whether this pool may start empty (its servers come from DNS or the pool file)."""
        return getattr(self, pool) is not None or self.pool_file is not None


def parse_nameserver(addr: str) -> tuple[str, int]:
    """``host`` or ``host:port`` (``[v6]:port``) -> (host, port), port 53 by default."""
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif addr.count(":") == 1:
        host, port = addr.split(":")
    else:
        host, port = addr, "53"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"nameservers: {addr!r} is not 'host' or 'host:port'")
    return host, int(port)


def check_endpoints(engine: str, flow: str, prefill: list[Any], where: str = "prefill") -> None:
    """What the flow needs of every prefill server (side channel / bootstrap port); raises
    ``ValueError`` naming the entry."""
    for i, p in enumerate(prefill):
        if engine == "vllm" and flow == "concurrent" and p.side_channel_port is None:
            raise ValueError(f"{where}.{i}.side_channel_port: required by the vLLM concurrent flow")
        if engine == "sglang" and p.bootstrap_port is None:
            raise ValueError(f"{where}.{i}.bootstrap_port: required by SGLang")


def check_discovery(engine: str, flow: str, discovery: DiscoverySettings) -> None:
    """The DNS prefill pool against the flow (called by ``ProxyConfig``'s validation)."""
    p = discovery.prefill
    if p is None:
        return
    if engine == "vllm" and flow == "concurrent" and p.side_channel_port is None:
        raise ValueError(
            "discovery.prefill.side_channel_port: required by the vLLM concurrent flow"
        )
    if engine == "sglang" and p.bootstrap_port is None:
        raise ValueError("discovery.prefill.bootstrap_port: required by SGLang")
