"""The restart policy of ``splitserve up``: its arithmetic on a fake clock, the log tail a
restart shows, the settings' validation, and the supervisor restarting a real (tiny) process
while the others keep running."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from splitserve.config import DeploymentError, RestartSettings, load_deployment, parse_deployment
from splitserve.launch.deployment import DeploymentRunner, plan_servers
from splitserve.launch.group import ServerGroup
from splitserve.launch.process import ManagedProcess, tail_lines
from splitserve.launch.restart import (
    RestartTracker,
    backoff_delay,
    describe_exit,
    wants_restart,
)
from splitserve.launch.supervisor import Supervisor
from splitserve.netutil import free_port

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASHER = [sys.executable, "-c", "import sys; print('boom: out of cheese'); sys.exit(3)"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the policy's arithmetic ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("always", 0, True),
        ("always", 1, True),
        ("on-failure", 0, False),
        ("on-failure", 1, True),
        ("on-failure", -9, True),  # killed by a signal
        ("on-failure", None, True),
        ("never", 1, False),
        ("never", -9, False),
    ],
)
def test_which_exits_are_restarted(policy, code, restart) -> None:
    assert wants_restart(policy, code) is restart


def test_backoff_doubles_per_restart_in_the_window_and_is_capped() -> None:
    assert [backoff_delay(k, 1.0, 30.0) for k in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff_delay(0, 0.0, 30.0) == 0.0
    assert backoff_delay(10_000, 1.0, 30.0) == 30.0  # no overflow
    with pytest.raises(ValueError):
        backoff_delay(-1, 1.0, 30.0)


def test_tracker_gives_up_past_the_limit_in_the_window_and_forgets_old_restarts() -> None:
    clock = FakeClock()
    t = RestartTracker("on-failure", max_restarts=3, window_s=100.0, backoff_s=1.0)
    delays = []
    for _ in range(3):
        d = t.on_exit(1, clock())
        assert d.restart
        delays.append(d.delay_s)
        clock.now += 10
    assert delays == [1.0, 2.0, 4.0]
    over = t.on_exit(1, clock())
    assert not over.restart and "3 restart(s) in the last 100 s" in over.reason
    # The first restart (at 1000) leaves the window at 1100: one slot again, backoff 2**2.
    clock.now = 1100.0
    again = t.on_exit(-9, clock())
    assert again.restart and again.attempt == 3 and again.delay_s == 4.0
    # A whole quiet window later the backoff starts from the beginning.
    clock.now += 100.0
    fresh = t.on_exit(1, clock())
    assert fresh.restart and fresh.attempt == 1 and fresh.delay_s == 1.0


def test_tracker_never_and_clean_exit_reasons() -> None:
    assert "'never'" in RestartTracker("never").on_exit(1, 0.0).reason
    clean = RestartTracker("on-failure").on_exit(0, 0.0)
    assert not clean.restart and "clean exit" in clean.reason
    assert not RestartTracker("always", max_restarts=0).on_exit(0, 0.0).restart


def test_exit_codes_are_described_with_their_signal() -> None:
    assert describe_exit(3) == "code 3"
    assert describe_exit(-9) == "code -9 (SIGKILL)"
    assert describe_exit(-15) == "code -15 (SIGTERM)"
    assert describe_exit(None) == "an unknown code"


# --- the last log lines --------------------------------------------------------------------


def test_tail_lines_keeps_the_last_lines_and_drops_a_cut_first_line() -> None:
    data = b"one\ntwo\nthree\nfour\n"
    assert tail_lines(data, 2) == "three\nfour"
    assert tail_lines(data, 10) == "one\ntwo\nthree\nfour"
    assert tail_lines(data, 0) == ""
    assert tail_lines(b"ne\ntwo\n", 10, cut=True) == "two"
    assert tail_lines(b"only part of a line", 10, cut=True) == "only part of a line"
    assert tail_lines(b"bad \xff byte\n", 1) == "bad \ufffd byte"


def test_tail_shows_only_the_current_run_of_an_appended_log(tmp_path) -> None:
    log = tmp_path / "x.log"
    log.write_text("an earlier run\nits last words\n")
    proc = ManagedProcess("x", [sys.executable, "-c", "print('this run')"], log).start()
    assert proc.proc is not None
    proc.proc.wait(timeout=30)
    assert proc.tail() == "this run"
    assert "an earlier run" in log.read_text()
    proc.stop()  # its temp directory


# --- the settings ----------------------------------------------------------------------------


def _deployment(**restart) -> dict:
    return {
        "model": {"preset": "tiny", "served_name": "tiny"},
        "prefill": {"base_port": 9100, "side_channel_base_port": 9600},
        "decode": {"base_port": 9200},
        "connector": {"name": "nixl"},
        "proxy": {"port": 9000},
        **({"restart": restart} if restart else {}),
    }


def test_restart_defaults_and_errors_name_the_field() -> None:
    dep = parse_deployment(_deployment())
    assert dep.restart == RestartSettings()
    assert dep.restart.policy == "on-failure" and dep.restart.max_restarts == 5
    assert parse_deployment(_deployment(policy="always")).restart.policy == "always"
    bad = [
        ({"policy": "sometimes"}, "restart.policy"),
        ({"max_restarts": -1}, "restart.max_restarts"),
        ({"window_s": 0}, "restart.window_s"),
        ({"backoff_s": 10, "max_backoff_s": 5}, "max_backoff_s: 5 is below backoff_s 10"),
        ({"retries": 3}, "restart.retries"),
    ]
    for change, needle in bad:
        with pytest.raises(DeploymentError, match="x.yaml") as e:
            parse_deployment(_deployment(**change), "x.yaml")
        assert needle in str(e.value), (change, str(e.value))


# --- the supervisor on real processes ---------------------------------------------------------


def _wait_dead(proc: ManagedProcess) -> None:
    deadline = time.monotonic() + 30
    while proc.alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_supervisor_restarts_a_dead_child_and_gives_up_past_the_limit(tmp_path) -> None:
    clock = FakeClock()
    lines: list[str] = []
    group = ServerGroup(tmp_path)
    try:
        other = group.add("other", SLEEPER, port=free_port(), env={"SECRET": "s3"})
        crasher = group.add("crasher", CRASHER, port=free_port(), env={"SECRET": "s3"})
        first_pid = crasher.process.pid
        sup = Supervisor(
            group,
            RestartSettings(max_restarts=1, backoff_s=2.0, max_backoff_s=2.0),
            {"crasher": [crasher.port]},
            lines.append,
            clock=clock,
        )
        _wait_dead(crasher.process)
        assert sup.step() is None
        assert (
            "crasher exited with code 3; restarting it in 2.0 s (restart 1 of at most 1"
            in (lines[-1])
        )
        assert "boom: out of cheese" in lines[-1]  # the dead run's last log lines
        assert sup.step() is None and crasher.process.pid == first_pid  # backoff not over
        clock.now += 2.0
        assert sup.step() is None
        assert "restarted crasher" in lines[-1]
        assert crasher.process.pid != first_pid
        assert crasher.process.argv == CRASHER and crasher.process.env == {"SECRET": "s3"}
        _wait_dead(crasher.process)
        assert sup.step() == 1
        assert "giving up, stopping the deployment" in lines[-1]
        assert "boom: out of cheese" in lines[-1]
        log = (tmp_path / "crasher.log").read_text()
        assert log.count("boom") == 2 and "restart 1 after the last run exited with code 3" in log
        assert other.process.alive() and other.process.pid is not None
    finally:
        group.stop()


def test_supervisor_waits_for_the_port_with_a_bound(tmp_path) -> None:
    clock = FakeClock()
    lines: list[str] = []
    group = ServerGroup(tmp_path)
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        crasher = group.add("crasher", CRASHER, port=port)
        sup = Supervisor(
            group,
            RestartSettings(backoff_s=0.0, port_wait_s=10.0),
            {"crasher": [port]},
            lines.append,
            clock=clock,
        )
        _wait_dead(crasher.process)
        pid = crasher.process.pid
        assert sup.step() is None
        assert sup.step() is None and f"waiting for port(s) [{port}]" in lines[-1]
        clock.now += 5.0
        assert sup.step() is None and crasher.process.pid == pid
        clock.now += 5.0
        assert sup.step() == 1
        assert "still in use 10 s after it died (restart.port_wait_s)" in lines[-1]
    finally:
        holder.close()
        group.stop()


def test_supervisor_with_policy_never_stops_at_the_first_exit(tmp_path) -> None:
    lines: list[str] = []
    group = ServerGroup(tmp_path)
    try:
        crasher = group.add("crasher", CRASHER, port=free_port())
        sup = Supervisor(group, RestartSettings(policy="never"), {}, lines.append)
        _wait_dead(crasher.process)
        assert sup.run() == 1
        assert "the restart policy is 'never': giving up" in lines[-1]
    finally:
        group.stop()


def test_a_restart_waits_for_every_port_of_the_child(tmp_path) -> None:
    """HTTP and KV side channel of each engine server, and the proxy's port."""
    data = _deployment()
    data["connector"] = {"name": "splitserve"}
    data["decode"]["side_channel_base_port"] = 9700
    data["run_dir"] = str(tmp_path)
    runner = DeploymentRunner(parse_deployment(data))
    runner.planned = plan_servers(runner.dep, "/models/tiny")
    assert runner.child_ports() == {
        "prefill-0": [9100, 9600],
        "decode-0": [9200, 9700],
        "proxy": [9000],
    }


def test_every_shipped_config_builds_its_proxy_settings_before_start(tmp_path) -> None:
    """``up`` reads the proxy's client key and prints an example request before the servers are
    planned; a concurrent-flow config needs the prefill side-channel ports for that."""
    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        runner = DeploymentRunner(load_deployment(path), echo=lambda line: None)
        if runner.dep.proxy.get("api_key_file") is None:
            assert runner._proxy_client_key() is None, path
        assert "/v1/completions" in runner.example_request(), path
