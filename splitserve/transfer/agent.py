"""NIXL agent lifecycle and block-level transfers, in the process that owns the KV cache.

``KVAgent`` wraps one ``nixl_agent`` with the UCX backend (or the NIXL backends the connector
setting ``nixl_backends`` lists, in order of preference; one that does not load stops start-up): it
registers the KV memory described by a ``KVLayout`` with its real memory type (DRAM for host
memory), prepares one descriptor list over every (layer, block, run) of the local cache and of each
peer's cache, and posts WRITE or READ transfers for lists of (layer, local block, remote block)
triples. It imports no engine. NIXL's own progress thread is off: it polls with no delay and keeps
a whole core busy (ENVIRONMENT.md). Instead, while WRITEs posted here are in flight, a thread of
ours drives their progress every ``progress_interval_s`` and sleeps in between: on a transport that
copies at post time (UCX ``cma``, host memory here) it finds them done at once, but over ``tcp``
(and RDMA rendezvous) a posted WRITE moves only while someone calls into NIXL, so without it a
layer posted during the forward would wait for the step's end. The same thread also runs while a
peer pulls from our memory (``hold_progress``): over ``cma`` a READ posted by the peer is reported
done only if this side calls into NIXL often enough (DESIGN.md gives the bound), and the side that
announced the blocks is computing; it then calls ``get_new_notifs`` every ``serve_interval_s`` and
keeps what it returns for ``notifications``. That interval is longer than the WRITE one because
each round costs the computing thread on the same core (the cost per interval is measured in
docs/benchmarks.md, "First token from the prefill server"), while the peer's READ has already
copied its bytes at post and only waits for its completion to be reported. An urgent hold
(``hold_progress(urgent=True)``: the side computes no more for that transfer, D's last READs are on
the critical path) rounds every ``progress_interval_s``; ``linger_progress(seconds)`` keeps the
slow rounds going a while after the last hold (a pull that ended without the peer saying its READs
were done: they must still complete on its side). Every call into the NIXL agent holds one lock
(the agent is made without NIXL's own thread safety).

Invariants:
- Every block id is validated against the layer of the layout it indexes before anything is
  posted (layers may hold different numbers of blocks, see ``KVLayout``).
- A handle is released exactly once, by ``release`` (or ``settle``, which releases the handles
  it finds finished); a failed post leaves nothing behind.
- A peer is loaded while an ``add_peer`` call is not matched by a ``remove_peer``: one agent
  serves the sending and the receiving side of a ``kv_both`` server, and each unloads only
  what it loaded (a server may be P and D for the same peer).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from splitserve.transfer.layout import KVLayout
from splitserve.transfer.tp import HeadSlice

logger = logging.getLogger(__name__)


def _nixl_api():
    """The NIXL Python API (imported lazily: ``import nixl`` costs seconds and imports torch)."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent, nixl_agent_config


class NixlBackend(BaseModel):
    """One NIXL backend to create in the agent: its plugin name and init parameters (the
    connector setting ``nixl_backends`` is a list of these, in order of preference)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, description="NIXL plugin, e.g. UCX, LIBFABRIC")
    params: dict[str, str] = Field(default_factory=dict, description="the plugin's init params")


def backend_list(
    backends: Sequence[NixlBackend] | None, ucx_params: dict[str, str] | None = None
) -> list[NixlBackend]:
    """The backends an agent creates: ``backends`` or UCX alone (the default); the older
    ``ucx_params`` setting fills in a UCX entry's parameters it does not set itself."""
    chosen = list(backends) if backends else [NixlBackend(name="UCX")]
    if ucx_params:
        chosen = [
            b.model_copy(update={"params": {**ucx_params, **b.params}}) if b.name == "UCX" else b
            for b in chosen
        ]
    return chosen


class BackendUnavailableError(RuntimeError):
    """A configured NIXL backend is unknown here or did not load (refused at start-up)."""


