"""LayerPoster (transfer/layer_poster.py): the connector's GPU poster, driven with host events.

The events here are ``threading.Event``s released by the test, standing for CUDA events the
device completes later (the real CUDA path runs in ``benchmarks/gpu_proof.py --device cuda``).
"""

from __future__ import annotations

import threading

import pytest

from splitserve.transfer.layer_poster import LayerPoster


class GatedEvent:
    """A completion event the test completes by hand."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        assert self.done.wait(timeout=30), "event never completed"


def make_poster(post_layer):
    events: list[GatedEvent] = []

    def record() -> GatedEvent:
        events.append(GatedEvent())
        return events[-1]

    return LayerPoster(post_layer, threading.Lock(), record_event=record), events


def test_layers_post_in_order_each_after_its_event():
    posted: list[int] = []
    poster, events = make_poster(posted.append)
    try:
        for layer in range(3):
            poster.submit(layer)
        assert events[0].waited.wait(timeout=30)
        assert posted == []  # the first event has not completed: nothing may be posted
        events[1].done.set()  # a later layer completing first does not jump the queue
        assert posted == []
        events[0].done.set()
        assert events[2].waited.wait(timeout=30)
        assert posted == [0, 1]
        events[2].done.set()
        poster.drain()
        assert posted == [0, 1, 2]
    finally:
        for event in events:
            event.done.set()
        poster.close()


def test_drain_reraises_a_failed_post_and_the_poster_goes_on():
    posted: list[int] = []

    def post(layer: int) -> None:
        if layer == 1:
            raise RuntimeError("post failed")
        posted.append(layer)

    poster, events = make_poster(post)
    try:
        for layer in range(3):
            poster.submit(layer)
        for event in events:
            event.done.set()
        with pytest.raises(RuntimeError, match="post failed"):
            poster.drain()
        assert posted == [0, 2]
        poster.submit(3)
        events[-1].done.set()
        poster.drain()  # the error was reported once; the thread still posts
        assert posted == [0, 2, 3]
    finally:
        poster.close()


def test_a_failed_thread_set_up_is_raised_by_every_drain():
    def on_start() -> None:
        raise RuntimeError("no such device")

    posted: list[int] = []
    poster = LayerPoster(posted.append, threading.Lock(), record_event=Done, on_start=on_start)
    try:
        for layer in range(2):
            poster.submit(layer)
            with pytest.raises(RuntimeError, match="no such device"):
                poster.drain()
        assert posted == [0, 1]  # posting goes on: a wrong context fails the post visibly
    finally:
        poster.close()


class Done:
    """An event already complete (host memory: the write is done when the hook runs)."""

    def synchronize(self) -> None:
        return None
