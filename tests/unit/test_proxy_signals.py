"""``splitserve proxy`` stops on SIGTERM and SIGINT, one process or a pool of workers
(``splitserve.proxy.server.serve_until_stopped``): exit status 0, nothing left running, also
when it was started with SIGINT ignored, as a shell starts a command in the background (the
proxy then went on serving, and had to be killed). Real processes, no engine: the servers the
config names do not exist, which the proxy only logs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from splitserve.netutil import free_port, http_ok

DEAD = "http://127.0.0.1:9"  # nothing listens there: checks fail, the proxy still serves /health


def start(tmp_path: Path, workers: int, ignore_sigint: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {
        "port": port,
        "workers": workers,
        "prefill": [{"url": DEAD, "side_channel_port": 5555}],
        "decode": [{"url": DEAD}],
    }
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    with open(tmp_path / "proxy.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "-v", "proxy", "--config", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=ignore,  # noqa: PLW1509 - a signal disposition, before exec
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not http_ok(url + "/health"):
        assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
        assert time.monotonic() < deadline, "proxy not up within 60 s"
        time.sleep(0.1)
    return proc, url


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    ("signum", "ignore_sigint"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["sigterm", "sigint", "sigint-ignored-by-the-parent"],
)
def test_the_proxy_stops_on_the_signal_and_leaves_nothing(tmp_path, workers, signum, ignore_sigint):
    proc, url = start(tmp_path, workers, ignore_sigint)
    children = psutil.Process(proc.pid).children(recursive=True)
    if workers > 1:
        assert len(children) >= workers, "the pool's workers are not running"
    proc.send_signal(signum)
    try:
        status = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running 30 s after {signum.name}")
    assert status == 0, (tmp_path / "proxy.log").read_text()[-2000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {alive}"
    assert not http_ok(url + "/health")
