"""The control side channel: HELLO / REGISTER / ABORT between a sender and its receivers, on ZMQ.

Runs one I/O thread per process that owns every ZMQ socket: a ROUTER bound to the configured
host and port (peers that contact us) and one DEALER per peer address we contact. Callers in
other threads ``send`` (queued, then the thread is woken through an inproc socket) and drain
what arrived per role: ``receive_bound`` (the sender's inbox: HELLO, REGISTER, ABORT from
receivers) and ``receive_connected`` (the receiver's inbox: answers from senders and
``PeerLost``). A socket monitor on each DEALER turns the peer's TCP disconnect (its process
died) into a ``PeerLost`` event within milliseconds.

Why ZMQ and not NIXL notifications for control: measured here (tests/integration/
test_transfer_two_process.py prints it), a ZMQ round trip on loopback costs tens of
microseconds in any UCX error mode, while a NIXL notification costs milliseconds in UCX's
``peer`` error mode, the mode that reports a dead peer on WRITE. The per-layer data path needs
no control message in the push strategy; DONE rides on the last WRITE as a NIXL notification so
that it is ordered after the data. In the pull strategy the per-layer ANNOUNCEs, DONE and D's
PULLED travel here: one ROUTER/DEALER connection delivers a peer's messages in order, so DONE
arrives after the ANNOUNCEs it closes.

First-token relay: P's engine sends a ``FIRST_TOKEN`` to its own worker's bound socket right
after sampling; the I/O thread forwards it, as received, to the receiver named for that transfer
(``relay_first_token``, set by the sender when D registered), without waiting for the thread
that owns the sender's state. Queued behind what that thread already sent, so it follows the
transfer's ANNOUNCEs. A ``FIRST_TOKEN`` with no route is dropped (the engine sends one for every
finished request; only D's asking for the token have a route).

Invariants:
- Messages that fail authentication or validation never reach the caller: they are counted
  in ``rejected`` and logged with the reason.
- The I/O thread never raises out of its loop on a bad peer; ``close`` stops it and closes
  every socket with linger 0.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.transfer import messages

logger = logging.getLogger(__name__)

_POLL_MS = 100


@dataclass(frozen=True)
class PeerRef:
    """Whom a message came from or goes to: a ROUTER identity (``inbound``) or an address."""

    inbound: bytes | None = None
    host: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if self.host else f"peer#{(self.inbound or b'').hex()}"


@dataclass(frozen=True)
class Inbound:
    peer: PeerRef
    message: messages.Message


@dataclass(frozen=True)
class PeerLost:
    peer: PeerRef


class SideChannel:
    """ZMQ control channel (see module docstring)."""

    def __init__(
        self,
        bind_host: str | None,
        bind_port: int | None,
        auth_key: bytes | None = None,
        name: str = "splitserve-side-channel",
    ) -> None:
        self.auth_key = auth_key
        self.rejected = 0
        self._ctx = zmq.Context()
        self._outbox: collections.deque[tuple[PeerRef, bytes]] = collections.deque()
        # Two inboxes, one per role: what arrives on the bound ROUTER (peers that contact us:
        # the sender's side) and what arrives on our DEALERs (answers from peers we contacted,
        # and their loss: the receiver's side). Each role drains only its own.
        self._inbox_bound: collections.deque[Inbound] = collections.deque()
        self._inbox_connected: collections.deque[Inbound | PeerLost] = collections.deque()
        self._wake_lock = threading.Lock()
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._router: zmq.Socket | None = None
        self.bound_port: int | None = None
        if bind_host is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            if bind_port:
                self._router.bind(f"tcp://{bind_host}:{bind_port}")
                self.bound_port = bind_port
            else:
                self.bound_port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self._dealers: dict[tuple[str, int], zmq.Socket] = {}
        # transfer id -> receiver a FIRST_TOKEN is forwarded to (set/cleared by the sender's
        # thread, read by the I/O thread: single dict operations, atomic under the GIL)
        self._first_token_routes: dict[str, PeerRef] = {}
        self.relayed = 0
        self._monitors: dict[zmq.Socket, PeerRef] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- caller side -------------------------------------------------------------------------

    def send(self, peer: PeerRef, message) -> None:
        """Queue ``message`` for ``peer`` (thread-safe; returns at once)."""
        self._outbox.append((peer, messages.encode(message, self.auth_key)))
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)

    def relay_first_token(self, transfer_id: str, peer: PeerRef | None) -> None:
        """Forward ``FIRST_TOKEN`` messages for ``transfer_id`` that arrive on the bound socket
        to ``peer`` from the I/O thread (``None``: stop; unknown ids are dropped)."""
        if peer is None:
            self._first_token_routes.pop(transfer_id, None)
        else:
            self._first_token_routes[transfer_id] = peer

    def receive_bound(self) -> list[Inbound]:
        """Messages from peers that contacted us (on the bound socket) since the last call."""
        return self._drain(self._inbox_bound)

    def receive_connected(self) -> list[Inbound | PeerLost]:
        """Answers from peers we contacted, and their loss, since the last call."""
        return self._drain(self._inbox_connected)

    @staticmethod
    def _drain(inbox: collections.deque) -> list:
        out = []
        while inbox:
            out.append(inbox.popleft())
        return out

    def close(self) -> None:
        self._stop.set()
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_send.close(0)
        self._ctx.destroy(linger=0)

    # -- I/O thread --------------------------------------------------------------------------

    def _dealer(self, host: str, port: int) -> zmq.Socket:
        sock = self._dealers.get((host, port))
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(f"tcp://{host}:{port}")
            self._dealers[(host, port)] = sock
            self._monitors[monitor] = PeerRef(host=host, port=port)
        return sock

    def _accept(self, peer: PeerRef, wire: bytes) -> None:
        try:
            message = messages.decode(wire, self.auth_key)
        except messages.MessageError as exc:
            self.rejected += 1
            logger.warning("side channel: rejected a message from %s: %s", peer, exc)
            return
        if isinstance(message, messages.FirstToken) and peer.inbound is not None:
            route = self._first_token_routes.get(message.transfer_id)
            if route is not None:  # in the outbox behind what the sender already queued
                self._outbox.append((route, wire))
                self.relayed += 1
            return
        inbox = self._inbox_bound if peer.inbound is not None else self._inbox_connected
        inbox.append(Inbound(peer, message))

    def _flush_outbox(self) -> None:
        while self._outbox:
            peer, wire = self._outbox.popleft()
            if peer.inbound is not None:
                if self._router is None:
                    logger.error("side channel: reply to %s without a bound socket", peer)
                    continue
                self._router.send_multipart([peer.inbound, wire])
            else:
                assert peer.host is not None and peer.port is not None
                self._dealer(peer.host, peer.port).send(wire)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        registered: set[zmq.Socket] = set()
        while not self._stop.is_set():
            for sock in list(self._dealers.values()) + list(self._monitors):
                if sock not in registered:
                    poller.register(sock, zmq.POLLIN)
                    registered.add(sock)
            try:
                events = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.error("side channel poll failed: %s", exc)
                continue
            if self._wake_recv in events:
                while True:
                    try:
                        self._wake_recv.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._router is not None and self._router in events:
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        self.rejected += 1
                        logger.warning("side channel: dropped a %d-frame message", len(frames))
                        continue
                    self._accept(PeerRef(inbound=frames[0]), frames[1])
            for (host, port), sock in self._dealers.items():
                if sock in events:
                    while True:
                        try:
                            wire = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._accept(PeerRef(host=host, port=port), wire)
            for monitor, peer in self._monitors.items():
                if monitor in events:
                    while True:
                        try:
                            event = recv_monitor_message(monitor, zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if event["event"] == zmq.EVENT_DISCONNECTED:
                            logger.warning("side channel: lost connection to %s", peer)
                            self._inbox_connected.append(PeerLost(peer))
            self._flush_outbox()
        for sock in list(self._dealers.values()) + list(self._monitors):
            sock.close(0)
        if self._router is not None:
            self._router.close(0)
        self._wake_recv.close(0)
