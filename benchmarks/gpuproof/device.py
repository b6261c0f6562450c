"""Where the synthetic prefill runs: a CUDA stream, or a host thread that plays one.

``CudaStream`` queues kernels on the current CUDA stream (they run later, asynchronously) and
times each layer with CUDA timing events. ``HostStream`` gives the CPU the same shape: one
worker thread runs the queued work in order, so the caller returns before the work is done,
and ``record()`` answers an event that completes when the thread reaches it. That is what lets
``--device cpu`` drive the connector's ``LayerPoster`` with events that really lag the hook and
provoke the race the poster exists to prevent. What it cannot show: how CUDA orders UCX's copy
engines against the compute stream (only ``--device cuda`` does).

Both also make and check the KV content: each (layer, iteration) has its own int16 bit pattern
(``pattern``), written by the layer's own work into the request's blocks, so a receiver can tell
fresh bytes from stale ones.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


def pattern(torch: Any, layer: int, iteration: int, shape: tuple[int, ...], device: str) -> Any:
    """The int16 content of a layer's blocks in one iteration (distinct per layer and iteration;
    any bit pattern, since nothing computes with the KV here)."""
    numel = 1
    for size in shape:
        numel *= size
    base = torch.arange(numel, dtype=torch.int64, device=device) * 40503
    base = (base + layer * 7919 + iteration * 104729 + 1) & 0x7FFF
    return base.to(torch.int16).view(shape)


class NoWait:
    """An event that does not wait: the race check's poster posts as soon as the hook runs."""

    def synchronize(self) -> None:
        return None


class _HostEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._done.wait()


class HostStream:
    """One worker thread running queued work in order (see module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.layer_seconds: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="host-stream", daemon=True)
        self._thread.start()

    def launch(self, layer: int, work: Callable[[], None]) -> None:
        def timed() -> None:
            start = time.perf_counter()
            work()
            self.layer_seconds[layer] = time.perf_counter() - start

        self._queue.put(timed)

    def record(self) -> _HostEvent:
        event = _HostEvent()
        self._queue.put(event._done.set)
        return event

    def synchronize(self) -> None:
        self.record().synchronize()

    def take_layer_seconds(self) -> dict[int, float]:
        out, self.layer_seconds = self.layer_seconds, {}
        return out

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work()


class CudaStream:
    """The current CUDA stream, with a pair of timing events around each layer's kernels."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self._timers: dict[int, tuple[Any, Any]] = {}

    def launch(self, layer: int, work: Callable[[], None]) -> None:
        begin = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        self._timers[layer] = (begin, end)

    def record(self) -> Any:
        from splitserve.transfer.layer_poster import cuda_event

        return cuda_event()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def take_layer_seconds(self) -> dict[int, float]:
        self.synchronize()
        out = {layer: b.elapsed_time(e) / 1e3 for layer, (b, e) in self._timers.items()}
        self._timers = {}
        return out

    def close(self) -> None:
        self.synchronize()


def make_stream(torch: Any, device: str) -> HostStream | CudaStream:
    return CudaStream(torch) if device == "cuda" else HostStream()
