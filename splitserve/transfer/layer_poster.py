"""Post each layer's blocks only once the device says the layer's writes are done.

Engine-agnostic; runs a thread of its own in the process that computes (vLLM's worker,
``benchmarks/gpu_proof.py``). On a GPU the kernels that write a layer's KV are asynchronous: when
the engine's per-layer hook runs, the kernels are queued, not done. A WRITE posted then could
copy the bytes before the kernels wrote them (the transport copies on its own streams). So the
hook records a completion event on the compute stream (``submit``) and this poster's one thread
waits for each event in order, then calls ``post_layer`` (``KVSender.layer_done``) under the
caller's lock; ``drain`` waits until every submitted layer is posted (the engine calls it before
closing the step). The compute thread never blocks on the device.

An event is anything with ``synchronize()``: by default a CUDA event recorded on the current
stream (``cuda_event``). The event source is a parameter so that the same poster runs where
there is no CUDA: ``benchmarks/gpu_proof.py --device cpu`` gives it events of a host thread that
plays the stream, and its race check gives it events that do not wait (to show what the wait
prevents). Measured in docs/benchmarks.md, "GPU (H200)".

Invariants:
- Layers are posted in the order submitted, each once, each after its event completed.
- ``drain`` returns only when every layer submitted before it was posted (or its post raised:
  the error is logged and re-raised by ``drain``, so a step never closes over a lost layer
  silently). A failed ``on_start`` (binding the thread to the cache's device) is raised by
  every ``drain``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)


class CompletionEvent(Protocol):
    """What the poster waits on: returns once the work recorded before it has completed."""

    def synchronize(self) -> None: ...


def cuda_device(index: int) -> Callable[[], None]:
    """For ``on_start``: make the poster thread's current CUDA device the KV cache's, so the
    transport's calls from this thread (UCX registers and copies through the CUDA driver) find
    the right context; a new thread otherwise starts on device 0."""

    def bind() -> None:
        import torch

        torch.cuda.set_device(index)

    return bind


def cuda_event() -> CompletionEvent:
    """A CUDA event recorded on the current stream (after the layer's queued kernels)."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


class LayerPoster:
    """One thread that posts layers after their completion events (see module docstring)."""

    def __init__(
        self,
        post_layer: Callable[[int], None],
        lock: threading.Lock,
        *,
        record_event: Callable[[], CompletionEvent] = cuda_event,
        on_start: Callable[[], None] | None = None,
        name: str = "splitserve-layer-poster",
    ) -> None:
        self._on_start = on_start
        self._post_layer = post_layer
        self._lock = lock
        self._record_event = record_event
        self._queue: queue.Queue[tuple[int, CompletionEvent] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._start_error: BaseException | None = None  # kept: every drain raises it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, layer: int) -> None:
        """The layer's kernels are queued: record its event now, post it once that completes."""
        self._queue.put((layer, self._record_event()))

    def drain(self) -> None:
        """Wait until every submitted layer is posted."""
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
        if self._start_error is not None:
            raise self._start_error

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # every drain reports it
                logger.exception("layer poster thread set-up failed")
                self._start_error = exc
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                layer, event = item
                event.synchronize()
                with self._lock:
                    self._post_layer(layer)
            except Exception as exc:  # kept for drain(): the step must not close over it
                logger.exception("posting a layer failed")
                self._error = exc
            finally:
                self._queue.task_done()
