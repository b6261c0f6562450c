"""SplitserveConnector's settings: the ``kv_connector_extra_config`` of vLLM's kv-transfer-config.

Parsed once per process (API server, engine core, worker) from the dict vLLM holds; an unknown
key or a bad value stops start-up with an error that names it. Imports no vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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
    auth_key: str | None = Field(
        None, description="shared secret: every control message carries an HMAC under it"
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
    direction: Literal["auto", "push", "pull"] = Field(
        "auto",
        description="who copies the KV when this server is P: push (P WRITEs), pull (P "
        "ANNOUNCEs, D READs) or auto (pull on host memory over UCX cma, else push)",
    )
    ucx_backend_params: dict[str, str] = Field(
        default_factory=dict, description="extra UCX backend init parameters for NIXL"
    )


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
