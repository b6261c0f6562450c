"""Unit tests of ``aio.wait_any`` (our own helper; no engine): FIRST_COMPLETED semantics of
``asyncio.wait`` for a few futures, and nothing left behind on the futures it watched."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.proxy.aio import wait_any


def _callbacks(f: asyncio.Future) -> int:
    return len(f._callbacks or ())  # noqa: SLF001 - what the helper must leave clean


async def test_returns_at_once_when_one_is_done() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    b.set_result(1)
    assert await wait_any(loop.time() + 10, a, b) is True
    assert _callbacks(a) == 0


async def test_wakes_when_one_completes_and_cleans_up() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    loop.call_later(0.01, a.set_exception, OSError("x"))
    assert await wait_any(loop.time() + 10, a, b) is True
    assert a.done() and not b.done()
    assert _callbacks(b) == 0
    a.exception()  # retrieved


async def test_false_at_the_deadline_without_cancelling_anything() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    assert await wait_any(loop.time() + 0.02, a, b) is False
    assert not a.done() and not b.done()
    assert _callbacks(a) == _callbacks(b) == 0


async def test_a_deadline_already_past_answers_false() -> None:
    loop = asyncio.get_running_loop()
    a = loop.create_future()
    assert await wait_any(loop.time() - 1, a) is False


async def test_cancelling_the_waiter_leaves_the_futures_alone() -> None:
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    task = asyncio.ensure_future(wait_any(loop.time() + 10, a, b))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not a.cancelled() and not b.cancelled()
    assert _callbacks(a) == _callbacks(b) == 0