class TransferPostError(RuntimeError):
    """NIXL refused to create or post a transfer (e.g. the peer is gone)."""


class _DescriptorIndex:
    """Maps (layer, block, run) to an index in a layout's one prepared descriptor list; with
    ``heads``, the runs are the sub-runs holding only those heads (a peer of another TP size:
    ``tp.exchange_slices``), so a copy moves exactly the peer's heads, no staging buffer."""

    def __init__(self, layout: KVLayout, heads: HeadSlice | None = None) -> None:
        self.layout = layout
        self.heads = heads
        self.runs = [layout.block_runs(i, heads) for i in range(len(layout.layers))]
        self.block_bytes = [sum(n for _, n in runs) for runs in self.runs]
        self.layer_offsets: list[int] = []
        total = 0
        for layer, runs in zip(layout.layers, self.runs, strict=True):
            self.layer_offsets.append(total)
            total += layer.num_blocks * len(runs)
        self.size = total

    def descriptors(self) -> np.ndarray:
        rows = np.zeros((self.size, 3), dtype=np.uint64)
        for layer, offset, runs in zip(
            self.layout.layers, self.layer_offsets, self.runs, strict=True
        ):
            n_runs = len(runs)
            blocks = np.arange(layer.num_blocks, dtype=np.uint64)
            for r, (run_offset, run_len) in enumerate(runs):
                idx = offset + np.arange(layer.num_blocks) * n_runs + r
                rows[idx, 0] = layer.base_addr + run_offset + blocks * layer.block_stride
                rows[idx, 1] = run_len
                rows[idx, 2] = self.layout.device_id
        return rows

    def indices(self, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Descriptor indices for (layer, block) pairs, all runs of each, in order."""
        out = []
        for layer_id in np.unique(layers):
            n_runs = len(self.runs[int(layer_id)])
            sel = blocks[layers == layer_id]
            base = self.layer_offsets[int(layer_id)] + sel * n_runs
            out.append((base[:, None] + np.arange(n_runs)[None, :]).reshape(-1))
        return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)


@dataclass
class _Peer:
    agent_name: str
    layout: KVLayout
    index: _DescriptorIndex
    dlist: object
    # Our side of copies with this peer: our whole runs (None: the agent's own list), or only
    # the peer's heads (a decode peer of a larger TP size, ``tp.exchange_slices``).
    local: tuple[_DescriptorIndex, object] | None = None
    refs: int = 1  # add_peer calls not yet matched by remove_peer


@dataclass
class XferHandle:
    """One posted transfer: its NIXL handle and what it moved."""

    peer: str
    nixl_handle: object
    num_bytes: int
    tags: dict = field(default_factory=dict)
    settled: str | None = None  # "DONE" / "ERR" once seen so (NIXL is not asked again)


class KVAgent:
    """A NIXL agent over one KV cache (see module docstring)."""

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        *,
        backend_params: dict[str, str] | None = None,
        backends: Sequence[NixlBackend] | None = None,
        progress_interval_s: float = 0.001,
        serve_interval_s: float = 0.02,
    ) -> None:
        nixl_agent, nixl_agent_config = _nixl_api()
        self.name = name
        self.layout = layout
        self._lock = threading.RLock()  # every call into self._agent
        self._progress_interval_s = progress_interval_s
        self._serve_interval_s = serve_interval_s
        self._in_flight: dict[int, XferHandle] = {}  # id -> posted, not yet seen settled
        self._serving = 0  # holds by our users: peers pull from our memory, keep progressing
        self._urgent = 0  # of which urgent: round as often as for in-flight transfers
        self._linger_until = 0.0  # monotonic: serve until then without a hold
        self._notif_buffer: dict[str, list[bytes]] = {}  # read by the progress thread
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._progress: threading.Thread | None = None
        config = nixl_agent_config(enable_prog_thread=False, backends=[])
        self._agent = nixl_agent(name, config)
        self.backend_names = self._create_backends(backend_list(backends, backend_params))
        ranges = layout.memory_ranges()
        self._reg = self._agent.register_memory(
            [(start, length, layout.device_id, "") for start, length in ranges], layout.memory
        )
        self._index = _DescriptorIndex(layout)
        self._local_dlist = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._index.descriptors(), layout.memory
        )
        self._peers: dict[str, _Peer] = {}
        logger.info(
            "NIXL agent %s registered %d range(s), %d layers x %d blocks (pid %d)",
            name,
            len(ranges),
            len(layout.layers),
            layout.num_blocks,
            os.getpid(),
        )

    def _create_backends(self, backends: list[NixlBackend]) -> list[str]:
        """Create each backend in order or raise ``BackendUnavailableError`` saying why."""
        try:
            available = list(self._agent.get_plugin_list())
        except Exception:  # listing is a convenience for the message; creation decides
            available = []
        names = []
        for backend in backends:
            if available and backend.name not in available:
                raise BackendUnavailableError(
                    f"NIXL backend {backend.name!r} is unknown here (plugins found: "
                    f"{', '.join(sorted(available))}); fix nixl_backends"
                )
            try:
                self._agent.create_backend(backend.name, dict(backend.params))
            except Exception as exc:  # nixl raises its own error types
                raise BackendUnavailableError(
                    f"NIXL backend {backend.name!r} did not load with params {backend.params}: "
                    f"{type(exc).__name__}: {exc} (its plugin or the library under it is "
                    "missing or refused the parameters); fix or remove it in nixl_backends"
                ) from exc
            names.append(backend.name)
        return names

    # -- metadata and peers -------------------------------------------------------------------

    def metadata(self) -> bytes:
        with self._lock:
            return self._agent.get_agent_metadata()

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def peer_names(self) -> list[str]:
        """The agents loaded now (what pruning keeps bounded: ``peering``, ``recv_pull``)."""
        return list(self._peers)

    def add_peer(self, agent_metadata: bytes, layout: KVLayout) -> str:
        """Load a peer's metadata and prepare its descriptor list (or take one more reference
        to a peer loaded already); returns its agent name. The caller owes one
        ``remove_peer`` per call.

        Raises ``ValueError`` if its layout cannot exchange blocks with ours.
        """
        problem = self.layout.incompatibility(layout)
        if problem:
            raise ValueError(f"peer KV layout incompatible: {problem}")
        ours, theirs = self.layout.head_slices(layout)
        index = _DescriptorIndex(layout, theirs)
        descriptors = index.descriptors()
        with self._lock:
            agent_name = self._agent.add_remote_agent(agent_metadata)
            if isinstance(agent_name, bytes):
                agent_name = agent_name.decode()
            if agent_name in self._peers:
                self._peers[agent_name].refs += 1
                return agent_name
            dlist = self._agent.prep_xfer_dlist(agent_name, descriptors, layout.memory)
            local = None
            if ours is not None:
                local_index = _DescriptorIndex(self.layout, ours)
                local_dlist = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", local_index.descriptors(), self.layout.memory
                )
                local = (local_index, local_dlist)
            self._peers[agent_name] = _Peer(agent_name, layout, index, dlist, local)
        return agent_name

    def peer_layout(self, agent_name: str) -> KVLayout | None:
        """The KV layout a peer declared when it was added (``None``: no such peer)."""
        peer = self._peers.get(agent_name)
        return peer.layout if peer is not None else None

    def remove_peer(self, agent_name: str, *, force: bool = False) -> None:
        """Drop one reference to a peer (``force``: all); the last unloads it: its descriptor
        list and its metadata (NIXL disconnects from it). The caller makes sure no transfer
        of its own with that peer is in flight."""
        with self._lock:
            peer = self._peers.get(agent_name)
            if peer is None:
                return
            peer.refs = 0 if force else peer.refs - 1
            if peer.refs > 0:
                return
            del self._peers[agent_name]
            peer.dlist.release()
            if peer.local is not None:
                peer.local[1].release()
            self._agent.remove_remote_agent(agent_name)
        logger.debug("NIXL agent %s: peer %s unloaded", self.name, agent_name)

    # -- transfers ---------------------------------------------------------------------------

    def post(
        self,
        operation: str,
        peer_name: str,
        layers: Sequence[int],
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        notif: bytes = b"",
    ) -> XferHandle:
        """Post a WRITE (local -> peer) or READ (peer -> local) of whole blocks.

        ``layers[i]``, ``local_blocks[i]``, ``remote_blocks[i]`` name one block copy. Raises
        ``ValueError`` for an id outside either cache, ``TransferPostError`` if NIXL fails.
        """
        peer = self._peers.get(peer_name)
        if peer is None:
            raise TransferPostError(f"unknown peer agent {peer_name!r}")
        if not (len(layers) == len(local_blocks) == len(remote_blocks)) or not layers:
            raise ValueError("layers, local_blocks and remote_blocks must be equal, non-empty")
        n_layers = len(self.layout.layers)
        if any(not 0 <= layer < n_layers for layer in layers):
            raise ValueError(f"layer index outside 0..{n_layers - 1}")
        layer_arr = np.asarray(layers, dtype=np.int64)
        for layer_id in np.unique(layer_arr):
            sel = layer_arr == layer_id
            layer = int(layer_id)
            self.layout.validate_block_ids(
                np.asarray(local_blocks)[sel].tolist(), "local block", layer
            )
            peer.layout.validate_block_ids(
                np.asarray(remote_blocks)[sel].tolist(), f"block of peer {peer_name}", layer
            )
        local_index, local_dlist = peer.local or (self._index, self._local_dlist)
        local_idx = local_index.indices(layer_arr, np.asarray(local_blocks, dtype=np.int64))
        remote_idx = peer.index.indices(layer_arr, np.asarray(remote_blocks, dtype=np.int64))
        num_bytes = sum(local_index.block_bytes[layer] for layer in layers)
        with self._lock:
            try:
                handle = self._agent.make_prepped_xfer(
                    operation,
                    local_dlist,
                    local_idx,
                    peer.dlist,
                    remote_idx,
                    notif_msg=notif,
                    backends=self.backend_names,  # in order of preference
                )
            except Exception as exc:  # nixl raises its own error types; carry the reason up
                raise TransferPostError(f"make_prepped_xfer to {peer_name}: {exc}") from exc
            try:
                state = self._agent.transfer(handle)
            except Exception as exc:
                handle.release()
                raise TransferPostError(f"transfer to {peer_name}: {exc}") from exc
            if state == "ERR":
                handle.release()
                raise TransferPostError(f"transfer to {peer_name} failed at post")
            posted = XferHandle(peer=peer_name, nixl_handle=handle, num_bytes=num_bytes)
            if state == "DONE":
                posted.settled = "DONE"
            elif self._progress_interval_s > 0:
                self._in_flight[id(posted)] = posted
                self._start_progress()
                self._wake.notify()
        return posted

    def check(self, handle: XferHandle) -> str:
        """ "DONE", "PROC" or "ERR" (a disconnected peer reads as "ERR")."""
        with self._lock:
            return self._check_locked(handle)

    def _check_locked(self, handle: XferHandle) -> str:
        if handle.settled is not None:
            return handle.settled
        try:
            state = self._agent.check_xfer_state(handle.nixl_handle)
        except Exception as exc:
            logger.warning("transfer to %s failed: %s", handle.peer, exc)
            state = "ERR"
        if state != "PROC":
            handle.settled = state
            self._in_flight.pop(id(handle), None)
        return state

    def settle(self, handles: Sequence[XferHandle]) -> tuple[list[XferHandle], list[XferHandle]]:
        """Check each handle, release those that finished; answers (still in flight, failed).

        The one place where the sender and the receiver retire their posts: a handle leaves
        the caller's list exactly when it is released here."""
        pending: list[XferHandle] = []
        failed: list[XferHandle] = []
        for handle in handles:
            state = self.check(handle)
            if state == "PROC":
                pending.append(handle)
                continue
            self.release(handle)
            if state == "ERR":
                failed.append(handle)
        return pending, failed

    def release(self, handle: XferHandle) -> bool:
        """Release a handle (NIXL cancels it if still in flight); False when NIXL refused."""
        with self._lock:
            self._in_flight.pop(id(handle), None)
            try:
                handle.nixl_handle.release()
            except Exception as exc:
                # NIXL refuses to release a transfer it cannot cancel; the handle is leaked to
                # the agent's own cleanup list rather than silently dropped.
                logger.error("could not release transfer handle to %s: %s", handle.peer, exc)
                return False
            return True

    def abandon(self, handles: Sequence[XferHandle]) -> list[XferHandle]:
        """Cancel posts that stalled past their deadline (a silent transport); answers those
        NIXL could not cancel, which may still move bytes (their blocks must stay held)."""
        return [handle for handle in handles if not self.release(handle)]

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name (also drives NIXL progress)."""
        with self._lock:
            self._buffer_notifs_locked()
            out, self._notif_buffer = self._notif_buffer, {}
            return out

    def _buffer_notifs_locked(self) -> None:
        for name, notifs in self._agent.get_new_notifs().items():
            self._notif_buffer.setdefault(name, []).extend(notifs)

    def hold_progress(self, urgent: bool = False) -> None:
        """A peer may READ our memory now (pull): call into NIXL every ``serve_interval_s``
        (``urgent``: every ``progress_interval_s``) until the matching ``drop_progress``, so
        its READs complete while our thread computes."""
        with self._lock:
            self._serving += 1
            self._urgent += int(urgent)
            if self._progress_interval_s > 0:
                self._start_progress()
                self._wake.notify()

    def linger_progress(self, seconds: float) -> None:
        """Keep calling into NIXL (every ``serve_interval_s``) for ``seconds`` more."""
        with self._lock:
            self._linger_until = max(self._linger_until, time.monotonic() + seconds)
            if self._progress_interval_s > 0:
                self._start_progress()
                self._wake.notify()

    def drop_progress(self, urgent: bool = False) -> None:
        with self._lock:
            self._serving = max(0, self._serving - 1)
            self._urgent = max(0, self._urgent - int(urgent))

    def _start_progress(self) -> None:
        """Start the progress thread (lock held); it sleeps while nothing is in flight."""
        if self._progress is None and not self._closing:
            self._progress = threading.Thread(
                target=self._progress_loop, name=f"splitserve-progress-{self.name}", daemon=True
            )
            self._progress.start()

    def _progress_loop(self) -> None:
        with self._lock:
            while not self._closing:
                lingering = time.monotonic() < self._linger_until
                if not self._in_flight and not self._serving and not lingering:
                    self._wake.wait()
                    continue
                for handle in list(self._in_flight.values()):
                    self._check_locked(handle)
                if self._serving or lingering:
                    try:
                        self._buffer_notifs_locked()
                    except Exception as exc:  # never let the progress thread die
                        logger.warning("NIXL progress (notifications) failed: %s", exc)
                # Sleep with the lock released: the engine's thread posts and polls meanwhile.
                fast = self._in_flight or self._urgent
                interval = self._progress_interval_s if fast else self._serve_interval_s
                self._wake.wait(interval)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._progress is not None:
            self._progress.join(timeout=5)
        for name in list(self._peers):
            try:
                self.remove_peer(name, force=True)
            except Exception as exc:
                logger.warning("removing peer %s at close: %s", name, exc)
        with self._lock:
            try:
                self._local_dlist.release()
                self._agent.deregister_memory(self._reg)
            except Exception as exc:
                logger.warning("deregistering KV memory at close: %s", exc)
