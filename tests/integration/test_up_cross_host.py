"""``splitserve up`` across hosts (issue #16): one deployment file places P, D and the proxy on
three test-bed hosts (``splitserve.launch.testbed``); one ``splitserve up FILE --host ADDR``
per host, each started inside its host's namespace, brings the 1P1D deployment up, and the
proxy serves a completion equal to P's colocated answer.

Each ``up`` starts only its host's share (docs/deployment.md, "Across hosts"): P and D bind
their host's address (HTTP, side channel, ``VLLM_HOST_IP``), UCX runs over tcp (the pools'
``env``: the hosts share one kernel, separate machines would not), the proxy reaches both at
their addresses. The three ``up`` share the run directory (one file system), so they also show
that concurrent starts agree on one set of keys. Everything is stopped (SIGTERM to each ``up``,
which stops its children) before the bed goes down. Bounds carry slack for a loaded 2-core
machine; nothing is asserted on speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from splitserve.launch import testbed as tbmod
from splitserve.launch.demo import LOADS_COMPLETED, TRANSFERS_COMPLETED, metric_sum, scrape

pytestmark = pytest.mark.integration

START_S = 900.0  # both engines start at once on 2 shared cores
STOP_S = 120.0
PROMPT = "hello world the quick brown fox"


def _deployment(tmp_path: Path, model: Path, bed: tbmod.Testbed) -> Path:
    key = tmp_path / "proxy-api.key"
    key.write_text("c" * 32 + "\n")
    key.chmod(0o600)
    args = ["--max-model-len", "2048", "--max-num-batched-tokens", "2048"]
    ucx = bed["p"].ucx_env()
    data = {
        "name": "xhost-up",
        "model": {"path": str(model), "served_name": "tiny"},
        "prefill": {
            "base_port": 8000,
            "side_channel_base_port": 5701,
            "hosts": [bed["p"].address],
            "cpu_cores": [0],
            "env": ucx,
            "args": args,
        },
        "decode": {  # the same ports: another host
            "base_port": 8000,
            "side_channel_base_port": 5701,
            "hosts": [bed["d"].address],
            "cpu_cores": [1],
            "env": ucx,
            "args": args,
        },
        "connector": {"name": "splitserve", "settings": {}},
        "proxy": {
            "host": bed["proxy"].address,
            "port": 8000,
            "flow": "concurrent",
            "api_key_file": str(key),
        },
        "run_dir": str(tmp_path / "run"),
        "startup_timeout_s": START_S,
    }
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _post(url: str, key: str, timeout: float = 120.0) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _ready(url: str, key: str) -> bool:
    req = urllib.request.Request(url + "/ready", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def test_one_up_per_host_serves_1p1d(tmp_path, tiny_model) -> None:
    try:
        tbmod.check()
    except tbmod.TestbedError as exc:
        pytest.fail(f"the test bed cannot run here: {exc}")
    with tbmod.Testbed(["p", "d", "proxy"]) as bed:
        config = _deployment(tmp_path, tiny_model, bed)
        ups: dict[str, tuple[subprocess.Popen, Path]] = {}
        try:
            for name in ("p", "d", "proxy"):
                log = tmp_path / f"up-{name}.log"
                with log.open("wb") as out:
                    argv = [sys.executable, "-m", "splitserve.cli", "up", str(config)]
                    proc = bed[name].popen(
                        [*argv, "--host", bed[name].address],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                ups[name] = (proc, log)
            proxy = f"http://{bed['proxy'].address}:8000"
            client_key = "c" * 32
            with bed["proxy"].entered():
                deadline = time.monotonic() + START_S + 120
                while not _ready(proxy, client_key):
                    for name, (proc, log) in ups.items():
                        assert proc.poll() is None, f"up on {name} exited:\n{_tail(log)}"
                    assert time.monotonic() < deadline, "the proxy never became ready:\n" + (
                        "\n".join(f"--- {n}\n{_tail(log)}" for n, (_, log) in ups.items())
                    )
                    time.sleep(2)
                served = _post(proxy, client_key)
                engine_key = (tmp_path / "run" / "secrets" / "engine-api.key").read_text().strip()
                # The reference: P alone (no kv_transfer_params), from the proxy's host.
                colocated = _post(f"http://{bed['p'].address}:8000", engine_key)
                # The KV went from P's host to D's (engines' /metrics need no key; the counters
                # reach them with the engines' stats, so they are polled, bounded).
                deadline = time.monotonic() + 60
                while True:
                    moved = metric_sum(
                        scrape(f"http://{bed['p'].address}:8000"), TRANSFERS_COMPLETED
                    )
                    loaded = metric_sum(scrape(f"http://{bed['d'].address}:8000"), LOADS_COMPLETED)
                    if (moved >= 1 and loaded >= 1) or time.monotonic() > deadline:
                        break
                    time.sleep(1)
            assert served["usage"]["completion_tokens"] > 0
            assert served["choices"][0]["text"] == colocated["choices"][0]["text"]
            assert moved >= 1 and loaded >= 1, (moved, loaded)
            # Each up started its own share only.
            outs = {name: log.read_text(errors="replace") for name, (_, log) in ups.items()}
            assert "started prefill-0" in outs["p"] and "decode-0" not in outs["p"], outs["p"]
            assert "started decode-0" in outs["d"] and "proxy ready" not in outs["d"], outs["d"]
            assert "proxy ready" in outs["proxy"] and "started " not in outs["proxy"]
            logs = tmp_path / "run" / "logs"
            d_log = (logs / "decode-0.log").read_text(errors="replace")
            assert "authenticated: CurveZMQ under the deployment key" in d_log
            assert "transport tcp" in d_log  # UCX over the network, not cma
        finally:
            for proc, _ in ups.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            codes = {}
            for name, (proc, _) in ups.items():
                try:
                    codes[name] = proc.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    codes[name] = proc.wait(timeout=30)
    assert codes == {"p": 0, "d": 0, "proxy": 0}, {n: _tail(log) for n, (_, log) in ups.items()}
    for _, log in ups.values():
        assert "all processes stopped" in _tail(log, 5), _tail(log)
