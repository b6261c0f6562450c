"""Fakes of the NIXL agent and the side channel, shared by the unit tests of splitserve.transfer.

They only record what our transfer logic asks of them (no NIXL, no sockets), so a test drives a
``KVSender`` or ``KVReceiver`` step by step and reads back what was posted and sent. The real
agent and channel are tested between real processes in ``tests/integration``.

Imported as ``from fakes import ...``: pytest puts ``tests/unit`` (a folder without
``__init__.py``) on ``sys.path`` for the modules it collects there.
"""

from __future__ import annotations

from types import SimpleNamespace

from splitserve.transfer.agent import KVAgent
from splitserve.transfer.layout import KVLayout
from splitserve.transfer.side_channel import Inbound, PeerLost


class FakeHandle:
    """A posted transfer: ``copies`` are (layer, local block, remote block) triples; a test
    settles it by setting ``state`` to ``"DONE"`` (or ``"ERR"``)."""

    def __init__(
        self, op: str, copies: list[tuple[int, int, int]], notif: bytes, num_bytes: int
    ) -> None:
        self.op, self.copies, self.notif, self.num_bytes = op, copies, notif, num_bytes
        self.state = "PROC"
        self.peer = "D"


class FakeAgent:
    """Stands in for ``splitserve.transfer.agent.KVAgent`` over one local ``layout``.

    ``post`` validates every block id against its layer as the real agent does, so a test fails
    when our logic would read or write outside the cache. The remote peer ``"D"`` has the same
    layout. ``peer_name`` is what ``add_peer`` answers (the name of the next peer added).
    """

    name = "P"

    def __init__(self, layout: KVLayout, peer_name: str = "D") -> None:
        self.layout = layout
        self.peer_name = peer_name
        self.posted: list[FakeHandle] = []
        self.notifs: dict[str, list[bytes]] = {}  # what ``notifications`` hands out next
        self.peers_added: list[bytes] = []
        self.holds = 0  # hold_progress minus drop_progress
        self.urgent = 0  # of which urgent
        self.lingered: float | None = None
        self._peers = {"D": SimpleNamespace(layout=layout)}  # as KVAgent keeps its peers

    def add_peer(self, metadata: bytes, layout: KVLayout) -> str:
        self.peers_added.append(metadata)
        return self.peer_name

    def post(self, op, peer, layers, local, remote, notif=b""):
        for layer, src, dst in zip(layers, local, remote, strict=True):
            self.layout.validate_block_ids([src], "local", layer)
            self.layout.validate_block_ids([dst], "remote", layer)
        num_bytes = sum(self.layout.layers[layer].block_bytes for layer in layers)
        handle = FakeHandle(op, list(zip(layers, local, remote, strict=True)), notif, num_bytes)
        self.posted.append(handle)
        return handle

    def hold_progress(self, urgent: bool = False) -> None:
        self.holds += 1
        self.urgent += urgent

    def drop_progress(self, urgent: bool = False) -> None:
        self.holds -= 1
        self.urgent -= urgent

    def linger_progress(self, seconds: float) -> None:
        self.lingered = seconds

    def peer_layout(self, agent_name: str) -> KVLayout | None:
        peer = self._peers.get(agent_name)
        return peer.layout if peer is not None else None

    def check(self, handle: FakeHandle) -> str:
        return handle.state

    settle = KVAgent.settle  # the real one: it only calls check and release

    def release(self, handle: FakeHandle) -> bool:
        handle.released = True
        return True

    abandon = KVAgent.abandon  # the real one: it only calls release

    def metadata(self) -> bytes:
        return b"meta"

    def notifications(self) -> dict[str, list[bytes]]:
        out, self.notifs = self.notifs, {}
        return out


class FakeChannel:
    """Stands in for ``splitserve.transfer.side_channel.SideChannel``.

    A test appends events to ``inbox``; ``receive_bound`` hands out those that came in on a
    connection a peer opened to us (an ``Inbound`` whose peer has an ``inbound`` id),
    ``receive_connected`` the rest. ``sent`` records (peer, message) pairs; ``routes`` the
    FIRST_TOKEN relay (transfer id -> D).
    """

    auth_key = None

    def __init__(self) -> None:
        self.inbox: list = []
        self.sent: list = []
        self.routes: dict = {}
        self.owned: set = set()  # (routing id, target) pairs ``owns`` answers True for

    @staticmethod
    def _bound(event) -> bool:
        return isinstance(event, Inbound | PeerLost) and bool(event.peer.inbound)

    def owns(self, routing_id: bytes, target: str | None = None) -> bool:
        return (routing_id, target) in self.owned or (routing_id, None) in self.owned

    def receive_bound(self) -> list:
        out = [e for e in self.inbox if self._bound(e)]
        self.inbox = [e for e in self.inbox if not self._bound(e)]
        return out

    def receive_connected(self) -> list:
        out = [e for e in self.inbox if not self._bound(e)]
        self.inbox = [e for e in self.inbox if self._bound(e)]
        return out

    def send(self, peer, message) -> None:
        self.sent.append((peer, message))

    def relay_first_token(self, transfer_id: str, peer) -> None:
        if peer is None:
            self.routes.pop(transfer_id, None)
        else:
            self.routes[transfer_id] = peer
