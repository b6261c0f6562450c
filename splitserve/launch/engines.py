"""Command lines and environments that start stock engine servers.

Pure string building (no engine import), shared by the test harness, the benchmarks and
``splitserve up``, so that every place starts an engine the same proven way.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServerCommand:
    """argv plus the environment variables to add to the parent's."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


# Environment every vLLM server gets on a CPU machine (see docs/environment.md):
# - VLLM_CPU_KVCACHE_SPACE: GiB of KV cache; without it start-up fails a memory check.
# - HF_HUB_OFFLINE: there is no hub; models are local directories.
CPU_VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_server(
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    kv_transfer_config: Mapping[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    cpu: bool = True,
    cpu_core: int | None = None,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
) -> ServerCommand:
    """The OpenAI server of a stock vLLM.

    Started as ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console
    script of the CPU wheel is broken. On a CPU machine: fp32 (2.4x faster than bf16 without
    AVX512-BF16), eager mode, and ``cpu_core`` pins the server's OpenMP threads to one core so
    two servers side by side do not fight.
    """
    argv = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if cpu:
        argv += ["--dtype", "float32", "--enforce-eager"]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    argv += list(extra_args)
    full_env = dict(CPU_VLLM_ENV) if cpu else {}
    if cpu and cpu_core is not None:
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    full_env.update(env or {})
    return ServerCommand(argv=argv, env=full_env)
