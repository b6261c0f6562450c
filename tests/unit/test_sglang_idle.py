"""The nap between a PD scheduler's polls (splitserve.connectors.sglang.idle): SGLang busy-polls
while a request waits in its disaggregation queues; the hook waits on the scheduler's own input
sockets instead, only then, and never raises into SGLang's loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitserve.connectors.sglang import idle
from splitserve.connectors.sglang.transport import BackendSettings, BackendSettingsError


class _Poller:
    def __init__(self):
        self.timeouts: list[float] = []

    def poll(self, timeout_ms):
        self.timeouts.append(timeout_ms)
        return []


def _scheduler(fully_idle: bool, poller: _Poller | None):
    sleeper = None if poller is None else SimpleNamespace(poller=poller)
    return SimpleNamespace(is_fully_idle=lambda: fully_idle, idle_sleeper=sleeper)


def test_a_scheduler_waiting_on_transfers_naps_on_its_own_sockets():
    poller = _Poller()
    assert idle.nap(_scheduler(False, poller), 0.002) is True
    assert poller.timeouts == [pytest.approx(2.0)]  # milliseconds, zmq's unit


def test_a_fully_idle_scheduler_or_a_zero_nap_is_left_to_sglang():
    poller = _Poller()
    assert idle.nap(_scheduler(True, poller), 0.002) is False  # SGLang slept already
    assert idle.nap(_scheduler(False, poller), 0.0) is False
    assert poller.timeouts == []


def test_without_sleep_on_idle_it_sleeps(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(idle.time, "sleep", slept.append)
    assert idle.nap(_scheduler(False, None), 0.001) is True
    assert slept == [0.001]


def test_the_hook_is_inert_without_an_active_manager_and_never_raises(monkeypatch):
    poller = _Poller()
    scheduler = _scheduler(False, poller)
    monkeypatch.setattr(idle, "ACTIVE", None)
    assert idle.after_on_idle(None, scheduler) is None
    assert poller.timeouts == []
    monkeypatch.setattr(idle, "ACTIVE", SimpleNamespace(nap_s=0.001))
    assert idle.after_on_idle(None, scheduler) is None
    assert poller.timeouts == [pytest.approx(1.0)]

    def broken():
        raise RuntimeError("scheduler state")

    assert idle.after_on_idle(None, SimpleNamespace(is_fully_idle=broken)) is None


def test_nap_setting_from_the_environment():
    assert BackendSettings.from_env({}).idle_nap_ms == 1.0
    assert BackendSettings.from_env({"SPLITSERVE_SGLANG_IDLE_NAP_MS": "0"}).idle_nap_ms == 0
    with pytest.raises(BackendSettingsError, match="SPLITSERVE_SGLANG_IDLE_NAP_MS"):
        BackendSettings.from_env({"SPLITSERVE_SGLANG_IDLE_NAP_MS": "-1"})


def test_the_plugin_hooks_sglangs_on_idle():
    pytest.importorskip("sglang.srt.managers.scheduler")
    from sglang.srt.plugins.hook_registry import HookRegistry

    from splitserve import plugins

    plugins.register_sglang()
    assert any(hook is idle.after_on_idle for _, hook, _ in HookRegistry._hooks[idle.ON_IDLE])
