"""``splitserve up`` for real: the demo deployment comes up, serves through the proxy, keeps
serving when its decode server is SIGKILLed (the server is restarted and serves again), and stops
with no process left behind; bad starts fail fast and clean."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from splitserve.launch.demo import (
    LOADS_COMPLETED,
    TRANSFERS_COMPLETED,
    handoff_summary,
    metric_sum,
    scrape,
)
from splitserve.launch.process import ManagedProcess
from splitserve.netutil import free_ports, http_ok

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / os.environ.get("SPLITSERVE_TEST_UP_CONFIG", "demo-cpu.yaml")


def _config(tmp_path: Path, **changes) -> tuple[Path, dict]:
    """The demo config with free ports and a private run directory (nothing else changed)."""
    data = yaml.safe_load(DEMO.read_text())
    http = free_ports(3)
    side = free_ports(2)
    data["prefill"].update(base_port=http[0], side_channel_base_port=side[0])
    data["decode"].update(base_port=http[1], side_channel_base_port=side[1])
    data["proxy"]["port"] = http[2]
    data["run_dir"] = str(tmp_path / "run")
    for section, values in changes.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[[Path], ManagedProcess]]:
    """Starts ``splitserve up`` on a config; after the test (which checks what ``up`` left
    behind first), ``stop`` ends whatever is left and removes ``up``'s temp directory."""
    started: list[ManagedProcess] = []

    def start(config: Path) -> ManagedProcess:
        argv = [sys.executable, "-m", "splitserve.cli", "up", str(config)]
        started.append(ManagedProcess("up", argv, tmp_path / "up.log").start())
        return started[-1]

    yield start
    for up in started:
        up.stop()


def _descendants(proc: ManagedProcess) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _wait_exit(proc: ManagedProcess, timeout: float) -> int:
    assert proc.proc is not None
    return proc.proc.wait(timeout=timeout)


def test_demo_deployment_serves_and_stops_clean(tmp_path, tiny_model, start_up) -> None:
    config, data = _config(tmp_path, model={"preset": None, "path": str(tiny_model)})
    up = start_up(config)
    proxy = f"http://127.0.0.1:{data['proxy']['port']}"
    children: list[psutil.Process] = []
    try:
        up.wait_ready(lambda: http_ok(proxy + "/ready"), timeout=900, interval=2)
        out = _complete(proxy, data)
        assert out["usage"]["completion_tokens"] > 0
        # The KV went from P to D through our connector, and the demo's report reads it.
        servers = [
            ("prefill-0", f"http://127.0.0.1:{data['prefill']['base_port']}"),
            ("decode-0", f"http://127.0.0.1:{data['decode']['base_port']}"),
        ]
        p_url, d_url = servers[0][1], servers[1][1]
        up.wait_ready(
            lambda: (
                metric_sum(scrape(p_url), TRANSFERS_COMPLETED) >= 1
                and metric_sum(scrape(d_url), LOADS_COMPLETED) >= 1
            ),
            timeout=60,
            interval=1,
        )
        report = handoff_summary(servers)
        assert "in 1 transfers" in report[0] and "loaded the KV of 1 requests" in report[1], report
        children = _descendants(up)
        assert len(children) >= 3  # two engine servers (plus their workers) and the proxy
        ours = data["connector"]["name"] == "splitserve"
        _assert_keys_nobody_typed(tmp_path, children, p_url, proxy, ours)
        # One dead server does not take the deployment down: it is restarted and serves again.
        _kill_decode_and_see_it_restarted(up, data, proxy, out)
        children = _descendants(up)
    finally:
        if up.alive():
            os.kill(up.pid, signal.SIGTERM)
    assert _wait_exit(up, timeout=120) == 0, up.tail()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after up stopped: {[p.pid for p in alive]}"
    assert "all processes stopped" in up.tail(5)


