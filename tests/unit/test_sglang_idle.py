"""The nap between a PD scheduler's polls (splitserve.connectors.sglang.idle): SGLang busy-polls
while a request waits in its disaggregation queues; the hook waits on the scheduler's own input
sockets instead, only then, and never raises into SGLang's loop."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from splitserve.connectors.sglang import idle
from splitserve.connectors.sglang.transport import BackendSettings, BackendSettingsError


class _Poller:
    def __init__(self, ready_after: int | None = None):
        self.timeouts: list[float] = []
        self.ready_after = ready_after  # a request is on the sockets from this call on

    def poll(self, timeout_ms):
        self.timeouts.append(timeout_ms)
        if self.ready_after is not None and len(self.timeouts) > self.ready_after:
            return [("socket", 1)]
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
    monkeypatch.setattr(idle, "ACTIVE", _manager(nap_s=0.001))
    assert idle.after_on_idle(None, scheduler) is None
    assert poller.timeouts == [pytest.approx(1.0)]

    def broken():
        raise RuntimeError("scheduler state")

    assert idle.after_on_idle(None, SimpleNamespace(is_fully_idle=broken)) is None


def _manager(nap_s=0.001, check_s=0.0, check=lambda: False):
    return SimpleNamespace(nap_s=nap_s, check_s=check_s, idle_check=check)


def test_a_failing_nap_is_logged_once_with_its_traceback_then_at_debug(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=idle.__name__)
    monkeypatch.setattr(idle, "ACTIVE", _manager())
    monkeypatch.setattr(idle, "failures", 0)

    def broken():
        raise RuntimeError("scheduler state")

    for _ in range(3):
        assert idle.after_on_idle(None, SimpleNamespace(is_fully_idle=broken)) is None
    levels = [(r.levelno, r.exc_info is not None) for r in caplog.records]
    assert levels == [(logging.ERROR, True), (logging.DEBUG, True), (logging.DEBUG, True)]
    assert idle.failures == 3
    assert "further failures at DEBUG" in caplog.records[0].getMessage()


def test_a_nap_with_checks_ends_when_our_backend_has_news(monkeypatch):
    """Sliced: after each slice, the sockets without waiting, then the manager's check (a DONE
    or a REGISTER changed a room's status): the nap ends there, not at its length."""
    slept: list[float] = []
    monkeypatch.setattr(idle.time, "sleep", slept.append)
    answers = iter([False, False, True])
    poller = _Poller()
    assert idle.nap(_scheduler(False, poller), 60.0, 0.0002, lambda: next(answers)) is True
    assert slept == [pytest.approx(0.0002)] * 3, "three slices: the third check had news"
    assert poller.timeouts == [0, 0, 0], "the sockets are polled without waiting"


def test_a_nap_with_checks_ends_on_a_request_before_asking_the_backend(monkeypatch):
    monkeypatch.setattr(idle.time, "sleep", lambda s: None)
    checks: list[int] = []
    poller = _Poller(ready_after=1)
    assert idle.nap(_scheduler(False, poller), 60.0, 0.0002, lambda: checks.append(1)) is True
    assert len(poller.timeouts) == 2 and len(checks) == 1


def test_a_nap_with_checks_lasts_its_length_without_news():
    """Real clock: the nap ends at its length (and no sooner) when nothing comes; sub-ms slices
    (zmq's poll alone would truncate 0.5 ms to 0: a spin)."""
    checks = []
    started = idle.time.monotonic()
    assert idle.nap(_scheduler(False, _Poller()), 0.005, 0.0005, lambda: checks.append(1))
    assert idle.time.monotonic() - started >= 0.005
    assert len(checks) >= 2


def test_the_managers_check_drives_the_transport_and_reports_status_changes():
    conn = pytest.importorskip("splitserve.connectors.sglang.conn")
    mgr = conn.SplitserveKVManager.__new__(conn.SplitserveKVManager)
    mgr.status_changes = 0
    drives: list[int] = []

    def drive():
        drives.append(1)
        if len(drives) == 2:  # a DONE seen: the room's status changes
            mgr.status_changes += 1

    mgr.drive = drive
    assert mgr.idle_check() is False
    assert mgr.idle_check() is True
    assert mgr.idle_check() is False and len(drives) == 3


def test_update_status_is_counted(monkeypatch):
    conn = pytest.importorskip("splitserve.connectors.sglang.conn")
    seen = []
    monkeypatch.setattr(
        conn.CommonKVManager, "update_status", lambda self, room, status: seen.append(room)
    )
    mgr = conn.SplitserveKVManager.__new__(conn.SplitserveKVManager)
    mgr.status_changes = 0
    mgr.lock = threading.RLock()
    mgr._set_status("7", conn.KVPoll.Success)
    assert seen == [7] and mgr.status_changes == 1


def test_nap_setting_from_the_environment():
    assert BackendSettings.from_env({}).idle_nap_ms == 1.0
    assert BackendSettings.from_env({}).idle_check_ms == 0.2
    assert BackendSettings.from_env({"SPLITSERVE_SGLANG_IDLE_CHECK_MS": "0"}).idle_check_ms == 0
    assert BackendSettings.from_env({"SPLITSERVE_SGLANG_IDLE_NAP_MS": "0"}).idle_nap_ms == 0
    with pytest.raises(BackendSettingsError, match="SPLITSERVE_SGLANG_IDLE_NAP_MS"):
        BackendSettings.from_env({"SPLITSERVE_SGLANG_IDLE_NAP_MS": "-1"})


def test_the_plugin_hooks_sglangs_on_idle():
    pytest.importorskip("sglang.srt.managers.scheduler")
    from sglang.srt.plugins.hook_registry import HookRegistry

    from splitserve import plugins

    plugins.register_sglang()
    assert any(hook is idle.after_on_idle for _, hook, _ in HookRegistry._hooks[idle.ON_IDLE])
