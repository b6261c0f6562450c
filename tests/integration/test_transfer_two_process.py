"""splitserve.transfer on its own: two real processes, real NIXL (UCX, host memory), real bytes.

The test process plays D (receiver); a child process (this file run as a script) plays P
(sender) through one scenario, pushing (P WRITEs) or pulling (P ANNOUNCEs, D READs; the
direction is P's, passed in ``DIRECTION``). P's KV is random data from a seed both sides know,
so D checks every byte it received against what P holds, and that nothing outside the
registered blocks was touched. For a D that dies mid-pull, D is a child process too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import deque

import pytest

from splitserve.netutil import free_port

pytestmark = pytest.mark.integration

NUM_LAYERS = 3
NUM_BLOCKS = 12
BLOCK_SIZE = 16
SHAPE = (2, NUM_BLOCKS, 2, BLOCK_SIZE, 8)  # (K/V, blocks, kv heads, block size, head dim)
AUTH_KEY = b"test-shared-key"


def make_cache(seed: int | None):
    import torch

    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(NUM_LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(NUM_LAYERS)]


def make_agent(name: str, cache):
    """The agent over ``cache``, with the NIXL backends named in ``NIXL_BACKENDS`` (JSON, the
    connector setting's form; default UCX)."""
    from splitserve.transfer.agent import KVAgent, NixlBackend
    from splitserve.transfer.layout import kv_layout_from_tensors

    raw = os.environ.get("NIXL_BACKENDS")
    backends = [NixlBackend.model_validate(b) for b in json.loads(raw)] if raw else None
    return KVAgent(name, kv_layout_from_tensors(cache, NUM_BLOCKS, BLOCK_SIZE), backends=backends)


# ---------------------------------------------------------------------------------------------
# P: the child process
# ---------------------------------------------------------------------------------------------


def run_sender(scenario: str, port: int, key: bytes | None) -> None:
    from splitserve.transfer.sender import KVSender, StepUpdate
    from splitserve.transfer.side_channel import SideChannel
    from splitserve.transfer.state import TransferState
    from splitserve.transfer.strategy import Direction

    cache = make_cache(seed=1234)
    agent = make_agent(f"P-{os.getpid()}", cache)
    channel = SideChannel(os.environ.get("SENDER_HOST", "127.0.0.1"), port, key)
    lease_s = float(os.environ.get("LEASE_S", "30"))
    setting = os.environ.get("DIRECTION", "push")
    if setting == "auto":  # as the connector does: the default from UCX_TLS, then per receiver
        from splitserve.transfer import strategy

        direction = strategy.choose(strategy.transport_of(), agent.layout.memory)
    else:
        direction = Direction(setting)
    sender = KVSender(
        agent, channel, lease_s=lease_s, direction=direction, per_peer=setting == "auto"
    )
    tid, num_tokens = "tid-1", 70  # 5 blocks of 16; the last one partly filled
    p_blocks = [3, 0, 7, 5, 11]
    released: set[str] = set()

    def say(**kw):
        print("EVENT " + json.dumps(kw), flush=True)

    def wait(predicate, bound=30.0):
        end = time.monotonic() + bound
        while time.monotonic() < end:
            released.update(sender.poll())
            if predicate():
                return True
            time.sleep(0.002)
        return False

    sender.add_request(tid, num_tokens)
    say(event="ready")
    if scenario in ("stream", "hang", "pause"):
        wait(lambda: sender.state_of(tid) is TransferState.STREAMING)
    chunks = [20, 45, 70]  # chunked prefill: blocks complete at 16, 32, then all
    for i, computed in enumerate(chunks):
        sender.begin_step([StepUpdate(tid, p_blocks, computed)])
        for layer in range(NUM_LAYERS):
            time.sleep(0.01)  # "compute"
            sender.layer_done(layer)
        sender.end_step()
        released.update(sender.poll())
        if scenario == "hang" and i == 1:
            say(event="streamed_some")
            time.sleep(600)
        if scenario == "pause" and i == 1:  # the test kills D here, then lets P go on
            say(event="streamed_some")
            sys.stdin.readline()
    sender.finish_request(tid)
    if scenario == "late":
        say(event="prefill_done")
    wait(lambda: tid in released, bound=float(os.environ.get("WAIT_S", "30")))
    say(
        event="end",
        released=sorted(released),
        state=str(sender.state_of(tid)),
        stats={k: list(v) if isinstance(v, deque) else v for k, v in vars(sender.stats).items()},
    )
    channel.close()


def run_receiver(port: int, key: bytes | None) -> None:
    """D as a child (for the test that kills it mid-pull): register, then poll until killed."""
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.side_channel import SideChannel

    cache = make_cache(seed=None)  # held while the agent lives: NIXL writes into it
    agent = make_agent(f"D-{os.getpid()}", cache)
    channel = SideChannel(None, None, key)
    receiver = KVReceiver(agent, channel, done_timeout_s=120, abort_ack_timeout_s=5)
    receiver.expect("tid-1", "127.0.0.1", port, [9, 2, 4, 6, 1], token_offset=0)
    print("EVENT " + json.dumps({"event": "registered"}), flush=True)
    said = False
    while True:
        receiver.poll()
        if receiver.stats.reads_posted and not said:
            said = True
            print("EVENT " + json.dumps({"event": "reading"}), flush=True)
        time.sleep(0.002)


def run_checking_receiver(host: str, port: int, key: bytes | None) -> None:
    """D as a child (on another test-bed host): receive the 5 blocks from P at ``host``, check
    every byte, and report the outcome, the bytes check and the transport D saw."""
    from splitserve.transfer import strategy
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.side_channel import SideChannel

    cache = make_cache(seed=None)
    agent = make_agent(f"D-{os.getpid()}", cache)
    channel = SideChannel(None, None, key)
    receiver = KVReceiver(agent, channel, done_timeout_s=60, abort_ack_timeout_s=5)
    d_blocks = [9, 2, 4, 6, 1]
    receiver.expect("tid-1", host, port, d_blocks, token_offset=0)
    outcome = settle(receiver, "tid-1", bound=60.0)
    problem = None
    if outcome.ok:
        try:
            check_bytes(
                cache, expected_blocks(), list(zip([3, 0, 7, 5, 11], d_blocks, strict=True))
            )
        except AssertionError as exc:
            problem = str(exc)
    report = {
        "event": "received",
        "ok": outcome.ok,
        "reason": outcome.reason,
        "bytes_ok": outcome.ok and problem is None,
        "problem": problem,
        "reads_posted": receiver.stats.reads_posted,
        "host": strategy.host_identity(),
    }
    print("EVENT " + json.dumps(report), flush=True)
    channel.close()
    agent.close()


# ---------------------------------------------------------------------------------------------
# D: the test process
# ---------------------------------------------------------------------------------------------


class SenderProcess:
    def __init__(self, scenario: str, port: int, key: bytes | None, env=None) -> None:
        args = [sys.executable, __file__, scenario, str(port), (key or b"").decode()]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def go_on(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def next_event(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"sender exited early with {self.proc.wait()}"
            if line.startswith("EVENT "):
                return json.loads(line[len("EVENT ") :])

    def wait_for(self, name: str) -> dict:
        while True:
            event = self.next_event()
            if event["event"] == name:
                return event

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def receiver_side():
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.side_channel import SideChannel

    cache = make_cache(seed=None)
    agent = make_agent(f"D-{os.getpid()}", cache)
    channels = {}

    def receiver(key: bytes | None, done_timeout_s: float = 30.0):
        channel = SideChannel(None, None, key)
        channels[id(channel)] = channel
        return KVReceiver(agent, channel, done_timeout_s=done_timeout_s, abort_ack_timeout_s=5)

    yield cache, receiver
    for channel in channels.values():
        channel.close()
    agent.close()


def settle(receiver, tid: str, bound: float = 30.0):
    end = time.monotonic() + bound
    while time.monotonic() < end:
        outcome = receiver.poll().get(tid)
        if outcome is not None:
            return outcome
        time.sleep(0.002)
    raise AssertionError(f"transfer {tid} did not settle within {bound}s")


def expected_blocks():
    return make_cache(seed=1234)


def check_bytes(d_cache, p_cache, pairs):
    """Every (P block, D block) pair equal in every layer; every other D block still zero."""
    import torch

    d_written = {d for _, d in pairs}
    for layer in range(NUM_LAYERS):
        for p_block, d_block in pairs:
            assert torch.equal(d_cache[layer][:, d_block], p_cache[layer][:, p_block]), (
                f"layer {layer}: D block {d_block} != P block {p_block}"
            )
        for block in range(NUM_BLOCKS):
            if block not in d_written:
                assert not d_cache[layer][:, block].any(), f"layer {layer} block {block} touched"


def reset(d_cache):
    for tensor in d_cache:
        tensor.zero_()


DIRECTIONS = ["push", "pull"]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("scenario", ["stream", "late"])
def test_blocks_arrive_byte_exact(receiver_side, scenario, direction):
    """Streamed per layer and chunk (registration first) or in bulk (registration last),
    written by P or announced by P and read by D."""
    d_cache, make_receiver = receiver_side
    reset(d_cache)
    receiver = make_receiver(AUTH_KEY)
    port = free_port()
    sender = SenderProcess(scenario, port, AUTH_KEY, env={"DIRECTION": direction})
    try:
        sender.wait_for("ready")
        if scenario == "late":
            sender.wait_for("prefill_done")
        d_blocks = [9, 2, 4, 6, 1]
        receiver.expect("tid-1", "127.0.0.1", port, d_blocks, token_offset=0)
        outcome = settle(receiver, "tid-1")
        assert outcome.ok, outcome.reason
        assert outcome.exposed_handoff_s is not None
        end = sender.wait_for("end")
        assert end["released"] == ["tid-1"]
        assert end["stats"]["transfers_completed"] == 1
        # one WRITE (ANNOUNCE) per layer per chunk that completed blocks, none twice; one bulk
        posts = 3 * NUM_LAYERS if scenario == "stream" else 1
        if direction == "push":
            assert end["stats"]["writes_posted"] == posts
        else:
            assert end["stats"]["writes_posted"] == 0
            assert end["stats"]["announces_sent"] == posts
            assert receiver.stats.reads_posted == posts
        check_bytes(d_cache, expected_blocks(), list(zip([3, 0, 7, 5, 11], d_blocks, strict=True)))
    finally:
        sender.stop()


def test_receiver_prefix_hit_skips_blocks(receiver_side):
    """D already holds the first two blocks: only blocks 2.. are written."""
    d_cache, make_receiver = receiver_side
    reset(d_cache)
    receiver = make_receiver(AUTH_KEY)
    port = free_port()
    sender = SenderProcess("stream", port, AUTH_KEY)
    try:
        sender.wait_for("ready")
        receiver.expect("tid-1", "127.0.0.1", port, [8, 10], token_offset=2 * BLOCK_SIZE + 0)
        outcome = settle(receiver, "tid-1")
        assert outcome.ok, outcome.reason
        sender.wait_for("end")
        check_bytes(d_cache, expected_blocks(), [(7, 8), (5, 10)])
    finally:
        sender.stop()


def test_forged_registration_is_rejected(receiver_side):
    """D signs with a wrong key: P drops every message, writes nothing, releases on lease."""
    d_cache, make_receiver = receiver_side
    reset(d_cache)
    receiver = make_receiver(b"not-the-key", done_timeout_s=3.0)
    port = free_port()
    sender = SenderProcess("late", port, AUTH_KEY, env={"LEASE_S": "1", "WAIT_S": "10"})
    try:
        sender.wait_for("ready")
        receiver.expect("tid-1", "127.0.0.1", port, [9, 2, 4, 6, 1], token_offset=0)
        outcome = settle(receiver, "tid-1")
        # D learns nothing from P (its messages never got through): it gives up on its own
        # deadline, or when P's process exits after its lease.
        assert not outcome.ok
        assert "no DONE" in outcome.reason or "lost connection" in outcome.reason
        end = sender.wait_for("end")
        assert end["released"] == ["tid-1"], "P must free on lease expiry"
        assert end["stats"]["lease_expiries"] == 1
        assert end["stats"]["bytes_sent"] == 0
        check_bytes(d_cache, expected_blocks(), [])
    finally:
        sender.stop()


def test_out_of_range_blocks_are_rejected(receiver_side):
    """A registration asking for more blocks than the request has: ABORT, nothing written."""
    d_cache, make_receiver = receiver_side
    reset(d_cache)
    receiver = make_receiver(AUTH_KEY)
    port = free_port()
    sender = SenderProcess("late", port, AUTH_KEY)
    try:
        sender.wait_for("ready")
        sender.wait_for("prefill_done")
        receiver.expect("tid-1", "127.0.0.1", port, [9, 2, 4, 6, 1, 3], token_offset=0)
        outcome = settle(receiver, "tid-1")
        assert not outcome.ok and "invalid registration" in outcome.reason
        end = sender.wait_for("end")
        assert end["released"] == ["tid-1"]
        assert end["stats"]["bytes_sent"] == 0
        check_bytes(d_cache, expected_blocks(), [])
    finally:
        sender.stop()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_sender_death_fails_the_receiver_fast(receiver_side, direction):
    """P killed mid-stream (mid-pull: D has READs of P's memory posted): D's transfer fails on
    the lost connection, well before its timeout."""
    d_cache, make_receiver = receiver_side
    receiver = make_receiver(AUTH_KEY, done_timeout_s=120.0)
    port = free_port()
    sender = SenderProcess("hang", port, AUTH_KEY, env={"DIRECTION": direction})
    try:
        sender.wait_for("ready")
        receiver.expect("tid-1", "127.0.0.1", port, [9, 2, 4, 6, 1], token_offset=0)
        sender.wait_for("streamed_some")
        if direction == "pull":
            end = time.monotonic() + 30
            while not receiver.stats.reads_posted:  # D is pulling when P dies
                assert time.monotonic() < end, "no READ posted"
                assert receiver.poll() == {}
                time.sleep(0.002)
        sender.proc.kill()
        outcome = settle(receiver, "tid-1", bound=60.0)
        assert not outcome.ok and "lost connection" in outcome.reason
    finally:
        sender.stop()


def test_receiver_death_mid_pull_frees_on_the_sender():
    """D (a child here) killed while pulling: P finishes, sends DONE, gets no PULLED and frees
    its blocks a lease later; nothing hangs."""
    port = free_port()
    sender = SenderProcess(
        "pause", port, AUTH_KEY, env={"DIRECTION": "pull", "LEASE_S": "2", "WAIT_S": "30"}
    )
    receiver = subprocess.Popen(
        [sys.executable, __file__, "receive", str(port), AUTH_KEY.decode()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sender.wait_for("ready")
        while True:
            line = receiver.stdout.readline()
            assert line, f"receiver exited early with {receiver.wait()}"
            if '"reading"' in line:
                break
        sender.wait_for("streamed_some")
        receiver.kill()
        receiver.wait()
        sender.go_on()
        end = sender.wait_for("end")
        assert end["released"] == ["tid-1"], "P must free once the lease after DONE is over"
        assert end["stats"]["lease_expiries"] == 1
        assert end["stats"]["transfers_completed"] == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
        sender.stop()


def test_receiver_abort_is_acknowledged(receiver_side):
    """D aborts while P has not finished: P stops, acknowledges, and releases the request."""
    d_cache, make_receiver = receiver_side
    receiver = make_receiver(AUTH_KEY)
    port = free_port()
    sender = SenderProcess("late", port, AUTH_KEY)
    try:
        sender.wait_for("ready")
        receiver.expect("tid-1", "127.0.0.1", port, [9, 2, 4, 6, 1], token_offset=0)
        receiver.abort("tid-1", "client went away")
        outcome = settle(receiver, "tid-1")
        assert not outcome.ok and "aborted" in outcome.reason
        end = sender.wait_for("end")
        assert end["released"] == ["tid-1"]
    finally:
        sender.stop()


if __name__ == "__main__":
    logging_level = os.environ.get("SPLITSERVE_LOG", "WARNING")
    import logging

    logging.basicConfig(level=logging_level)
    if sys.argv[1] == "receive":
        run_receiver(int(sys.argv[2]), sys.argv[3].encode() or None)
    elif sys.argv[1] == "receive-check":
        host, port_text = sys.argv[2].rsplit(":", 1)
        run_checking_receiver(host, int(port_text), sys.argv[3].encode() or None)
    else:
        run_sender(sys.argv[1], int(sys.argv[2]), sys.argv[3].encode() or None)
