"""Settings of the proxy (``ProxyConfig``), validated at the edge: the CLI, a YAML file, or the
deployment launcher that embeds this model.

Pure pydantic; runs in whichever process loads the settings. Invariants: unknown keys are errors
(naming the key), every URL is an absolute ``http(s)://host:port`` base without a path, both pools
are non-empty, the vLLM concurrent flow knows every prefill server's connector side channel, and
the SGLang engine knows every prefill server's bootstrap port, and a proxy that listens beyond
loopback has a client key unless ``insecure`` says otherwise (docs/security.md).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic import model_validator as _model_validator

from splitserve.netutil import is_loopback
from splitserve.proxy.decide import DecisionSettings
from splitserve.proxy.discovery_config import DiscoverySettings, check_discovery

Engine = Literal["vllm", "sglang"]
Flow = Literal["concurrent", "sequential"]
Policy = Literal["round_robin", "least_outstanding", "power_of_two"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host:port URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must be a server base URL without a path (no /v1)")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ValueError(f"{url!r} has an invalid port") from e
    return f"{parts.scheme}://{parts.netloc}"


class _Endpoint(_Strict):
    url: str = Field(description="Base URL of the engine's OpenAI server, e.g. http://h:8000.")

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        return _base_url(v)

    @cached_property
    def host(self) -> str:
        # Cached (the model is frozen): read on every request of the concurrent flows.
        return urlsplit(self.url).hostname or ""


class PrefillEndpoint(_Endpoint):
    """A prefill server."""

    side_channel_port: int | None = Field(
        None, ge=1, le=65535, description="vLLM concurrent flow: P's connector side channel port."
    )
    side_channel_host: str | None = Field(
        None, description="Host of the side channel; defaults to the URL's host."
    )
    bootstrap_port: int | None = Field(
        None, ge=1, le=65535, description="SGLang: P's disaggregation bootstrap port."
    )
    bootstrap_host: str | None = Field(
        None, description="SGLang: host D reaches P's bootstrap server at; default the URL's host."
    )

    @property
    def side_host(self) -> str:
        return self.side_channel_host or self.host

    @property
    def bootstrap_at(self) -> str:
        return self.bootstrap_host or self.host


class DecodeEndpoint(_Endpoint):
    """A decode server."""


class RoutingSettings(_Strict):
    prefill: Policy = "least_outstanding"
    decode: Policy = "least_outstanding"
    prefix_affinity: bool = Field(
        False, description="Prefill pool: pick P by a consistent hash of the prompt's head."
    )
    prefix_chars: int = Field(256, ge=1, description="How much of the prompt the hash covers.")
    panic_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="When fewer than this fraction of a pool's servers are "
        "in rotation, route to every server not known to be down as well (Envoy's panic "
        "threshold); 0 turns it off (an empty pool answers 503).",
    )  # fmt: skip


class TimeoutSettings(_Strict):
    connect_s: float = Field(5.0, gt=0, description="TCP connect to an upstream server.")
    first_byte_s: float = Field(
        300.0, gt=0, description="Request sent to an upstream until its first body byte."
    )
    stream_idle_s: float = Field(120.0, gt=0, description="Longest gap between two chunks.")
    total_s: float = Field(1800.0, gt=0, description="Whole request, all attempts.")


class RetrySettings(_Strict):
    max_attempts: int = Field(
        3, ge=1, description="Pairs tried per request (only before any byte reached the client)."
    )


class HealthSettings(_Strict):
    interval_s: float = Field(2.0, gt=0)
    timeout_s: float = Field(5.0, gt=0, description="SGLang's /health runs a generation.")
    path: str = "/health"
    failures_to_eject: int = Field(
        2, ge=1, description="Failed checks in a row (refused, error status) that eject."
    )
    timeouts_to_eject: int = Field(
        3, ge=1, description="Checks in a row that time out before a server is ejected (a busy "
        "server answers late); a request to it that succeeds restarts the count.",
    )  # fmt: skip
    successes_to_readmit: int = Field(1, ge=1)
    eject_on_connect_error: bool = Field(
        True, description="Eject a server at once when a request cannot connect to it."
    )


class OutlierSettings(_Strict):
    """Ejection from real request outcomes (Envoy's outlier detection): docs/proxy.md, "Faults"."""

    enabled: bool = True
    consecutive_failures: int = Field(
        5, ge=1, description="Requests in a row that fail (5xx, timeout, broken connection) "
        "before the server is ejected.",
    )  # fmt: skip
    base_ejection_s: float = Field(
        10.0, gt=0, description="First ejection's length; the n-th in a row lasts n times it."
    )
    max_ejection_s: float = Field(300.0, gt=0, description="Longest ejection.")

    @_model_validator(mode="after")
    def _check_bounds(self) -> OutlierSettings:
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError("max_ejection_s: must be at least base_ejection_s")
        return self


class ClientTimeouts(_Strict):
    """How long a client may take over each phase of a request (docs/proxy.md, "Edge
    limits"): a client too slow is cut off (408, or closed when idle) and nothing else waits."""

    header_s: float = Field(
        30.0, gt=0, le=3600, description="A request's first byte to its full head (and a new "
        "connection's accept to its first byte).",
    )  # fmt: skip
    body_s: float = Field(
        120.0, gt=0, le=3600, description="The end of a request's head to the end of its body."
    )
    idle_keepalive_s: float = Field(
        75.0, gt=0, le=3600, description="An answered keep-alive connection's wait for the next "
        "request's first byte.",
    )  # fmt: skip


class ProxyConfig(_Strict):
    """Everything ``splitserve proxy`` needs."""

    engine: Engine = "vllm"
    flow: Flow = Field(
        None,  # type: ignore[assignment]  # filled in by _default_flow
        description="Default: sequential for vLLM (works with stock connectors), concurrent "
        "for SGLang (its only flow).",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    prefill: list[PrefillEndpoint] = Field(default_factory=list)
    decode: list[DecodeEndpoint] = Field(default_factory=list)
    discovery: DiscoverySettings | None = Field(
        None, description="Pools that change while serving: DNS names, a pool file reloaded on "
        "SIGHUP (docs/proxy.md, \"Dynamic pools\"); a pool they cover may list no server.",
    )  # fmt: skip
    routing: RoutingSettings = RoutingSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    retries: RetrySettings = RetrySettings()
    health: HealthSettings = HealthSettings()
    outlier: OutlierSettings = OutlierSettings()
    api_key: SecretStr | None = Field(None, description="Clients must send 'Bearer <api_key>'.")
    api_key_file: str | None = Field(
        None, description="A file holding api_key (read at start-up; '~' expanded), so that no "
        "key sits in the YAML.",
    )  # fmt: skip
    insecure: bool = Field(
        False, description="Allow a non-loopback host without a key (a trusted lab only).",
    )  # fmt: skip
    upstream_api_key: SecretStr | None = Field(None, description="Sent to the engine servers.")
    upstream_api_key_file: str | None = Field(
        None, description="A file holding upstream_api_key (read at start-up; '~' expanded)."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, le=1024 * 1024, description="A request's head, from its first byte."
    )
    client_timeouts: ClientTimeouts = ClientTimeouts()
    max_connections: int = Field(
        10_000, ge=1, description="Client connections per proxy process; past it a new one is "
        "answered 503 with Retry-After and closed.",
    )  # fmt: skip
    max_in_flight: int = Field(
        4096, ge=1, description="/v1 requests being served per proxy process; past it 503 with "
        "Retry-After: 1.",
    )  # fmt: skip
    workers: int = Field(
        1, ge=1, le=256, description="Proxy processes sharing the port (one event loop each)."
    )
    decide: DecisionSettings | None = Field(
        None, description="Per-request disaggregation (vLLM): a request whose prefill does not "
        "pay to move goes straight to a decode server (docs/proxy.md); off if null.",
    )  # fmt: skip
    first_token_from_prefill: bool | None = Field(
        None,  # resolved to a bool by _check_flow (left unset, so a CLI --flow still decides)
        description="vLLM concurrent flow (SplitserveConnector): the client's first token is "
        "the one P samples, streamed as soon as P answers; D continues from it. Default: on "
        "for the vLLM concurrent flow, off otherwise (where it is not supported).",
    )

    @_model_validator(mode="before")
    @classmethod
    def _default_flow(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("flow") is None:
            data = {
                **data,
                "flow": "concurrent" if data.get("engine") == "sglang" else "sequential",
            }
        return data

    @_model_validator(mode="after")
    def _check_flow(self) -> ProxyConfig:
        for pool in ("prefill", "decode"):
            if not getattr(self, pool) and not (self.discovery and self.discovery.covers(pool)):
                raise ValueError(
                    f"{pool}: List should have at least 1 item (a server URL), or give "
                    f"discovery.{pool} (a DNS name) or discovery.pool_file"
                )
        if self.discovery is not None:
            check_discovery(self.engine, self.flow, self.discovery)
        if self.upstream_api_key is not None and self.upstream_api_key_file is not None:
            raise ValueError("upstream_api_key_file: give upstream_api_key or its file, not both")
        if self.engine == "vllm" and self.flow == "concurrent":
            for i, p in enumerate(self.prefill):
                if p.side_channel_port is None:
                    raise ValueError(
                        f"prefill.{i}.side_channel_port: required by the vLLM concurrent flow "
                        f"({p.url})"
                    )
        if self.engine == "sglang":
            if self.flow != "concurrent":
                raise ValueError("flow: SGLang only has the concurrent flow")
            for i, p in enumerate(self.prefill):
                if p.bootstrap_port is None:
                    raise ValueError(f"prefill.{i}.bootstrap_port: required by SGLang ({p.url})")
        supported = (self.engine, self.flow) == ("vllm", "concurrent")
        if self.first_token_from_prefill is None:
            object.__setattr__(self, "first_token_from_prefill", supported)  # not "set"
        if self.first_token_from_prefill and not supported:
            raise ValueError(
                "first_token_from_prefill: only the vLLM concurrent flow (SplitserveConnector) "
                f"supports it, not {self.engine} {self.flow}"
            )
        if self.decide is not None and self.engine == "sglang":
            raise ValueError(
                "decide: SGLang's decode servers cannot prefill (they only receive KV), so "
                "every request must go through a prefill server; remove decide"
            )
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("api_key_file: give api_key or api_key_file, not both")
        keyless = self.api_key is None and self.api_key_file is None
        if keyless and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"host: {self.host or '(every address)'} opens the proxy to the network "
                "without a key: set api_key_file (or SPLITSERVE_PROXY_API_KEY for `splitserve "
                "proxy`), bind 127.0.0.1, or set insecure: true (a trusted lab only)"
            )
        if self.workers > 1 and self.port == 0:
            raise ValueError("port: several workers need a fixed port (0 picks one per worker)")
        for pool in ("prefill", "decode"):
            urls = [e.url for e in getattr(self, pool)]
            dup = sorted({u for u in urls if urls.count(u) > 1})
            if dup:
                raise ValueError(f"{pool}: duplicate server URL(s) {', '.join(dup)}")
        return self

    def client_key(self) -> bytes | None:
        """The key clients must send: ``api_key``, or ``api_key_file``'s content (surrounding
        whitespace dropped); None without either. Raises ``ConfigError`` naming the file when
        it cannot be read or is empty."""
        if self.api_key is not None:
            return self.api_key.get_secret_value().encode()
        if self.api_key_file is None:
            return None
        path = Path(os.path.expanduser(self.api_key_file))
        try:
            key = path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"api_key_file: cannot read {path}: {e.strerror or e}") from None
        if not key:
            raise ConfigError(f"api_key_file: {path} is empty")
        return key

    def upstream_key(self) -> str | None:
        """The key sent to the engines: ``upstream_api_key`` or ``upstream_api_key_file``'s
        content (``ConfigError`` naming the file when it cannot be read or is empty)."""
        if self.upstream_api_key is not None:
            return self.upstream_api_key.get_secret_value()
        if self.upstream_api_key_file is None:
            return None
        path = Path(os.path.expanduser(self.upstream_api_key_file))
        try:
            key = path.read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"upstream_api_key_file: cannot read {path}: {e.strerror or e}"
            ) from None
        if not key:
            raise ConfigError(f"upstream_api_key_file: {path} is empty")
        return key


class ConfigError(ValueError):
    """Settings that cannot start a proxy; the message names the field."""


def describe_validation_error(e: ValidationError) -> str:
    """One line per problem: ``field.path: message``."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "\n".join(lines)


def build_config(data: dict[str, Any]) -> ProxyConfig:
    """Validate a settings mapping; raise ``ConfigError`` naming each bad field."""
    try:
        return ProxyConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e)) from None


def load_config(path: str | Path) -> ProxyConfig:
    """Read and validate a YAML file. A top-level ``proxy:`` key is accepted (a deployment)."""
    return build_config(read_config_data(path))


def read_config_data(path: str | Path) -> dict[str, Any]:
    """A YAML file's settings, not validated yet (the CLI merges its flags in first)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if isinstance(data, dict) and set(data) == {"proxy"}:
        data = data["proxy"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    return data
