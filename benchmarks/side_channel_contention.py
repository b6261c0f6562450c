"""Side channel under a shared, loaded core: do heartbeats and handshakes keep their bounds?

Sets up the pinned-engine case without vLLM (docs/connector-protocol.md, "pinned"): a P and a
D process pinned to one core the way vLLM pins a CPU worker (``OMP_PLACES={core}``,
``OMP_PROC_BIND=true``, ``OMP_NUM_THREADS=1``: torch's libgomp binds the importing thread, and
every thread started later inherits that core), each running busy torch work on its main
thread, plus ``--hogs`` busy processes pinned to that core. D pings P over a ``SideChannel``
(CurveZMQ; ``--liveness`` sets ``liveness_timeout_s``, 5 s as in production) every 200 ms; P's
main thread answers between its 50 ms chunks of work, so the round trip measures both main
threads as well as the channel. Reported per run: connections lost (``PeerLost``: the
heartbeat bound, the native path), the round trip's p50/p99/max, and every thread's CPU list
in P and D (does a side-channel thread still share the pinned core?).

``--no-fix`` disables the side channel's unpinning (``side_channel._all_cpus``), for the A/B;
``--nice`` starts P and D niced. Results swing with whatever else the machine runs: repeat
runs and compare counts. 2026-12-02 on the 2-core test machine (others' tests running): 5 s
bound, 3 hogs, 30 s, 5 runs each: no connection lost pinned or unpinned (a 5 s silence was
not reproduced); the figures for a 0.5 s bound are in connector-protocol.md::

    .venv/bin/python benchmarks/side_channel_contention.py --seconds 30 --hogs 3 [--no-fix]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

KEY = b"side-channel-contention-benchmark-key"


def _thread_cpus() -> dict[str, str]:
    """``name/tid -> Cpus_allowed_list`` for every thread of this process."""
    out = {}
    for task in sorted(Path(f"/proc/{os.getpid()}/task").iterdir()):
        try:
            status = (task / "status").read_text().splitlines()
            comm = (task / "comm").read_text().strip()
        except OSError:
            continue
        line = next(line for line in status if line.startswith("Cpus_allowed_list"))
        out[f"{comm}/{task.name}"] = line.split(":", 1)[1].strip()
    return out


def _busy(torch, seconds: float) -> None:
    """Engine-like work on the main thread: matmuls (GIL released) and Python bytecode."""
    a = torch.rand(192, 192)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
        sum(i * i for i in range(2000))


def _child(args) -> None:
    if args.nice:
        os.nice(args.nice)  # a server started niced (a polling neighbour's courtesy)
    import torch  # binds this thread to OMP_PLACES (libgomp), as in a vLLM CPU worker

    from splitserve.transfer import messages, side_channel
    from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef, SideChannel

    if args.no_fix:
        side_channel._all_cpus = lambda: None
    pinned = sorted(os.sched_getaffinity(0))
    if args.role == "p":
        ch = SideChannel(
            "127.0.0.1", args.port, KEY, name="contention-p", liveness_timeout_s=args.liveness
        )
        deadline = time.monotonic() + args.seconds + 3
        answered = 0
        report_at = time.monotonic() + 2
        threads = {}
        while time.monotonic() < deadline:
            _busy(torch, 0.05)
            for event in ch.receive_bound():
                if isinstance(event, Inbound) and isinstance(event.message, messages.Abort):
                    ch.send(event.peer, messages.AbortAck(transfer_id=event.message.transfer_id))
                    answered += 1
            if report_at and time.monotonic() > report_at:
                threads = _thread_cpus()
                report_at = 0
        print(json.dumps({"role": "p", "pinned": pinned, "answered": answered, "threads": threads}))
        ch.close()
        return
    ch = SideChannel(None, None, KEY, name="contention-d", liveness_timeout_s=args.liveness)
    peer = PeerRef(host="127.0.0.1", port=args.port)
    sent: dict[str, float] = {}
    rtts: list[float] = []
    lost: list[tuple[float, str]] = []
    start = time.monotonic()
    next_ping = start
    seq = 0
    while time.monotonic() - start < args.seconds:
        now = time.monotonic()
        if now >= next_ping:
            seq += 1
            sent[f"t{seq}"] = now
            ch.send(peer, messages.Abort(transfer_id=f"t{seq}", reason="ping"))
            next_ping = now + 0.2
        _busy(torch, 0.02)
        for event in ch.receive_connected():
            if isinstance(event, PeerLost):
                lost.append((round(time.monotonic() - start, 1), event.reason))
            elif isinstance(event, Inbound) and isinstance(event.message, messages.AbortAck):
                t0 = sent.pop(event.message.transfer_id, None)
                if t0 is not None:
                    rtts.append(time.monotonic() - t0)
    rtts.sort()

    def q(p: float) -> float | None:
        return round(rtts[min(len(rtts) - 1, int(p * len(rtts)))], 3) if rtts else None

    print(
        json.dumps(
            {
                "role": "d",
                "pinned": pinned,
                "pings": seq,
                "answers": len(rtts),
                "lost": lost,
                "rtt_p50": q(0.5),
                "rtt_p99": q(0.99),
                "rtt_max": q(1.0),
                "threads": _thread_cpus(),
            }
        )
    )
    ch.close()


def _hog(core: int) -> None:
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    _busy(torch, float(sys.argv[sys.argv.index("--seconds") + 1]) + 15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--hogs", type=int, default=3, help="extra busy processes on the core")
    parser.add_argument("--liveness", type=float, default=5.0, help="liveness_timeout_s")
    parser.add_argument("--nice", type=int, default=0, help="niceness of P and D")
    parser.add_argument("--no-fix", action="store_true")
    parser.add_argument("--role", choices=["p", "d", "hog"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "hog":
        _hog(args.core)
        return
    if args.role:
        _child(args)
        return
    from splitserve.netutil import free_port

    port = free_port()
    env = dict(os.environ)
    env.update(OMP_PLACES=f"{{{args.core}}}", OMP_PROC_BIND="true", OMP_NUM_THREADS="1")
    base = [sys.executable, __file__, "--seconds", str(args.seconds), "--core", str(args.core)]
    base += ["--port", str(port), "--nice", str(args.nice), "--liveness", str(args.liveness)]
    base += ["--no-fix"] if args.no_fix else []
    hogs = [subprocess.Popen([*base, "--role", "hog"]) for _ in range(args.hogs)]
    p = subprocess.Popen([*base, "--role", "p"], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    d = subprocess.Popen([*base, "--role", "d"], env=env, stdout=subprocess.PIPE, text=True)
    d_out, _ = d.communicate()
    p_out, _ = p.communicate(timeout=args.seconds + 60)
    for hog in hogs:
        hog.kill()
        hog.wait()
    result = {"fix": not args.no_fix, "hogs": args.hogs, "nice": args.nice}
    result.update(liveness_s=args.liveness, seconds=args.seconds)
    for out in (d_out, p_out):
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                result[row.pop("role")] = row
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
