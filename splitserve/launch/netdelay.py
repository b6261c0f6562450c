"""Delay and jitter in userspace, for kernels without ``sch_netem``: one NFQUEUE, held verdicts.

Why: the test bed (``splitserve.launch.testbed``) delays a host's link with netem where the
kernel has it. Ours lacks netem, and also ``sch_fq`` and ``act_bpf``, the other kernel ways to
hold packets back; it has ``nfnetlink_queue`` and iptables' ``NFQUEUE`` target. So the test bed
sends the frames of a host's link to a queue (rules in its switch namespace, where this process
runs too: queues are per network namespace), and this process gives each packet its accept
verdict ``delay ± jitter`` after it arrived: a sample of a normal distribution (mean
``delay``, standard deviation ``jitter``, as netem's ``distribution normal``), clipped at 0.
Verdicts are given in release order, not arrival order, so with jitter packets overtake each
other, as they do under netem.

How: the ``NetfilterQueue`` binding (libnetfilter_queue), never hand-written netlink. The queue
is bound in ``COPY_META`` mode: the kernel sends metadata only and keeps the payload, so no
byte of a packet is copied to this process. A ``Packet`` kept after its callback can be
verdicted later (the verdict needs only its id), so the callback only pushes it onto a heap
keyed by release time; the loop waits on the queue's fd, the signal pipe and the owner's pidfd
with a timeout to the next release, reads with ``run(block=False)`` and accepts what is due.
The callback also accepts what is due, so a flood that keeps ``run`` reading starves nobody.

Stops on SIGTERM or SIGINT, or when the owner process (``--owner-pid``, the test bed's creator)
exits, so a crashed test run leaves no delayer behind: every packet still held is accepted at
once (the kernel would drop them when the queue's socket closes). Prints ``ready`` on stdout
once the queue is bound; the caller installs its iptables rules only then.

Run: ``python -m splitserve.launch.netdelay --queue 0 --delay-ms 5 --jitter-ms 2``. The
library does not expose the queue's flags (``F_GSO``, ``F_FAIL_OPEN``): the kernel segments GSO
packets before queueing them, and drops what exceeds ``--max-held``. Measured costs:
docs/environment.md, "The multi-host test bed".
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import logging
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import psutil

logger = logging.getLogger(__name__)

READY = "ready"  # the line printed once the queue is bound
MODULE = "splitserve.launch.netdelay"  # what ``python -m`` runs (``__name__`` there: __main__)


class Verdictable(Protocol):
    """What the delayer needs of a queued packet (``netfilterqueue.Packet`` has it)."""

    def accept(self) -> None: ...


@dataclass
class DelaySchedule:
    """Each packet's delay in seconds: normal(delay, jitter), clipped at 0 (netem's shape)."""

    delay_s: float
    jitter_s: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.jitter_s < 0:
            raise ValueError(f"delay {self.delay_s} s and jitter {self.jitter_s} s must be >= 0")
        self._rng = random.Random(self.seed)

    def sample(self) -> float:
        if not self.jitter_s:
            return self.delay_s
        return max(0.0, self._rng.gauss(self.delay_s, self.jitter_s))


class Delayer:
    """Packets held until their release time, accepted in release order."""

    def __init__(
        self, schedule: DelaySchedule, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.schedule = schedule
        self.clock = clock
        self._heap: list[tuple[float, int, Verdictable]] = []
        self._seq = itertools.count()  # ties keep arrival order; packets are never compared
        self.held_total = 0

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, packet: Verdictable) -> None:
        """The queue's callback: keep ``packet`` until its release, then release what is due."""
        now = self.clock()
        heapq.heappush(self._heap, (now + self.schedule.sample(), next(self._seq), packet))
        self.held_total += 1
        self.release_due(now)

    def release_due(self, now: float | None = None) -> int:
        """Accept every packet whose release time has come; returns how many."""
        now = self.clock() if now is None else now
        released = 0
        while self._heap and self._heap[0][0] <= now:
            heapq.heappop(self._heap)[2].accept()
            released += 1
        return released

    def timeout(self) -> float | None:
        """Seconds until the next release (``None``: nothing held)."""
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - self.clock())

    def flush(self) -> int:
        """Accept everything still held, in release order (at exit)."""
        released = 0
        while self._heap:
            heapq.heappop(self._heap)[2].accept()
            released += 1
        return released


