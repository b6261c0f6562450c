"""Measure NIXL WRITE bandwidth between two real processes (host memory, UCX).

Two roles:
- the **target** runs as a child process (``python -m splitserve.planner.nixl_probe target``):
  it registers one host buffer, opens NIXL's listener on a port, prints one JSON line
  ``{"agent", "port", "addr", "bytes"}`` on stdout, then keeps calling ``get_new_notifs()``
  until the initiator's ``done`` notification (or its deadline) and exits;
- the **initiator** (``measure_nixl_bandwidth``, in the calling process) starts the target,
  fetches its metadata through the listener, WRITEs each size a few times, and returns the
  median time per size.

Both agents run with ``enable_prog_thread=False``: NIXL's progress thread keeps a whole core busy
even when idle (ENVIRONMENT.md), which on a small machine would slow the measurement itself. The
price is that each side must call into NIXL to make progress: the initiator polls
``check_xfer_state`` and the target polls ``get_new_notifs`` every millisecond.
Invariant: the target never outlives its deadline, and the initiator stops it on every path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.netutil import free_port

logger = logging.getLogger(__name__)

DONE = b"splitserve-probe-done"


def _quiet_nixl_logger() -> None:
    """NIXL logs INFO lines to stdout, which would corrupt ``plan --json`` (and the target's
    address line): send them to stderr, at WARNING unless ``NIXL_LOG_LEVEL`` says otherwise."""
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def _agent(name: str, port: int):  # noqa: ANN202 - nixl types are untyped
    from nixl._api import nixl_agent, nixl_agent_config

    _quiet_nixl_logger()

    config = nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=True, listen_port=port, backends=["UCX"]
    )
    return nixl_agent(name, config)


def _mem_type(memory: str) -> str:
    return "VRAM" if memory == "cuda" else "DRAM"


def run_target(nbytes: int, port: int, deadline_s: float, memory: str = "cpu") -> None:
    import torch

    name = f"splitserve-probe-target-{os.getpid()}"
    agent = _agent(name, port)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=memory)
    agent.register_memory(buf)
    print(
        json.dumps({"agent": name, "port": port, "addr": buf.data_ptr(), "bytes": nbytes}),
        flush=True,
    )
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        notifs = agent.get_new_notifs()
        if any(DONE in msgs for msgs in notifs.values()):
            break
        time.sleep(0.001)
    agent.deregister_memory(agent.get_reg_descs(buf, _mem_type(memory)))


@dataclass(frozen=True)
class NixlPoint:
    bytes: int
    median_s: float
    runs: int


@dataclass(frozen=True)
class NixlBandwidth:
    points: list[NixlPoint]
    bytes_per_s: float
    per_transfer_s: float
    ucx_tls: str
    notes: list[str]


def fit_bandwidth(points: list[NixlPoint]) -> tuple[float, float]:
    """``t = a + bytes / B`` through the smallest and the largest transfer; ``(B, a)``.

    The slope comes from the two extremes (the middle points carry the same information and,
    on a shared machine, most of the noise); the fixed cost ``a`` is what the smallest transfer
    took beyond ``bytes / B``, so ``0 <= a <= t_smallest``. One point, or a largest transfer
    no slower than the smallest, gives ``B = bytes / t`` of the largest and ``a = 0``."""
    small = min(points, key=lambda p: p.bytes)
    large = max(points, key=lambda p: p.bytes)
    fallback = (large.bytes / large.median_s, 0.0)
    if large.bytes == small.bytes or large.median_s <= small.median_s:
        return fallback
    bandwidth = (large.bytes - small.bytes) / (large.median_s - small.median_s)
    return bandwidth, max(0.0, small.median_s - small.bytes / bandwidth)


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if line.strip().startswith("{"):
                return line
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    raise RuntimeError(
        f"NIXL probe target gave no address within {timeout_s:g} s (exit status {proc.poll()})"
    )


def measure_nixl_bandwidth(
    sizes: list[int],
    runs: int = 5,
    timeout_s: float = 60.0,
    cpu_core: int | None = None,
    memory: str = "cpu",
) -> NixlBandwidth:
    """WRITE each of ``sizes`` bytes ``runs`` times (after one warm-up) from this process into a
    target process; ``cpu_core`` pins the target (Linux) so the two sides do not share a core;
    ``memory="cuda"`` moves GPU memory (VRAM) instead of host memory."""
    max_bytes = max(sizes)
    port = free_port()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "splitserve.planner.nixl_probe",
        "target",
        "--bytes",
        str(max_bytes),
        "--port",
        str(port),
        "--deadline-s",
        str(timeout_s),
        "--memory",
        memory,
    ]
    if cpu_core is not None and sys.platform.startswith("linux"):
        cmd = ["taskset", "-c", str(cpu_core), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        import torch  # while the target starts

        info = json.loads(_read_line(proc, timeout_s))
        agent = _agent(f"splitserve-probe-initiator-{os.getpid()}", free_port())
        buf = torch.ones(max_bytes, dtype=torch.uint8, device=memory)
        mem, dev = _mem_type(memory), (torch.cuda.current_device() if memory == "cuda" else 0)
        agent.register_memory(buf)
        agent.fetch_remote_metadata(info["agent"], "127.0.0.1", info["port"])
        agent.send_local_metadata("127.0.0.1", info["port"])
        end = time.monotonic() + timeout_s
        while not agent.check_remote_metadata(info["agent"]):
            if time.monotonic() > end:
                raise RuntimeError("NIXL probe: target metadata did not arrive")
            time.sleep(0.001)
        points = []
        for size in sizes:
            local = agent.get_xfer_descs([(buf.data_ptr(), size, dev)], mem)
            remote = agent.get_xfer_descs([(info["addr"], size, dev)], mem)
            times = [
                _write_once(agent, local, remote, info["agent"], end) for _ in range(runs + 1)
            ][1:]
            points.append(NixlPoint(size, statistics.median(times), runs))
        agent.send_notif(info["agent"], DONE)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bandwidth, fixed = fit_bandwidth(points)
    tls = os.environ.get("UCX_TLS", "(UCX default: cma for host memory here)")
    where = "GPU memory (VRAM)" if memory == "cuda" else "host memory (DRAM)"
    return NixlBandwidth(
        points,
        bandwidth,
        fixed,
        tls,
        [
            f"NIXL WRITE, {where} between two processes over UCX, UCX_TLS={tls}, "
            f"progress threads off; median of {runs} runs per size after one warm-up",
        ],
    )


def _write_once(agent, local, remote, peer: str, deadline: float) -> float:  # noqa: ANN001
    handle = agent.initialize_xfer("WRITE", local, remote, peer)
    try:
        start = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise RuntimeError("NIXL probe: a WRITE did not finish in time")
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        if state != "DONE":
            raise RuntimeError(f"NIXL probe: WRITE ended in state {state}")
        return elapsed
    finally:
        agent.release_xfer_handle(handle)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["target"])
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    parser.add_argument("--memory", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    run_target(args.bytes, args.port, args.deadline_s, args.memory)


if __name__ == "__main__":
    main()
