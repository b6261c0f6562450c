"""NIXL peers and admissions are pruned: a side that talked to many peers over its life does not
keep every one's metadata, descriptor lists and binding forever (issue #15).

Over the fakes of ``tests/unit/fakes.py`` (they record what our logic asks of NIXL and the side
channel), extended here with what pruning asks: which peers are loaded, and their unloading.
tests/integration/test_transfer_two_process.py checks the same with real NIXL agents.
"""

from __future__ import annotations

from fakes import FakeAgent, FakeHandle
from transfer_steps import P_ADDR, announce, pull_receiver

from splitserve.transfer.side_channel import Inbound, PeerLost


class PruningFakeAgent(FakeAgent):
    """``FakeAgent`` that keeps the set of loaded peers as ``KVAgent`` does (``add_peer``,
    ``remove_peer``, ``peer_names``) and tags each post with the peer it goes to."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: set[str] = set()
        self.removed: list[str] = []

    def add_peer(self, metadata, layout) -> str:
        name = super().add_peer(metadata, layout)
        self.loaded.add(name)
        return name

    def remove_peer(self, agent_name: str) -> None:
        if agent_name in self.loaded:
            self.loaded.discard(agent_name)
            self.removed.append(agent_name)

    def peer_names(self) -> list[str]:
        return sorted(self.loaded)

    def post(self, op, peer, layers, local, remote, notif=b"") -> FakeHandle:
        handle = super().post(op, peer, layers, local, remote, notif)
        handle.peer = peer
        return handle


def pruning_pull_receiver():
    receiver, agent, channel, ack = pull_receiver()
    fake = PruningFakeAgent(agent.layout, peer_name="P")
    receiver.agent = receiver._pull.agent = receiver._push.agent = fake
    return receiver, fake, channel, ack


# -- D: the agents of the Ps it pulled from ------------------------------------------------------


def test_d_unloads_a_lost_prefill_agent_once_its_reads_settled():
    receiver, agent, channel, ack = pruning_pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4, 5], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    receiver.poll()
    assert agent.peer_names() == ["P"]
    announce(channel, "t", [0], [10, 11], [4, 5])
    receiver.poll()
    (read,) = agent.posted
    channel.inbox.append(PeerLost(P_ADDR))
    receiver.poll()
    receiver.poll()
    assert agent.peer_names() == ["P"], "unloaded while a READ from it was in flight"
    read.state = "DONE"
    settled = receiver.poll()
    assert not settled["t"].ok  # the load failed with its connection
    receiver.poll()
    assert agent.peer_names() == [] and agent.removed == ["P"]


def test_d_keeps_an_agent_whose_prefill_server_reconnected():
    receiver, agent, channel, ack = pruning_pull_receiver()
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    receiver.poll()
    channel.inbox += [PeerLost(P_ADDR), Inbound(P_ADDR, ack)]  # lost, then offered pull again
    for _ in range(3):
        receiver.poll()
    assert agent.peer_names() == ["P"] and agent.removed == []


def test_d_unloads_an_agent_loaded_under_another_name_than_announced():
    receiver, agent, channel, ack = pruning_pull_receiver()
    agent.peer_name = "Mallory"  # the metadata names another agent than the HELLO_ACK
    receiver.expect("t", "127.0.0.1", 1, [4], 0)
    channel.inbox.append(Inbound(P_ADDR, ack))
    receiver.poll()
    receiver.poll()
    assert agent.removed == ["Mallory"] and agent.peer_names() == []