@dataclass(frozen=True)
class Options:
    queue: int
    delay_ms: float
    jitter_ms: float
    seed: int | None
    owner_pid: int | None
    max_held: int


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.launch.netdelay",
        description="Delay the packets of one NFQUEUE by delay +- jitter (normal), then accept.",
    )
    parser.add_argument("--queue", type=int, default=0, help="NFQUEUE number (0-65535)")
    parser.add_argument("--delay-ms", type=float, required=True, help="mean delay per packet")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="its standard deviation")
    parser.add_argument("--seed", type=int, default=None, help="seed the delay samples")
    parser.add_argument("--owner-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument(
        "--max-held",
        type=int,
        default=16384,
        help="packets the kernel queues for us at most (more are dropped)",
    )
    ns = parser.parse_args(argv)
    if not 0 <= ns.queue <= 65535:
        parser.error(f"--queue {ns.queue}: 0 to 65535")
    if ns.delay_ms < 0 or ns.jitter_ms < 0:
        parser.error("--delay-ms and --jitter-ms must be >= 0")
    if ns.max_held < 1:
        parser.error("--max-held must be >= 1")
    if ns.owner_pid is not None and ns.owner_pid < 1:
        parser.error("--owner-pid must be a process id")
    return Options(ns.queue, ns.delay_ms, ns.jitter_ms, ns.seed, ns.owner_pid, ns.max_held)


def running_in(netns: str) -> dict[int, Options]:
    """The delayers running in network namespace ``netns``: pid -> their options."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    found = {}
    for pid in map(int, pids.stdout.split()):
        with contextlib.suppress(psutil.Error, SystemExit, ValueError):
            argv = psutil.Process(pid).cmdline()
            if MODULE in argv:
                found[pid] = parse_args(argv[argv.index(MODULE) + 1 :])
    return found


def kill_all_in(netns: str) -> list[int]:
    """Stop every delayer in ``netns`` (SIGTERM: it accepts what it holds; then SIGKILL)."""
    procs = []
    for pid in running_in(netns):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    if procs:
        logger.info("stopped delayers %s in %s", [p.pid for p in procs], netns)
    return [p.pid for p in procs]


def serve(options: Options, on_ready: Callable[[], None]) -> int:
    """Bind the queue and delay its packets until stopped; returns the exit status."""
    from netfilterqueue import COPY_META, NetfilterQueue  # only here: unit tests need no lib

    schedule = DelaySchedule(options.delay_ms / 1e3, options.jitter_ms / 1e3, options.seed)
    delayer = Delayer(schedule)
    # select(2), not epoll: epoll's timeout counts whole milliseconds (Python rounds up), which
    # released packets up to 1 ms late; select's counts microseconds. Three fds, all small.
    sel = selectors.SelectSelector()
    wake_r, wake_w = socket.socketpair()
    for sock in (wake_r, wake_w):
        sock.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)  # the wakeup fd ends the loop
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    if options.owner_pid is not None:
        try:
            owner = os.pidfd_open(options.owner_pid)
        except ProcessLookupError:
            logger.info("owner %d is gone: not starting", options.owner_pid)
            return 0
        sel.register(owner, selectors.EVENT_READ, "owner")
    nfq = NetfilterQueue()
    nfq.bind(options.queue, delayer.hold, max_len=options.max_held, mode=COPY_META)
    sel.register(nfq.get_fd(), selectors.EVENT_READ, "queue")
    logger.info(
        "queue %d: delay %.3f ms, jitter %.3f ms", options.queue, options.delay_ms,
        options.jitter_ms,
    )  # fmt: skip
    on_ready()
    why = "?"
    try:
        while True:
            events = sel.select(delayer.timeout())
            stops = [key.data for key, _ in events if key.data != "queue"]
            if stops:
                why = stops[0]
                break
            if events:
                nfq.run(block=False)
            delayer.release_due()
    finally:
        with contextlib.suppress(OSError):
            nfq.run(block=False)  # what already waits in the socket: accepted, not dropped
        flushed = delayer.flush()
        nfq.unbind()
        logger.info(
            "stopped (%s): %d packets delayed, %d accepted early at exit",
            why, delayer.held_total, flushed,
        )  # fmt: skip
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s netdelay %(message)s")
    options = parse_args(argv)
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        print(
            "netdelay: the NetfilterQueue package is missing: pip install NetfilterQueue "
            "(it builds against libnetfilter_queue: as root, apt-get install "
            "libnetfilter-queue-dev; make env does both)",
            file=sys.stderr,
        )
        return 2
    return serve(options, lambda: print(READY, flush=True))


if __name__ == "__main__":
    sys.exit(main())