def _complete(proxy: str, data: dict, timeout: float = 300) -> dict:
    body = {
        "model": data["model"]["served_name"],
        "prompt": "hello world the quick brown fox",
        "max_tokens": 8,
        "temperature": 0,
    }
    req = urllib.request.Request(
        proxy + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _server_tree(up: ManagedProcess, port: int) -> list[psutil.Process]:
    """The process tree of the child of ``up`` that serves HTTP on ``port``."""
    for child in psutil.Process(up.pid).children():
        with contextlib.suppress(psutil.Error):
            argv = child.cmdline()
            if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
                return [child, *child.children(recursive=True)]
    raise AssertionError(f"no child of up serves port {port}")


def _kill_decode_and_see_it_restarted(
    up: ManagedProcess, data: dict, proxy: str, before: dict
) -> None:
    """SIGKILL the decode server's whole tree: ``up`` keeps running, the proxy keeps answering,
    the decode server is restarted (``up`` says so, with the dead server's exit code) and, once
    it is up again, a completion through the proxy gives the same answer as before."""
    tree = _server_tree(up, data["decode"]["base_port"])
    old_pids = {p.pid for p in tree}
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(tree, timeout=30)
    deadline = time.monotonic() + 120
    while "restarted decode-0" not in up.tail(400):
        assert up.alive(), f"up stopped when decode-0 died:\n{up.tail(80)}"
        assert time.monotonic() < deadline, f"decode-0 not restarted:\n{up.tail(80)}"
        assert http_ok(proxy + "/health"), "the proxy stopped answering /health"
        time.sleep(1)
    log = up.tail(400)
    assert "decode-0 exited with code -9 (SIGKILL); restarting it in" in log, log
    assert "--- last log lines of decode-0 ---" in log, log
    new = _server_tree(up, data["decode"]["base_port"])
    assert not old_pids & {p.pid for p in new}, "the old decode server was not replaced"
    # Engines take a minute or two to start on a 2-core machine; then the proxy readmits D.
    deadline = time.monotonic() + 600
    while True:
        assert up.alive(), f"up stopped while decode-0 restarted:\n{up.tail(80)}"
        assert http_ok(proxy + "/health"), "the proxy stopped answering /health"
        try:
            after = _complete(proxy, data, timeout=120)
            break
        except (urllib.error.URLError, OSError) as e:
            assert time.monotonic() < deadline, f"no completion after the restart: {e}"
            time.sleep(5)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    up.wait_ready(lambda: "decode-0 ready again after" in up.tail(400), timeout=30, interval=1)
    assert "prefill-0 exited" not in up.tail(400) and "proxy exited" not in up.tail(400)


def test_port_taken_fails_fast_and_starts_nothing(tmp_path, tiny_model, start_up) -> None:
    config, data = _config(tmp_path, model={"preset": None, "path": str(tiny_model)})
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", data["proxy"]["port"]))
        holder.listen()
        up = start_up(config)
        rc = _wait_exit(up, timeout=120)
    assert rc == 1
    assert f"proxy.port: port {data['proxy']['port']}" in up.tail()
    assert not list((tmp_path / "run").glob("logs/*.log")), "a server was started"


def test_server_that_cannot_start_stops_the_rest(tmp_path, tiny_model, start_up) -> None:
    config, data = _config(
        tmp_path,
        model={"preset": None, "path": str(tiny_model)},
        prefill={"args": ["--no-such-engine-flag"]},
    )
    up = start_up(config)
    rc = _wait_exit(up, timeout=600)
    out = up.tail(80)
    assert rc == 1, out
    assert "prefill-0: exited with code" in out
    assert "--no-such-engine-flag" in out  # the failing server's own log lines are shown
    assert "all processes stopped" in out


def _assert_keys_nobody_typed(run_root, children, engine_url: str, proxy: str, ours: bool) -> None:
    """`up` made the deployment's keys itself: the connectors run authenticated, the engines'
    /v1 answers only the proxy (which holds the key), and no command line shows a key."""
    (secrets,) = list(run_root.rglob("secrets"))
    keys = {f.name: f.read_text().strip() for f in secrets.iterdir()}
    assert set(keys) == ({"side-channel.key"} if ours else set()) | {"engine-api.key"}
    for f in secrets.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600
    for proc in children:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.cmdline())
            for key in keys.values():
                assert key not in cmdline, f"a key shows in `ps`: pid {proc.pid}"
    logs = "".join(f.read_text(errors="replace") for f in run_root.rglob("logs/*.log"))
    if ours:
        assert "authenticated: CurveZMQ under the deployment key" in logs
        assert "NO KEY" not in logs
    try:
        urllib.request.urlopen(engine_url + "/v1/models", timeout=30)
        raise AssertionError("an engine's /v1 answered without the key")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    with urllib.request.urlopen(proxy + "/v1/models", timeout=30) as r:
        assert r.status == 200
