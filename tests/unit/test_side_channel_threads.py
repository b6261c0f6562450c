"""The side channel's liveness does not hang on its caller's pinned core or on a lagging reader.

A vLLM CPU worker's main thread is bound to one core (libgomp, from ``VLLM_CPU_OMP_THREADS_BIND``)
before it opens its side channel; every thread started from it inherits that core, so the
channel's threads (libzmq's I/O and reaper threads, the ZAP thread that answers CurveZMQ
handshakes, our I/O thread) shared the engine's busy core. And libzmq stops decoding a
connection whose inbound queue is full, so a reader that lagged lost its peer at
``liveness_timeout_s`` although the peer answered every heartbeat.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from splitserve.netutil import free_port
from splitserve.transfer import messages, side_channel
from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef, SideChannel

KEY = b"k" * 32


def _cpus_of(tid: int) -> set[int]:
    status = Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
    text = next(line for line in status if line.startswith("Cpus_allowed_list")).split(":")[1]
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _zmq_threads() -> set[int]:
    out = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("ZMQbg"):
                out.add(int(task.name))
        except OSError:
            continue  # the thread ended meanwhile
    return out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
def test_threads_started_by_a_pinned_caller_run_on_every_cpu():
    everywhere = os.sched_getaffinity(0)
    if len(everywhere) < 2:
        pytest.skip("one CPU: a pinned thread and an unpinned one cannot differ")
    pinned = {min(everywhere)}
    before = _zmq_threads()
    os.sched_setaffinity(0, pinned)  # as libgomp pins a vLLM CPU worker's main thread
    try:
        ch = SideChannel("127.0.0.1", None, KEY)
    finally:
        caller = os.sched_getaffinity(0)
        os.sched_setaffinity(0, everywhere)
    try:
        assert caller == pinned, "the caller's own pin was not put back"
        assert ch._authenticator is not None
        ours = {
            "I/O thread": ch._thread.native_id,
            "ZAP thread": ch._authenticator.thread.native_id,
        }
        end = time.monotonic() + 30  # libzmq's threads name themselves once they run
        while len(_zmq_threads() - before) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        ours.update({f"libzmq thread {tid}": tid for tid in _zmq_threads() - before})
        assert len(ours) >= 4  # libzmq starts an I/O thread and a reaper
        stuck = {name: _cpus_of(tid) for name, tid in ours.items() if _cpus_of(tid) == pinned}
        assert not stuck, f"threads left on the caller's pinned core: {stuck}"
    finally:
        ch.close()


def test_a_reader_that_lags_keeps_a_peer_that_answers():
    """D's I/O thread stalls past the liveness bound while P sends it 3,000 messages (more
    than libzmq's default inbound queue of 1,000): the connection stays, every message
    arrives once the reader is back."""
    liveness_s = 1.0
    port = free_port()
    p = SideChannel("127.0.0.1", port, KEY, liveness_timeout_s=liveness_s)
    d = SideChannel(None, None, KEY, liveness_timeout_s=liveness_s)
    released = threading.Event()
    accept = d._accept

    def stalled_accept(peer, wire):  # D's reader is stuck (a busy, pinned engine)
        released.wait(timeout=30)
        accept(peer, wire)

    try:
        d.send(PeerRef(host="127.0.0.1", port=port), messages.AbortAck(transfer_id="hi"))
        end = time.monotonic() + 30
        hello = []
        while not hello and time.monotonic() < end:
            hello = [e for e in p.receive_bound() if isinstance(e, Inbound)]
            time.sleep(0.02)
        assert hello, "P never heard from D"
        d._accept = stalled_accept
        n = 3000
        for i in range(n):
            p.send(hello[0].peer, messages.AbortAck(transfer_id=f"t{i}"))
        time.sleep(4 * liveness_s)  # several liveness bounds with the reader stuck
        released.set()
        got: list = []
        lost: list = []
        end = time.monotonic() + 20
        while len(got) < n and not lost and time.monotonic() < end:
            for event in d.receive_connected():
                (lost if isinstance(event, PeerLost) else got).append(event)
            time.sleep(0.02)
        assert not lost, f"a live peer dropped while our reader lagged: {lost}"
        assert [e.message.transfer_id for e in got] == [f"t{i}" for i in range(n)]
        assert p.stats.dropped_peers == {} and d.stats.dropped_peers == {}
    finally:
        released.set()
        d.close()
        p.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")
def test_a_policy_that_forbids_widening_leaves_a_working_channel(monkeypatch, caplog):
    """A seccomp or container policy may refuse sched_setaffinity: the channel opens anyway,
    as pinned as its caller, and says so."""
    own = os.sched_getaffinity(0)

    def refuse(pid, cpus):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    monkeypatch.setattr(side_channel, "_all_cpus", lambda: own | {max(own) + 1})
    port = free_port()
    p = SideChannel("127.0.0.1", port, KEY)
    d = SideChannel(None, None, KEY)
    try:
        assert os.sched_getaffinity(0) == own
        assert "threads stay on CPUs" in caplog.text
        d.send(PeerRef(host="127.0.0.1", port=port), messages.AbortAck(transfer_id="t"))
        got: list = []
        end = time.monotonic() + 30
        while not got and time.monotonic() < end:
            got = [e for e in p.receive_bound() if isinstance(e, Inbound)]
            time.sleep(0.02)
        assert [e.message for e in got] == [messages.AbortAck(transfer_id="t")]
    finally:
        d.close()
        p.close()
