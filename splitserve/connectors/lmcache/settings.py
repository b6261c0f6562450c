"""The LMCache section of a deployment: validated settings and what they become (the
``LMCACHE_*`` environment of each prefill server, the remote tier's command line and the
``--kv-transfer-config`` of the composition).

Pure pydantic and strings, no LMCache or vLLM import, so ``splitserve up`` can refuse a bad
section before anything starts (the way every other section is checked) and a machine without
LMCache can still validate a file.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CONNECTOR_NAME = "SplitserveLMCacheConnector"
CONNECTOR_MODULE = "splitserve.connectors.lmcache.vllm_connector"


class LMCacheRemote(BaseModel):
    """LMCache's own cache server (``python -m lmcache.v1.server HOST PORT cpu``), the tier the
    prefill pool shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address the cache server binds to")
    port: int = Field(ge=1, le=65535, description="its TCP port")
    start: bool = Field(True, description="`splitserve up` starts it; false: it runs elsewhere")

    @property
    def url(self) -> str:
        return f"lm://{self.host}:{self.port}"

    def argv(self, python: str | None = None) -> list[str]:
        """The server's command line."""
        return [python or sys.executable, "-m", "lmcache.v1.server", self.host, str(self.port)]


class LMCacheSettings(BaseModel):
    """``lmcache:`` in a deployment file: prefix reuse across the prefill pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_size: int = Field(256, ge=16, le=8192, description="tokens per LMCache chunk")
    local_cpu_gb: float = Field(
        1.0, ge=0, description="GiB of each server's local CPU tier (0: none, remote only)"
    )
    remote: LMCacheRemote | None = Field(None, description="the shared tier; none: local only")
    hash_seed: int = Field(
        0,
        ge=0,
        le=4294967295,
        description="PYTHONHASHSEED of every server that shares a tier: LMCache 0.5.6 keys "
        "chunks with Python's hash when vLLM's is unavailable, salted per process otherwise",
    )

    @model_validator(mode="after")
    def _some_tier(self) -> LMCacheSettings:
        if self.local_cpu_gb == 0 and self.remote is None:
            raise ValueError("no tier: set local_cpu_gb above 0 or a remote")
        if self.chunk_size % 16:
            raise ValueError(f"chunk_size {self.chunk_size} is not a multiple of 16")
        return self

    def env(self) -> dict[str, str]:
        """LMCache's settings as its ``LMCACHE_*`` variables, for each server that uses it."""
        env = {
            "LMCACHE_CHUNK_SIZE": str(self.chunk_size),
            "LMCACHE_LOCAL_CPU": "True" if self.local_cpu_gb > 0 else "False",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": str(self.local_cpu_gb),
            "PYTHONHASHSEED": str(self.hash_seed),
        }
        if self.remote is not None:
            env["LMCACHE_REMOTE_URL"] = self.remote.url
            env["LMCACHE_REMOTE_SERDE"] = "naive"
        return env


def composed_kv_config(splitserve_config: dict[str, Any], role: Literal["kv_both"] = "kv_both"):
    """P's ``--kv-transfer-config``: vLLM's ``MultiConnector`` with LMCache first (its load is
    synchronous in ``start_load_kv``, so the prefix is in place before our connector and the
    forward touch it; docs/lmcache.md), then ``splitserve_config`` (a SplitserveConnector
    config)."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": CONNECTOR_NAME,
                    "kv_connector_module_path": CONNECTOR_MODULE,
                    "kv_role": role,
                },
                dict(splitserve_config),
            ]
        },
    }
