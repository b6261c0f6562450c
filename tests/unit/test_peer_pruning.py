"""NIXL peers and admissions are pruned: a side that talked to many peers over its life does not
keep every one's metadata, descriptor lists and binding forever (issue #15).

Over the fakes of ``tests/unit/fakes.py`` (they record what our logic asks of NIXL and the side
channel), extended here with what pruning asks: which peers are loaded, and their unloading.
tests/integration/test_transfer_two_process.py checks the same with real NIXL agents.
"""

from __future__ import annotations

from fakes import FakeAgent, FakeHandle
from transfer_steps import P_ADDR, announce, pull_receiver

from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef


class PruningFakeAgent(FakeAgent):
    """``FakeAgent`` that counts references to loaded peers as ``KVAgent`` does (each
    ``add_peer`` one, each ``remove_peer`` drops one, the last unloads) and tags each post
    with the peer it goes to."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refs: dict[str, int] = {}
        self.removed: list[str] = []  # unloaded, in order

    def add_peer(self, metadata, layout) -> str:
        name = super().add_peer(metadata, layout)
        self.refs[name] = self.refs.get(name, 0) + 1
        return name

    def remove_peer(self, agent_name: str) -> None:
        assert self.refs.get(agent_name, 0) > 0, f"{agent_name} removed more than added"
        self.refs[agent_name] -= 1
        if self.refs[agent_name] == 0:
            del self.refs[agent_name]
            self.removed.append(agent_name)

    def peer_names(self) -> list[str]:
        return sorted(self.refs)

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


# -- P: admitted receivers and their agents ------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admission(in_use=frozenset(), *, idle_s=100.0, max_admitted=4096):
    """A ``PeerAdmission`` over the fakes; ``in_use``: the agents live transfers reference (a
    set the test changes)."""
    from fakes import FakeChannel
    from transfer_steps import LAYOUT

    from splitserve.transfer import messages
    from splitserve.transfer.peering import PeerAdmission

    agent, channel, clock = PruningFakeAgent(LAYOUT), FakeChannel(), Clock()
    refused: list[int] = []
    peers = PeerAdmission(
        agent,
        channel,
        lambda _name: messages.HelloAck(agent_name="P"),
        lambda: refused.append(1),
        clock=clock,
        in_use=lambda: in_use,
        idle_s=idle_s,
        max_admitted=max_admitted,
    )
    return peers, agent, channel, clock


def hello(peers, inbound: bytes, name: str = "D", names: str | None = None):
    """A HELLO from agent ``name`` on connection ``inbound``; ``names``: the agent its NIXL
    metadata names, when it is not ``name``."""
    from transfer_steps import LAYOUT

    from splitserve.transfer import messages

    peers.agent.peer_name = names or name
    peer = PeerRef(inbound=inbound)
    peers.on_hello(
        peer,
        messages.Hello(
            agent_name=name, agent_metadata=b"m", layout=LAYOUT.model_dump(), target="p:1"
        ),
    )
    return peer


def star_aborts(channel) -> list[str]:
    from splitserve.transfer import messages

    return [m.reason for _, m in channel.sent if isinstance(m, messages.Abort)]


def test_p_prunes_an_idle_admission_and_unloads_its_agent():
    in_use: set[str] = set()
    peers, agent, channel, clock = admission(in_use)
    peer = hello(peers, b"conn-1")
    peers.expire()  # the sender calls it after every pass over its inbox
    assert peers.admitted == 1 and agent.peer_names() == ["D"]
    clock.now = 99.0
    peers.expire()
    assert peers.admitted == 1, "pruned before idle_s"
    clock.now = 101.0
    peers.expire()
    assert peers.agent_of(peer) is None and peers.admitted == 0
    assert agent.removed == ["D"]
    assert any("admission expired" in reason for reason in star_aborts(channel))


def test_p_keeps_an_admission_a_live_transfer_uses_and_counts_idle_from_its_end():
    in_use = {"D"}
    peers, agent, channel, clock = admission(in_use)
    hello(peers, b"conn-1")
    for t in (50.0, 150.0, 250.0):
        clock.now = t
        peers.expire()
    assert peers.admitted == 1 and agent.removed == []
    in_use.clear()  # the last transfer ended at about 250 s
    clock.now = 340.0
    peers.expire()
    assert peers.admitted == 1
    clock.now = 360.0
    peers.expire()
    assert peers.admitted == 0 and agent.removed == ["D"]


def test_p_refreshes_an_admission_on_every_registration():
    peers, agent, channel, clock = admission()
    peer = hello(peers, b"conn-1")
    clock.now = 90.0
    assert peers.agent_of(peer) == "D"  # a REGISTER's check: the connection is in use
    clock.now = 150.0
    peers.expire()
    assert peers.agent_of(peer) == "D"


def test_p_unloads_an_agent_only_when_its_last_connection_went():
    peers, agent, channel, clock = admission()
    first = hello(peers, b"conn-1")
    peers.expire()
    clock.now = 60.0
    peers.admit(PeerRef(inbound=b"conn-2"), "D")  # the agent confirmed a second connection
    peers.expire()
    clock.now = 101.0
    peers.expire()
    assert peers.agent_of(first) is None and agent.removed == []
    clock.now = 161.0
    peers.expire()
    assert agent.removed == ["D"] and peers.admitted == 0


def test_p_bounds_admitted_connections_and_refuses_hello_beyond():
    peers, agent, channel, clock = admission(max_admitted=2)
    hello(peers, b"conn-1")
    hello(peers, b"conn-2", "D2")
    loaded = len(agent.peers_added)
    third = hello(peers, b"conn-3", "D3")
    assert peers.agent_of(third) is None
    assert len(agent.peers_added) == loaded, "metadata loaded for a refused HELLO"
    assert any("too many" in reason for reason in star_aborts(channel))
    clock.now = 101.0  # both idle: pruned before the next HELLO is refused
    fourth = hello(peers, b"conn-4", "D4")
    assert peers.agent_of(fourth) is not None and peers.admitted == 1


def test_p_unloads_an_agent_loaded_for_a_refused_hello_but_never_an_admitted_one():
    peers, agent, channel, clock = admission()
    hello(peers, b"conn-1", "D", names="Mallory")  # refused: the metadata names another agent
    clock.now = 2.0
    peers.expire()
    assert agent.removed == ["Mallory"]
    peers2, agent2, _, clock2 = admission()
    hello(peers2, b"conn-1", "D")
    hello(peers2, b"conn-x", "E", names="D")  # names the admitted D: refused, D stays loaded
    clock2.now = 2.0
    peers2.expire()
    assert agent2.removed == [] and agent2.peer_names() == ["D"]
