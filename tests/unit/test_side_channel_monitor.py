"""A socket's monitor is stopped before its reader closes (side_channel._stop_monitor), against
real ZMQ: libzmq sends monitor events with a blocking send, and an event sent to a closed
reader blocks the context's I/O thread for good. With the monitor stopped first, a peer that
drops the connection and comes back on its port (events: disconnected, connected, handshake)
leaves the context working: a fresh pair in it still exchanges a message.

Before the fix the reader was closed alone; the same sequence then left the context deaf
(a fresh pair's message never arrived), which is how P's side channel stopped accepting
connections in CI (stop 28)."""

from __future__ import annotations

import contextlib
import time

import zmq

from splitserve.transfer.side_channel import _stop_monitor

EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
BOUND_MS = 5000  # a live context answers in milliseconds; a frozen one never does


def _bind_again(sock: zmq.Socket, port: int) -> None:
    """Bind ``port`` again once the old socket released it (close is asynchronous)."""
    end = time.monotonic() + 10
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError:
            assert time.monotonic() < end, f"port {port} never released"
            time.sleep(0.05)


def _context_alive(ctx: zmq.Context) -> bool:
    """A new ROUTER/DEALER pair of ``ctx`` exchanges one message within the bound."""
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for sock in (router, dealer):
            sock.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"ping")
        return bool(router.poll(BOUND_MS))
    finally:
        router.close(0)
        dealer.close(0)


def _delivered_again(dealer: zmq.Socket, peer: zmq.Socket) -> bool:
    """``dealer`` reaches ``peer`` within the bound, resending every 100 ms."""
    end = time.monotonic() + BOUND_MS / 1e3
    while time.monotonic() < end:
        with contextlib.suppress(zmq.Again):
            dealer.send(b"again", zmq.NOBLOCK)
        if peer.poll(100):
            return True
    return False


def test_a_stopped_monitor_leaves_the_context_working_when_the_peer_comes_back() -> None:
    ctx, peer_ctx = zmq.Context(), zmq.Context()
    try:
        peer = peer_ctx.socket(zmq.ROUTER)
        peer.setsockopt(zmq.LINGER, 0)
        port = peer.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        monitor = dealer.get_monitor_socket(EVENTS)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert peer.poll(BOUND_MS), "the peer never heard from the dealer"
        peer.recv_multipart()

        _stop_monitor(dealer, monitor)
        assert monitor.closed

        peer.close(0)  # the peer goes (disconnected) and comes back (connected, handshake)
        peer = peer_ctx.socket(zmq.ROUTER)
        peer.setsockopt(zmq.LINGER, 0)
        _bind_again(peer, port)
        # The events happen now, with the reconnection. Sent again until it arrives: a message
        # sent before the dealer's I/O thread saw the old connection go is written to that dead
        # connection and lost (ZMQ drops in-flight messages on a reconnect; CI met it 1 in ~100).
        assert _delivered_again(dealer, peer), "the dealer never reconnected: I/O thread blocked"

        assert _context_alive(ctx), "the context's I/O thread is blocked on a monitor event"
        dealer.close(0)
        peer.close(0)
    finally:
        ctx.destroy(0)
        peer_ctx.destroy(0)


def test_stopping_no_monitor_is_a_no_op() -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        _stop_monitor(sock, None)
        assert not sock.closed
        sock.close(0)
    finally:
        ctx.destroy(0)
