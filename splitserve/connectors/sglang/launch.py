"""Command lines that start stock SGLang servers and its router, the way proven on our CPUs.

Pure string building (no SGLang import); used by the SGLang tests and benchmarks. On a CPU
(ENVIRONMENT.md, "SGLang"): ``--device cpu --attention-backend torch_native --sampling-backend
pytorch --disable-cuda-graph``, fp32, a fixed ``--max-total-tokens``; a PD prefill server needs
``--disable-overlap-schedule`` (the overlap scheduler creates a CUDA event on prefix hits) and a
decode server ``--disaggregation-decode-retraction-backup cpu_tensor``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Literal

from splitserve.launch.engines import ServerCommand

Mode = Literal["unified", "prefill", "decode"]

CPU_SGLANG_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "SGLANG_DISABLE_REQUEST_LOGGING": "1",
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
