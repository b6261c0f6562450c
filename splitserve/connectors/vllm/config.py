"""SplitserveConnector's settings: the ``kv_connector_extra_config`` of vLLM's kv-transfer-config.

Parsed once per process (API server, engine core, worker) from the dict vLLM holds; an unknown
key or a bad value stops start-up with an error that names it. Imports no vLLM.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitserve.netutil import is_loopback
from splitserve.transfer.agent import NixlBackend
from splitserve.transfer.auth import KEY_ENV, KEY_FILE_ENV, AuthKeyError, load_key
from splitserve.transfer.peers import PeerAllowlist


class ConnectorConfigError(ValueError):
    """The connector's extra config is invalid; the message names the offending key."""


class SplitserveConnectorConfig(BaseModel):
    """``--kv-transfer-config '{"kv_connector": "SplitserveConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {...}}'``: the keys below, nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    side_channel_host: str = Field(
        "127.0.0.1", description="address the control side channel binds to (P side)"
    )
    side_channel_port: int = Field(
        ge=1,
        le=65535,
        description="port of the control side channel; the proxy must know it, so it is fixed",
    )
    auth_key_file: str | None = Field(
        None,
        description="file holding the deployment's shared key (mode 0600; `splitserve up` "
        f"writes one); else ${KEY_FILE_ENV} names the file, else ${KEY_ENV} holds the key. "
        "With a key, the side channel admits only peers that hold it (docs/security.md)",
    )
    insecure: bool = Field(
        False,
        description="allow a side channel without a key on a non-loopback address: anyone who "
        "reaches the port is a peer. Only for a trusted, isolated lab network",
    )
    allowed_prefill_hosts: list[str] | None = Field(
        None,
        description="D connects only to prefill side channels on these hosts or CIDRs; a "
        "request naming another remote_host is served without a transfer. Default: any host "
        "(with a key, only peers that hold it answer)",
    )
    lease_s: float = Field(
        30.0, gt=0, description="P frees a finished request's blocks if D has not registered"
    )
    done_timeout_s: float = Field(
        60.0, gt=0, description="D fails the load if DONE has not arrived this long after REGISTER"
    )
    abort_ack_timeout_s: float = Field(
        5.0, gt=0, description="after an ABORT, D waits this long for P's ABORT_ACK before freeing"
    )
    peer_liveness_s: float = Field(
        5.0,
        ge=0.5,
        le=300.0,
        description="a side-channel peer that does not complete a connection and its handshake, "
        "or whose heartbeats go unanswered, this long is dropped and its transfers fail; raise "
        "it on hosts whose schedulers can stall a process for seconds (it bounds every "
        "failure of an unresponsive peer)",
    )
    direction: Literal["auto", "push", "pull"] = Field(
        "auto",
        description="who copies the KV when this server is P: push (P WRITEs), pull (P "
        "ANNOUNCEs, D READs) or auto (per receiver: pull on host memory over UCX cma, i.e. "
        "a receiver on this host, else push)",
    )
    prefill_tp_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="tensor parallel size of the prefill servers this server (as D) loads from "
        "when the request's params do not say it (the concurrent flow); default: this server's "
        "own. splitserve up sets it from the deployment",
    )
    decode_tp_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="tensor parallel size of the decode servers this server (as P) feeds: a "
        "multiple of its own (each rank then feeds decode_tp_size / tp ranks); default: this "
        "server's own. splitserve up sets it from the deployment",
    )
    ucx_backend_params: dict[str, str] = Field(
        default_factory=dict, description="extra UCX backend init parameters for NIXL"
    )
    nixl_backends: list[NixlBackend] | None = Field(
        None,
        description="NIXL backends to create, in order of preference, each "
        '{"name": "UCX", "params": {...}}; default UCX alone. One that does not load '
        "stops start-up with the reason",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "auth_key" in data:
            raise ValueError(
                "auth_key: a key in --kv-transfer-config shows in `ps` and in vLLM's start-up "
                f"log; put it in a file (auth_key_file, mode 0600) or in ${KEY_ENV}"
            )
        return data

    @model_validator(mode="after")
    def _allowlist_parses(self) -> SplitserveConnectorConfig:
        if self.allowed_prefill_hosts is not None:
            PeerAllowlist.parse(self.allowed_prefill_hosts)
        return self

    @cached_property
    def allowlist(self) -> PeerAllowlist | None:
        hosts = self.allowed_prefill_hosts
        return None if hosts is None else PeerAllowlist.parse(hosts)

    def load_auth_key(self) -> bytes | None:
        """The shared key (file, then environment), checked against the bind address: a side
        channel open to the network without a key is refused unless ``insecure``."""
        try:
            key = load_key(self.auth_key_file)
        except AuthKeyError as exc:
            raise ConnectorConfigError(f"SplitserveConnector: {exc}") from None
        if key is None and not self.insecure and not is_loopback(self.side_channel_host):
            raise ConnectorConfigError(
                f"SplitserveConnector: side_channel_host {self.side_channel_host!r} is reachable "
                "from the network but no auth key is set: anyone who reaches the port could "
                "read and steer KV transfers. Set one with auth_key_file (a 0600 file; "
                f"`splitserve keygen FILE` writes one) or ${KEY_FILE_ENV} / ${KEY_ENV}, the "
                "same on every prefill and decode server; or, on an isolated lab network only, "
                'set "insecure": true'
            )
        return key


def parse_connector_config(extra: dict[str, Any] | None) -> SplitserveConnectorConfig:
    """Validate the extra config; raise ``ConnectorConfigError`` naming every bad key."""
    try:
        return SplitserveConnectorConfig.model_validate(extra or {})
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            key = ".".join(str(part) for part in error["loc"]) or "(root)"
            if error["type"] == "extra_forbidden":
                problems.append(f"unknown key {key!r}")
            else:
                problems.append(f"{key!r}: {error['msg']}")
        raise ConnectorConfigError(
            "invalid SplitserveConnector kv_connector_extra_config: " + "; ".join(problems)
        ) from None
