"""The control side channel: HELLO / REGISTER / ABORT between a sender and its receivers, on ZMQ.

Runs one I/O thread per process that owns every ZMQ socket: a ROUTER bound to the configured
host and port (peers that contact us) and one DEALER per peer address we contact. Callers in
other threads ``send`` (queued, then the thread is woken through an inproc socket) and drain
what arrived per role: ``receive_bound`` (the sender's inbox: HELLO, REGISTER, ABORT from
receivers) and ``receive_connected`` (the receiver's inbox: answers from senders and
``PeerLost``). A socket monitor on each DEALER turns the peer's disconnect (its process died,
its heartbeats stopped, or its handshake refused our key) into a ``PeerLost`` event.

Why one module of over 500 lines: ZMQ sockets are not thread-safe, so one I/O thread owns
every socket, and the lifecycle of each (open, monitor, read, prune, drop) is that thread's; the
message format and authentication live beside it (``messages``, ``auth``).

Why ZMQ and not NIXL notifications for control: a ZMQ round trip on loopback costs tens of
microseconds in any UCX error mode, while a NIXL notification costs milliseconds in UCX's
``peer`` error mode, the mode that reports a dead peer on WRITE (docs/benchmarks.md; the
two-process integration test prints both). The per-layer data path needs no control message in
the push strategy; DONE rides on the last WRITE as a NIXL notification so that it is ordered
after the data. In the pull strategy the per-layer ANNOUNCEs, DONE and D's PULLED travel here:
one ROUTER/DEALER connection delivers a peer's messages in order, so DONE arrives after the
ANNOUNCEs it closes.

Security (docs/security.md has the threat model): with an ``auth_key`` every connection is a
CurveZMQ session (``auth.py`` derives the key pairs from the shared key): a peer without the key
cannot complete the handshake, so none of its bytes reach the decoder, and the session's
ephemeral keys and nonces make a recorded message useless on any other connection (and
encrypted on the wire, so NIXL metadata is not readable by a passive observer). Every message
also carries its HMAC (``messages``). Without a key the channel is open to anyone who reaches
the port: the connector refuses that on a non-loopback address unless told ``insecure``.

First-token relay: P's engine sends a ``FIRST_TOKEN`` to its own worker's bound socket right
after sampling; the I/O thread forwards it, as received, to the receiver named for that transfer
(``relay_first_token``, set by the sender when D registered), without waiting for the thread
that owns the sender's state. Queued behind what that thread already sent, so it follows the
transfer's ANNOUNCEs. A ``FIRST_TOKEN`` with no route is dropped (the engine sends one for every
finished request; only D's asking for the token have a route).

Invariants:
- Nothing a peer sends stops the channel: frames above ``messages.MAX_MESSAGE_BYTES`` are
  dropped by ZMQ (``MAXMSGSIZE``); a message that fails authentication or validation, whatever
  the exception, never reaches the caller: it is counted in ``rejected`` and logged once per
  peer with the reason.
- No send blocks the I/O thread: a DEALER whose peer stopped reading fills its bounded queue,
  then the channel drops that connection and reports ``PeerLost`` (its transfers fail) instead
  of stalling every other peer.
- A DEALER that cannot connect within ``connect_timeout_s`` (and, once connected, complete its
  handshake within another ``connect_timeout_s``), whose heartbeats go unanswered for
  ``liveness_timeout_s`` (a silent partition), or that sat unused for ``idle_close_s`` is closed
  with its monitor and reported as ``PeerLost``; the next ``send`` to that address reconnects.
- No side-channel thread shares the engine's pinned core: the I/O thread, the ZAP thread and
  libzmq's own threads are started with the process's whole CPU set (``_unpinned``), not the
  one core a CPU engine binds its compute thread to (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``:
  libgomp pins the thread that imports torch, and every thread it starts later inherits that
  core). Heartbeats, handshakes and the inbox then keep their bounds while that core is busy.
  Each connection also buffers as many inbound messages as its peer may queue (``RCVHWM``): a
  reader that lags keeps decoding, so its heartbeats are still seen (libzmq stops reading a
  connection whose inbound queue is full, and then drops it as silent at
  ``liveness_timeout_s`` although the peer answers).
- A monitored socket's monitor is stopped before its reader is closed (``_stop_monitor``):
  libzmq sends monitor events with a blocking send, and one sent to a closed reader froze the
  context's I/O thread for good (P's side channel stopped accepting and answering heartbeats
  while its own thread looked idle; found by CI, stop 28).
- The I/O thread is supervised: an unexpected exception in one round is logged and the loop goes
  on; if the thread ends for any other reason than ``close``, ``failure`` says why and ``check``
  raises it (the adapters call it every step, so the engine stops serving instead of answering
  200 on ``/health`` with a dead channel).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.transfer import messages
from splitserve.transfer.auth import CurveKeys, PeerLog, start_authenticator

logger = logging.getLogger(__name__)

_POLL_MS = 100
_SNDHWM = 10_000  # messages queued per connection before the channel gives up on that peer
_RCVHWM = _SNDHWM  # messages buffered per inbound connection: what a peer may queue to us
_MAX_FRAME = 1 + 32 + messages.MAX_MESSAGE_BYTES
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _all_cpus() -> set[int] | None:
    """Every CPU this process may run on: the kernel trims the request to the process's cpuset
    (a container's limit stays a limit; a thread pin set by ``taskset`` or libgomp does not).
    ``None`` where threads cannot be re-pinned (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    return set(range(os.cpu_count() or 1))


@contextlib.contextmanager
def _unpinned() -> Iterator[None]:
    """Run the block with the calling thread on every CPU (``_all_cpus``), then put its own
    affinity back: threads (and libzmq's I/O threads) started inside inherit the whole set
    instead of the engine's pinned core. The caller's thread is widened only for the block."""
    cpus = _all_cpus()
    own = os.sched_getaffinity(0) if cpus is not None else None
    if cpus is not None and own is not None and cpus != own:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:  # a policy forbids it: the channel works, as pinned as its caller
            logger.warning("side channel: its threads stay on CPUs %s: %s", sorted(own), exc)
            own = None
    else:
        own = None
    try:
        yield
    finally:
        if own is not None:
            os.sched_setaffinity(0, own)


def _stop_monitor(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Stop ``sock``'s monitor, then close its reader (the socket stays open).

    libzmq's I/O thread writes a monitored socket's events to the monitor with a blocking send.
    A reader closed while the socket can still emit (a reconnection under way, an engine torn
    down after ``close``, which is asynchronous) leaves that send without a peer, and it blocks
    the I/O thread for good: every socket of the context goes deaf (no accept, no handshake, no
    heartbeat), though the channel's own thread looks idle. ``disable_monitor`` stops the
    events under libzmq's monitor lock before the reader goes (tests/unit/
    test_side_channel_monitor.py)."""
    if monitor is None:
        return
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close(0)


def _close_monitored(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a monitored socket: its monitor first (``_stop_monitor``), then the socket."""
    _stop_monitor(sock, monitor)
    sock.close(0)


class SideChannelDead(RuntimeError):
    """The side channel's I/O thread ended unexpectedly; no control message moves any more."""


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
    """The connection to ``peer`` is gone; ``reason`` says why (for logs and failed loads)."""

    peer: PeerRef
    reason: str = "connection lost"


@dataclass
class _Dealer:
    """One connection we opened, with its monitor and the clocks that prune it."""

    peer: PeerRef
    sock: zmq.Socket
    monitor: zmq.Socket
    opened: float  # when created, or when its TCP connection was made (the handshake's window)
    last_used: float
    handshaken: bool = False


@dataclass
class ChannelStats:
    rejected: int = 0  # messages refused (bad MAC, malformed, oversized, extra frames)
    refused_handshakes: int = 0  # connections whose CurveZMQ handshake failed (key mismatch)
    dropped_peers: dict[str, int] = field(default_factory=dict)  # reason -> connections closed


class SideChannel:
    """ZMQ control channel (see module docstring)."""

    def __init__(
        self,
        bind_host: str | None,
        bind_port: int | None,
        auth_key: bytes | None = None,
        name: str = "splitserve-side-channel",
        *,
        connect_timeout_s: float = 5.0,
        liveness_timeout_s: float = 5.0,
        idle_close_s: float = 600.0,
    ) -> None:
        self.auth_key = auth_key
        self.stats = ChannelStats()
        self.relayed = 0
        self.failure: str | None = None
        self.connect_timeout_s = connect_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self.idle_close_s = idle_close_s
        self._curve = CurveKeys.derive(auth_key) if auth_key else None
        self._peer_log = PeerLog(logger)
        with _unpinned():  # every thread this channel starts: see the module docstring
            self._start(bind_host, bind_port, name)

    def _start(self, bind_host: str | None, bind_port: int | None, name: str) -> None:
        self._ctx = zmq.Context()  # its I/O threads start with the first socket, below
        self._authenticator = None
        self._outbox: collections.deque[tuple[PeerRef, bytes]] = collections.deque()
        # Two inboxes, one per role: what arrives on the bound ROUTER (peers that contact us:
        # the sender's side) and what arrives on our DEALERs (answers from peers we contacted,
        # and their loss: the receiver's side). Each role drains only its own.
        self._inbox_bound: collections.deque[Inbound | PeerLost] = collections.deque()
        self._inbox_connected: collections.deque[Inbound | PeerLost] = collections.deque()
        self._wake_lock = threading.Lock()
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(self._wake_addr)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(self._wake_addr)
        self._router: zmq.Socket | None = None
        self._router_monitor: zmq.Socket | None = None
        self.bound_port: int | None = None
        if bind_host is not None:
            self._open_router(bind_host, bind_port)
        self._dealers: dict[tuple[str, int], _Dealer] = {}
        # transfer id -> receiver a FIRST_TOKEN is forwarded to (set/cleared by the sender's
        # thread, read by the I/O thread: single dict operations, atomic under the GIL)
        self._first_token_routes: dict[str, PeerRef] = {}
        # The routing id of each address we dial: random, kept for the process's life, so a
        # reconnection hands the same id over and nobody else can speak on our connection
        # (the sender binds our agent to it: ``peering``). Written by the I/O thread only.
        self._routing_ids: dict[tuple[str, int], bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)
        self._thread.start()

    @property
    def rejected(self) -> int:
        """Everything refused: messages, and connections whose handshake failed."""
        return self.stats.rejected + self.stats.refused_handshakes

    # -- caller side -------------------------------------------------------------------------

    def send(self, peer: PeerRef, message) -> None:
        """Queue ``message`` for ``peer`` (thread-safe; returns at once)."""
        self._outbox.append((peer, messages.encode(message, self.auth_key)))
        self._wake()

    def relay_first_token(self, transfer_id: str, peer: PeerRef | None) -> None:
        """Forward ``FIRST_TOKEN`` messages for ``transfer_id`` that arrive on the bound socket
        to ``peer`` from the I/O thread (``None``: stop; unknown ids are dropped)."""
        if peer is None:
            self._first_token_routes.pop(transfer_id, None)
        else:
            self._first_token_routes[transfer_id] = peer

    def owns(self, routing_id: bytes, target: str | None = None) -> bool:
        """True when ``routing_id`` is the id of a connection we dial (to ``target``, given as
        ``host:port``, when named): how a receiver answers a sender's ``Confirm``."""
        for (host, port), ours in list(self._routing_ids.items()):
            if ours == routing_id and (target is None or target == f"{host}:{port}"):
                return True
        return False

    def receive_bound(self) -> list[Inbound | PeerLost]:
        """Messages from peers that contacted us (on the bound socket) since the last call,
        and ``PeerLost`` for a peer a reply found gone."""
        return self._drain(self._inbox_bound)

    def receive_connected(self) -> list[Inbound | PeerLost]:
        """Answers from peers we contacted, and their loss, since the last call."""
        return self._drain(self._inbox_connected)

    def check(self) -> None:
        """Raise ``SideChannelDead`` if the I/O thread ended without ``close``."""
        if self.failure is not None:
            raise SideChannelDead(f"splitserve side channel stopped: {self.failure}")

    @staticmethod
    def _drain(inbox: collections.deque) -> list:
        out = []
        while inbox:
            out.append(inbox.popleft())
        return out

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_send.closed:
                # thousands of wakes pending (a burst of sends): the I/O thread is due anyway
                with contextlib.suppress(zmq.Again):
                    self._wake_send.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_send.close(0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._ctx.destroy(linger=0)

    # -- sockets -----------------------------------------------------------------------------

    def _common_options(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # ZMTP heartbeats, answered by libzmq's own threads (no GIL): a peer that stops
        # answering for liveness_timeout_s (a silent partition) is disconnected.
        ivl_ms = max(100, int(self.liveness_timeout_s * 1000) // 5)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.liveness_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.liveness_timeout_s * 1000))

    def _open_router(self, host: str, port: int | None) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        self._common_options(router)
        # A receiver that reconnects (after a partition, before our side noticed the old
        # connection is dead) takes its routing id over instead of being refused until then.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A reply to a routing id with no connection raises instead of vanishing: the sender
        # learns that peer is gone (``PeerLost`` in ``receive_bound``) and drops its binding.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self._curve is not None:
            self._authenticator = start_authenticator(self._ctx, self._curve, self._peer_log)
            self._curve.apply_server(router)
        self._router_monitor = router.get_monitor_socket(_HANDSHAKE_FAILED)
        if port:
            router.bind(f"tcp://{host}:{port}")
            self.bound_port = port
        else:
            self.bound_port = router.bind_to_random_port(f"tcp://{host}")
        self._router = router

    def _dealer(self, host: str, port: int) -> _Dealer:
        dealer = self._dealers.get((host, port))
        if dealer is None:
            sock = self._ctx.socket(zmq.DEALER)
            self._common_options(sock)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, int(self.connect_timeout_s * 1000))
            identity = self._routing_ids.setdefault((host, port), messages.new_routing_id())
            sock.setsockopt(zmq.ROUTING_ID, identity)
            if self._curve is not None:
                self._curve.apply_client(sock)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | _HANDSHAKE_FAILED
            )
            sock.connect(f"tcp://{host}:{port}")
            now = time.monotonic()
            dealer = _Dealer(PeerRef(host=host, port=port), sock, monitor, now, now)
            self._dealers[(host, port)] = dealer
        return dealer

    def _drop_dealer(self, dealer: _Dealer, reason: str, *, log: bool = True) -> None:
        """Close one connection we opened and tell the receiver its peer is gone."""
        assert dealer.peer.host is not None and dealer.peer.port is not None
        self._dealers.pop((dealer.peer.host, dealer.peer.port), None)
        _close_monitored(dealer.sock, dealer.monitor)
        kind = reason.split(":")[0]
        self.stats.dropped_peers[kind] = self.stats.dropped_peers.get(kind, 0) + 1
        if log and not self._peer_log.warn(
            str(dealer.peer), kind, "side channel: %s: %s", dealer.peer, reason
        ):  # a peer we dial (not a stranger): every loss stays in the log, at INFO once warned
            logger.info("side channel: %s: %s", dealer.peer, reason)
        self._inbox_connected.append(PeerLost(dealer.peer, reason))

    # -- I/O thread --------------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the thread's end is reported, never silent
            if not self._stop.is_set():
                self.failure = f"I/O thread died: {exc!r}"
                logger.critical("side channel: %s", self.failure, exc_info=True)
        finally:
            self._close_sockets()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
            assert self._router_monitor is not None
            poller.register(self._router_monitor, zmq.POLLIN)
        registered: dict[zmq.Socket, _Dealer] = {}
        next_prune = time.monotonic() + 1.0
        while not self._stop.is_set():
            try:
                self._sync_poller(poller, registered)
                events = dict(poller.poll(_POLL_MS))
                self._round(events, registered)
                if time.monotonic() >= next_prune:
                    self._prune()
                    next_prune = time.monotonic() + 1.0
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.error("side channel: ZMQ error in the I/O loop: %s", exc)
            except Exception:  # one bad round must not end the channel for every peer
                logger.exception("side channel: unexpected error in the I/O loop; continuing")

    def _sync_poller(self, poller: zmq.Poller, registered: dict[zmq.Socket, _Dealer]) -> None:
        live = {}
        for dealer in self._dealers.values():
            live[dealer.sock] = dealer
            live[dealer.monitor] = dealer
        for sock in list(registered):
            if sock not in live:
                poller.unregister(sock)
                del registered[sock]
        for sock, dealer in live.items():
            if sock not in registered:
                poller.register(sock, zmq.POLLIN)
                registered[sock] = dealer

    def _round(self, events: dict, registered: dict[zmq.Socket, _Dealer]) -> None:
        if self._wake_recv in events:
            while True:
                try:
                    self._wake_recv.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        if self._router is not None and self._router in events:
            self._read_router()
        if self._router_monitor is not None and self._router_monitor in events:
            self._read_router_monitor()
        for sock in [s for s in events if s in registered]:
            dealer = registered[sock]
            if (dealer.peer.host, dealer.peer.port) not in self._dealers:
                continue  # dropped earlier in this round
            if sock is dealer.sock:
                self._read_dealer(dealer)
            else:
                self._read_dealer_monitor(dealer)
        self._flush_outbox()

    def _read_router(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = PeerRef(inbound=frames[0])
            if len(frames) != 2:
                self._reject(peer, f"a {len(frames)}-frame message")
                continue
            self._accept(peer, frames[1])

    def _read_router_monitor(self) -> None:
        assert self._router_monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._router_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & _HANDSHAKE_FAILED:
                self.stats.refused_handshakes += 1
                self._peer_log.warn(
                    "inbound-handshake",
                    "refused",
                    "side channel: refused a connection whose handshake failed (a peer "
                    "without our auth key, or with another one); counted, logged once a minute",
                )

    def _read_dealer(self, dealer: _Dealer) -> None:
        while True:
            try:
                wire = dealer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            dealer.last_used = time.monotonic()
            self._accept(dealer.peer, wire)

    def _read_dealer_monitor(self, dealer: _Dealer) -> None:
        while True:
            try:
                event = recv_monitor_message(dealer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED and not dealer.handshaken:
                # The peer answered (a P that just started on its port): its handshake gets a
                # window of its own, so a connection made near the end of the first one is not
                # dropped as unreachable while the handshake (messages already queued behind
                # it, delivered once it completes) is still under way.
                dealer.opened = time.monotonic()
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                dealer.handshaken = True
            elif kind & _HANDSHAKE_FAILED:
                self.stats.refused_handshakes += 1
                self._drop_dealer(
                    dealer,
                    "key mismatch: the peer refused our handshake (the two sides' auth keys "
                    "differ, or one side has none)",
                )
                return
            elif kind == zmq.EVENT_DISCONNECTED:
                self._drop_dealer(dealer, "connection lost: the peer closed it or went silent")
                return

    def _prune(self) -> None:
        now = time.monotonic()
        for dealer in list(self._dealers.values()):
            if not dealer.handshaken and now - dealer.opened > self.connect_timeout_s:
                self._drop_dealer(
                    dealer,
                    f"unreachable: no connection within {self.connect_timeout_s:g} s",
                )
            elif now - dealer.last_used > self.idle_close_s:
                self._drop_dealer(dealer, "idle: connection closed", log=False)

    def _reject(self, peer: PeerRef, reason: str) -> None:
        self.stats.rejected += 1
        self._peer_log.warn(
            str(peer), "rejected", "side channel: rejected a message from %s: %s", peer, reason
        )

    def _accept(self, peer: PeerRef, wire: bytes) -> None:
        try:
            message = messages.decode(wire, self.auth_key)
        except Exception as exc:  # decode raises MessageError; anything else is rejected too
            self._reject(peer, str(exc)[:300])
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
                try:  # never blocks: a full queue or a gone peer drops the reply
                    self._router.send_multipart([peer.inbound, wire], zmq.NOBLOCK)
                except zmq.Again:
                    logger.warning("side channel: dropped a reply to %s (queue full)", peer)
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    self._inbox_bound.append(PeerLost(peer, "connection gone"))
                continue
            assert peer.host is not None and peer.port is not None
            dealer = self._dealer(peer.host, peer.port)
            try:
                dealer.sock.send(wire, zmq.NOBLOCK)
                dealer.last_used = time.monotonic()
            except zmq.Again:
                self._drop_dealer(dealer, "send queue full: the peer reads nothing")

    def _close_sockets(self) -> None:
        for dealer in list(self._dealers.values()):
            _close_monitored(dealer.sock, dealer.monitor)
        self._dealers.clear()
        if self._router is not None:
            _close_monitored(self._router, self._router_monitor)
        self._wake_recv.close(0)
