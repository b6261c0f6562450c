"""Unit tests of ``splitserve.connectors.vllm.shm_spin`` against vLLM's real ``SpinCondition``
(no server): the setting reaches a ring reader built the way vLLM builds one, a reader past its
spin sleeps at most ``POLL_MS`` at a time, and bad values change nothing."""

from __future__ import annotations

import logging

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from splitserve.connectors.vllm import shm_spin

ENV = shm_spin.ENV


@pytest.fixture
def pristine(monkeypatch):
    """vLLM's class as it was, restored after the test."""
    cls = shm_broadcast.SpinCondition
    monkeypatch.setattr(cls.__init__, "__defaults__", cls.__init__.__defaults__)
    monkeypatch.setattr(cls, "wait", cls.wait)
    return cls


def reader(cls, ctx: zmq.Context, tmp_path):
    return cls(is_reader=True, context=ctx, notify_address=f"ipc://{tmp_path}/notify")


def test_a_reader_built_after_it_spins_the_time_set_and_polls_in_short_sleeps(pristine, tmp_path):
    assert shm_spin.apply_from_env({ENV: "0"}) == 0.0
    assert shm_spin.apply_from_env({ENV: "0"}) == 0.0  # idempotent
    ctx = zmq.Context()
    try:
        condition = reader(pristine, ctx, tmp_path)
        assert condition.busy_loop_s == 0.0
        polls: list[int | None] = []
        condition.poller.poll = lambda timeout=None: polls.append(timeout) or []
        condition.wait()  # vLLM's own "indefinitely"
        condition.wait(timeout_ms=5000)  # vLLM's recheck interval
        assert polls == [shm_spin.POLL_MS, shm_spin.POLL_MS]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("raw", ["", "  ", "fast", "-1", "61", "nan", "inf"])
def test_unset_or_bad_values_change_nothing(pristine, raw, caplog, tmp_path):
    before = pristine.__init__.__defaults__
    with caplog.at_level(logging.ERROR, logger=shm_spin.__name__):
        assert shm_spin.apply_from_env({ENV: raw}) is None
    assert pristine.__init__.__defaults__ == before
    if raw.strip():
        assert ENV in caplog.text and repr(raw.strip()) in caplog.text
    ctx = zmq.Context()
    try:
        assert reader(pristine, ctx, tmp_path).busy_loop_s == before[-1]
    finally:
        ctx.destroy(linger=0)
