"""Command lines and environments that start stock engine servers (vLLM, SGLang, SGLang's router).

Pure string building (no engine import), shared by the test harness, the benchmarks and
``splitserve up``, so that every place starts an engine the same proven way.

SGLang on a CPU (docs/sglang.md, "Serving on a CPU"): ``--device cpu --attention-backend
torch_native --sampling-backend pytorch --disable-cuda-graph``, fp32, a fixed
``--max-total-tokens``; a PD prefill server needs ``--disable-overlap-schedule`` (the overlap
scheduler creates a CUDA event on prefix hits) and a decode server
``--disaggregation-decode-retraction-backup cpu_tensor``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


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


# Added on a CPU machine (a caller's ``env`` still wins): ``torch.compile``d helpers of vLLM run
# eagerly, like every other op of a ``--enforce-eager`` CPU server. Otherwise inductor compiles
# each at its first call, holding the GIL while it builds C++ (a cold cache: a fresh machine, as
# in CI): with TP > 1 the embedding's ``get_masked_input_and_mask`` at the first forward, 60-70 s
# on 2 cores; with TP 1 too, the log-prob rank helper (``batched_count_greater_than``) at the
# first request asking for log-probs, 15-20 s. Long enough for a peer's lease or a side
# channel's handshake to time out (seen: a D request failed "no PULLED within 20 s of DONE"
# while P and D both compiled; docs/connector-protocol.md, "Ranks").
CPU_EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1"}

# Added on a CPU machine unless the caller's ``env`` or this process's environment sets it:
# vLLM's shared-memory ring readers (every worker, and the engine reading its workers) poll every
# 1 ms instead of spinning 1 s after each read (splitserve.connectors.vllm.shm_spin). A D waiting
# for KV steps every millisecond, so on a host with fewer cores than engine processes its spinning
# readers took the cores from the P it waited for: the TP module took 440 s with the spin (rows of
# 20-40 s, shares expired) and 107 s without (rows of about 2 s).
# docs/environment.md, "Scheduling stalls".
CPU_RING_ENV = {"SPLITSERVE_VLLM_SHM_SPIN_S": "0"}

# ``in_process_worker``: a one-rank server runs its worker inside the engine-core process
# (vLLM's ``UniProcExecutor``), the layout vLLM itself picks for one GPU. vLLM's CPU platform
# otherwise forces a separate worker process (``MultiprocExecutor``) and keeps it only while
# ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on; the API server's engine client always runs the
# engine core in its own process, whatever this says. One Python process (one import of vLLM)
# fewer to spawn per start: docs/environment.md, "Suite time".
IN_PROCESS_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def tensor_parallel_size(argv: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` (or ``-tp``) an engine command line asks for; 1 if none."""
    size = 1
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in ("--tensor-parallel-size", "-tp"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            size = int(value)
        except ValueError:
            continue  # the engine's own argument parser reports it
    return size


# vLLM's ``--middleware`` for servers with SplitserveConnector: refuses malformed
# ``kv_transfer_params`` and a ``remote_host`` outside the connector's ``allowed_prefill_hosts``
# with a 400 naming the field (``splitserve.connectors.vllm.middleware``; docs/security.md).
SPLITSERVE_GUARD = "splitserve.connectors.vllm.middleware.PrefillTargetGuard"


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
    middleware: Sequence[str] = (),
    in_process_worker: bool = False,
) -> ServerCommand:
    """The OpenAI server of a stock vLLM (``middleware``: ASGI import paths vLLM adds to its
    API server, e.g. ``SPLITSERVE_GUARD``).

    Started as ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console
    script of the CPU wheel is broken. On a CPU machine: fp32 (2.4x faster than bf16 without
    AVX512-BF16), eager mode, and ``cpu_core`` pins the server's OpenMP threads to one core so
    two servers side by side do not fight (with ``--tensor-parallel-size`` in ``extra_args``,
    every rank's); ``CPU_EAGER_ENV`` and ``CPU_RING_ENV`` on a CPU machine.
    ``in_process_worker``: with one rank, the worker runs in the engine-core process, as on one
    GPU (``IN_PROCESS_WORKER_ENV``); with several ranks, or an explicit
    ``--distributed-executor-backend``, it changes nothing.
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
    for path in middleware:
        argv += ["--middleware", path]
    argv += list(extra_args)
    full_env = dict(CPU_VLLM_ENV) if cpu else {}
    ranks = tensor_parallel_size(argv)
    if cpu and cpu_core is not None:
        # one core list per rank (vLLM asserts it): every rank on the server's core
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join([str(cpu_core)] * ranks)
    if cpu:
        full_env.update(CPU_EAGER_ENV)
        full_env.update({k: v for k, v in CPU_RING_ENV.items() if k not in os.environ})
    explicit_executor = any(a.partition("=")[0] == "--distributed-executor-backend" for a in argv)
    if in_process_worker and ranks == 1 and not explicit_executor:
        full_env.update(IN_PROCESS_WORKER_ENV)
    full_env.update(env or {})
    return ServerCommand(argv=argv, env=full_env)


# ---------------------------------------------------------------------------------- SGLang

Mode = Literal["unified", "prefill", "decode"]

CPU_SGLANG_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "SGLANG_DISABLE_REQUEST_LOGGING": "1",
    # A server is stopped as a process group (splitserve.launch.process): its scheduler and
    # detokenizer exit first, SGLang's parent takes that for a crashed child and, with these
    # on (SGLang's default), sleeps 5 s "to let GPU activity settle" before py-spy and CUDA
    # core dumps. There is no GPU here: the stop took 5.5 s instead of 0.5 s.
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}


def sglang_server(
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    mode: Mode = "unified",
    transfer_backend: str | None = None,
    bootstrap_port: int | None = None,
    served_model_name: str | None = None,
    chunked_prefill_size: int | None = None,
    max_total_tokens: int = 16384,
    mem_fraction_static: float = 0.8,
    cpu: bool = True,
    sleep_on_idle: bool = True,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str | None = None,
) -> ServerCommand:
    """``python -m sglang.launch_server`` for one server (unified, PD prefill or PD decode).

    On a CPU, SGLang requires ``--mem-fraction-static`` to exceed the share of host memory that
    disappeared while it loaded weights (``1 - free_after / free_before``), whoever took it: other
    servers starting side by side made 0.05 and then 0.3 fail here. ``--max-total-tokens`` is
    what bounds the KV cache (16384 tokens of the tiny model: 64 MB), so a high fraction costs
    nothing.

    ``sleep_on_idle`` (SGLang's ``--sleep-on-idle``): without it SGLang's scheduler polls its
    sockets in a loop and holds a core at 100% while idle; with it, a fully idle scheduler
    waits on its sockets (up to 1 s) and wakes as soon as a request arrives.
    """
    argv = [
        python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--max-total-tokens",
        str(max_total_tokens),
        "--skip-server-warmup",
    ]
    if sleep_on_idle:
        argv.append("--sleep-on-idle")
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if cpu:
        argv += [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-cuda-graph",
            "--mem-fraction-static",
            str(mem_fraction_static),
        ]
    if chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(chunked_prefill_size)]
    if mode != "unified":
        argv += ["--disaggregation-mode", mode]
        if transfer_backend:
            argv += ["--disaggregation-transfer-backend", transfer_backend]
    if mode == "prefill":
        if bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if cpu:
            argv += ["--disable-overlap-schedule"]
    if mode == "decode" and cpu:
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    argv += list(extra_args)
    full_env = dict(CPU_SGLANG_ENV) if cpu else {}
    full_env.update(env or {})
    return ServerCommand(argv=argv, env=full_env)


def sglang_router(
    port: int,
    prefill: Sequence[tuple[str, int]],
    decode: Sequence[str],
    *,
    prometheus_port: int,
    host: str = "127.0.0.1",
    python: str | None = None,
) -> ServerCommand:
    """``python -m sglang_router.launch_router --pd-disaggregation`` over (url, bootstrap) pairs.

    ``prometheus_port`` is required: the router otherwise binds a fixed default port for its
    metrics, so a second router on the machine dies with "Address already in use" (seen here).
    """
    argv = [python or sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for url, bootstrap in prefill:
        argv += ["--prefill", url, str(bootstrap)]
    for url in decode:
        argv += ["--decode", url]
    argv += ["--host", host, "--port", str(port)]
    argv += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    return ServerCommand(argv=argv, env={})
