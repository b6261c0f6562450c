"""Pruning with real NIXL agents in two processes: a peer that went away leaves nothing loaded.

P's side: the test process plays P (a real ``KVSender`` over a real ``KVAgent`` and side
channel), a child plays D (``test_transfer_two_process.py receive``: registers, is written
into or pulls, keeps polling). After one transfer D is killed; once its transfer ended and its
admission sat unused for ``idle_s`` (1 s here, 1200 s by default), P's admitted connections
and loaded NIXL agents are back at what they were before D came.

D's side: the test process plays D, a child plays P (``test_transfer_two_process.py stream``,
pulling) and exits after the transfer; D's connection to it is lost and D unloads P's agent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import test_transfer_two_process as two_process
from test_transfer_two_process import AUTH_KEY, SenderProcess, make_agent, make_cache, settle

from splitserve.netutil import free_port

pytestmark = pytest.mark.integration

BLOCKS = [9, 2, 4, 6, 1]  # what the ``receive`` child registers


def wait_until(predicate, poll, bound: float, what: str) -> None:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        poll()
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"not within {bound}s: {what}")


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_p_unloads_a_receiver_that_went_away(direction):
    from splitserve.transfer.sender import KVSender, StepUpdate
    from splitserve.transfer.side_channel import SideChannel
    from splitserve.transfer.state import TransferState
    from splitserve.transfer.strategy import Direction

    port = free_port()
    cache = make_cache(seed=1234)  # held while the agent lives (NIXL reads it)
    agent = make_agent(f"P-{os.getpid()}", cache)
    channel = SideChannel("127.0.0.1", port, AUTH_KEY)
    sender = KVSender(agent, channel, lease_s=5.0, direction=Direction(direction))
    sender.peers.idle_s = 1.0
    baseline = agent.peer_names()
    released: set[str] = set()

    def poll() -> None:
        released.update(sender.poll())

    receiver = subprocess.Popen(
        [sys.executable, two_process.__file__, "receive", str(port), AUTH_KEY.decode()],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sender.add_request("tid-1", 70)
        streaming = lambda: sender.state_of("tid-1") is TransferState.STREAMING  # noqa: E731
        wait_until(streaming, poll, 60.0, "D's registration")
        assert sender.peers.admitted == 1 and len(agent.peer_names()) == len(baseline) + 1
        for computed in (20, 45, 70):
            sender.begin_step([StepUpdate("tid-1", [3, 0, 7, 5, 11], computed)])
            for layer in range(two_process.NUM_LAYERS):
                sender.layer_done(layer)
            sender.end_step()
        sender.finish_request("tid-1")
        wait_until(lambda: "tid-1" in released, poll, 30.0, "the transfer's end")
        receiver.kill()
        receiver.wait()
        wait_until(
            lambda: sender.peers.admitted == 0 and agent.peer_names() == baseline,
            poll,
            30.0,
            f"P back at its baseline (admitted {sender.peers.admitted}, "
            f"agents {agent.peer_names()})",
        )
        assert sender.stats.transfers_completed == 1
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
        channel.close()
        agent.close()


def test_d_unloads_a_prefill_agent_whose_server_went_away():
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.side_channel import SideChannel

    cache = make_cache(seed=None)  # held while the agent lives (NIXL writes into it)
    agent = make_agent(f"D-{os.getpid()}", cache)
    channel = SideChannel(None, None, AUTH_KEY)
    receiver = KVReceiver(agent, channel, done_timeout_s=60, abort_ack_timeout_s=5)
    baseline = agent.peer_names()
    port = free_port()
    sender = SenderProcess("stream", port, AUTH_KEY, env={"DIRECTION": "pull"})
    try:
        sender.wait_for("ready")
        receiver.expect("tid-1", "127.0.0.1", port, BLOCKS, token_offset=0)
        assert settle(receiver, "tid-1", bound=60.0).ok
        assert len(agent.peer_names()) == len(baseline) + 1  # P's agent, for the READs
        assert sender.wait_for("end")["released"] == ["tid-1"]
        sender.proc.wait(timeout=30)  # P closed its side channel and exited
        wait_until(
            lambda: agent.peer_names() == baseline,
            receiver.poll,
            30.0,
            f"D back at its baseline (agents {agent.peer_names()})",
        )
    finally:
        sender.stop()
        channel.close()
        agent.close()
