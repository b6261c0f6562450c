"""benchmarks/soak.py's deployment: ``splitserve up`` (1 P + 1 D, or 2 P + 2 D) with the
SplitserveConnector, the concurrent flow and the restart policy ``always``; started, stopped, and
each server's process tree found by the port it listens on."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from splitserve.launch.process import ManagedProcess
from splitserve.netutil import free_ports, http_ok


def deployment(model: Path, run_dir: Path, pairs: int) -> dict[str, Any]:
    http_ports, side_ports = free_ports(3), free_ports(2)
    # Servers of a pool get consecutive ports from their base: leave room for `pairs` of them.
    p_base, d_base, proxy_port = http_ports[0], http_ports[0] + 50, http_ports[2]
    args = ["--max-model-len", "4096", "--max-num-batched-tokens", "1024"]
    cores = [i % 2 for i in range(pairs)]
    return {
        "name": "soak",
        "engine": "vllm",
        "device": "cpu",
        "model": {"path": str(model), "served_name": "tiny"},
        "prefill": {
            "count": pairs,
            "base_port": p_base,
            "side_channel_base_port": side_ports[0],
            "cpu_cores": cores,
            "args": args,
        },
        "decode": {
            "count": pairs,
            "base_port": d_base,
            "side_channel_base_port": side_ports[0] + 50,
            "cpu_cores": [1 - c for c in cores],
            "args": args,
        },
        "connector": {"name": "splitserve", "settings": {"lease_s": 20}},
        "proxy": {"port": proxy_port, "flow": "concurrent", "first_token_from_prefill": True},
        "restart": {"policy": "always", "max_restarts": 20, "backoff_s": 1.0},
        "run_dir": str(run_dir),
        "startup_timeout_s": 900,
    }


@dataclass
class Deployed:
    up: ManagedProcess
    proxy_url: str
    engines: dict[str, str]  # name -> URL
    ports: dict[str, int]  # name -> HTTP port (the proxy's too)
    engine_key: str | None

    def tree(self, name: str) -> list[psutil.Process]:
        """The process tree of the child of ``up`` that listens on ``name``'s port."""
        port = self.ports[name]
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.up.pid).children():
                with contextlib.suppress(psutil.Error):
                    procs = [child, *child.children(recursive=True)]
                    for proc in procs:
                        with contextlib.suppress(psutil.Error):
                            for conn in proc.net_connections(kind="tcp"):
                                if conn.status == "LISTEN" and conn.laddr.port == port:
                                    return procs
        return []


def start(model: Path, run_dir: Path, pairs: int, log: Path) -> Deployed:
    dep = deployment(model, run_dir, pairs)
    config = run_dir / "deployment.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(dep))
    argv = [sys.executable, "-m", "splitserve.cli", "up", str(config)]
    up = ManagedProcess("up", argv, log).start()
    proxy_url = f"http://127.0.0.1:{dep['proxy']['port']}"
    up.wait_ready(lambda: http_ok(proxy_url + "/ready"), timeout=900, interval=2)
    engines, ports = {}, {"proxy": dep["proxy"]["port"]}
    for role in ("prefill", "decode"):
        for i in range(pairs):
            port = dep[role]["base_port"] + i
            engines[f"{role}-{i}"] = f"http://127.0.0.1:{port}"
            ports[f"{role}-{i}"] = port
    keys = list(run_dir.rglob("secrets/engine-api.key"))
    key = keys[0].read_text().strip() if keys else None
    return Deployed(up, proxy_url, engines, ports, key)


def stop(deployed: Deployed) -> int | None:
    if deployed.up.alive():
        os.kill(deployed.up.pid, signal.SIGTERM)
    assert deployed.up.proc is not None
    try:
        return deployed.up.proc.wait(timeout=120)
    except Exception:  # noqa: BLE001 - whatever happened, nothing may outlive the soak
        return None
    finally:
        deployed.up.stop(grace=5)  # what is left of it, and its temp directory
