"""A connection the sender answers late, against real ZMQ sockets on loopback: the receiver's
DEALER was opened while the sender's port was closed (a P restarting), the port opens near the
end of ``connect_timeout_s``, and the CurveZMQ handshake then takes a while (a P busy starting
up answers its ZAP requests late). The connection must not be dropped as unreachable while its
handshake is under way; what was queued behind it arrives once it completes."""

from __future__ import annotations

import time

from splitserve.netutil import free_port
from splitserve.transfer import auth, messages
from splitserve.transfer.side_channel import Inbound, PeerLost, PeerRef, SideChannel

KEY = b"k" * 32
CONNECT_S = 3.0


def test_a_handshake_that_completes_after_the_first_window_keeps_its_connection(monkeypatch):
    answer = auth._ClientKeyCheck.callback

    def slow_zap(self, domain: str, client_key: bytes) -> bool:
        time.sleep(2.0)  # the port opened at 2 s: the handshake completes near 4 s
        return answer(self, domain, client_key)

    monkeypatch.setattr(auth._ClientKeyCheck, "callback", slow_zap)
    port = free_port()
    d = SideChannel(None, None, KEY, connect_timeout_s=CONNECT_S)
    p = None
    try:
        d.send(PeerRef(host="127.0.0.1", port=port), messages.AbortAck(transfer_id="t"))
        time.sleep(CONNECT_S - 1.0)
        p = SideChannel("127.0.0.1", port, KEY)
        got: list = []
        lost: list = []
        end = time.monotonic() + 3 * CONNECT_S
        while not got and time.monotonic() < end:
            got += [e for e in p.receive_bound() if isinstance(e, Inbound)]
            lost += [e for e in d.receive_connected() if isinstance(e, PeerLost)]
            time.sleep(0.05)
        lost += [e for e in d.receive_connected() if isinstance(e, PeerLost)]
        assert not lost, f"dropped while its handshake ran: {lost}"
        assert [e.message for e in got] == [messages.AbortAck(transfer_id="t")]
    finally:
        d.close()
        if p is not None:
            p.close()


def test_a_port_that_stays_closed_is_still_unreachable_within_the_bound():
    """The other side of the bound: nothing listens, the DEALER is dropped and reported."""
    d = SideChannel(None, None, KEY, connect_timeout_s=CONNECT_S)
    try:
        peer = PeerRef(host="127.0.0.1", port=free_port())
        d.send(peer, messages.AbortAck(transfer_id="t"))
        lost: list = []
        end = time.monotonic() + CONNECT_S + 3.5
        while not lost and time.monotonic() < end:
            lost += [e for e in d.receive_connected() if isinstance(e, PeerLost)]
            time.sleep(0.05)
        assert [e.peer for e in lost] == [peer] and "unreachable" in lost[0].reason
    finally:
        d.close()
