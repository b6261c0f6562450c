"""Starts the stubs and the contenders, each its own process, and stops them all.

Contenders: ``direct`` (the decode stub itself), the bare floor, ``splitserve proxy`` in each
flow (also as of an older git revision, ``--baseline``: each wanted flow as ``<flow>@REV``),
and the two Rust routers in their PD modes, each with a policy that needs no tokenizer
(``round_robin``; vllm-router's default ``cache_aware`` asks the prefill server to tokenize
every prompt first). A router that is not installed is listed as not measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from proxybench.contenders import Contender
from proxybench.load import BODY
from splitserve.netutil import free_port, http_ok

REPO = Path(__file__).resolve().parents[2]


def wait_http(url: str, timeout: float = 60.0) -> None:
    """Until GET ``url`` answers 200."""
    end = time.monotonic() + timeout
    while not http_ok(url, timeout=2):
        if time.monotonic() > end:
            raise RuntimeError(f"{url} not ready after {timeout} s")
        time.sleep(0.2)


def wait_completion(base: str, timeout: float) -> None:
    """Until ``base`` answers a completion with 200 (a router that registers workers late)."""
    end = time.monotonic() + timeout
    data = json.dumps(BODY).encode()
    while True:
        req = urllib.request.Request(
            base + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{base} answered no completion within {timeout} s")
        time.sleep(0.5)


def export_revision(rev: str) -> Path:
    """The ``splitserve`` package as of git revision ``rev``, in a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="splitserve-baseline-"))
    archive = subprocess.run(
        ["git", "archive", rev, "splitserve"], cwd=REPO, check=True, capture_output=True
    ).stdout
    tar_path = out / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(out, filter="data")
    return out


def vllm_router_installed() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


def sglang_router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


class Launcher:
    """Starts the stubs and the contenders; stops all of them on exit.

    ``script`` is the entry script (``benchmarks/proxy_overhead.py``): the stubs and the bare
    proxy run as that script with its hidden ``--fast-stub`` / ``--stub`` / ``--bare`` options.
    """

    def __init__(
        self,
        proxy_workers: int,
        stub_server: str,
        script: str,
        contender_cpus: set[int] | None = None,
    ) -> None:
        self.py = sys.executable
        # ``--pin``: each contender's processes on these CPUs (the stubs and the load generator
        # inherit this script's own affinity, set by the caller).
        self.contender_cpus = contender_cpus
        self.script = script
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workers = proxy_workers
        p_port, d_port = free_port(), free_port()
        self.stub_p, self.stub_d = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        # Two stub processes, P and D (SGLang's router refuses one URL in both roles).
        for port in (p_port, d_port):
            flag = "--fast-stub" if stub_server == "ours" else "--stub"
            self.spawn([self.py, self.script, flag, str(port)], harness=True)
        wait_http(self.stub_p + "/health")
        wait_http(self.stub_d + "/health")

    def spawn(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        harness: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd``: a contender (on ``contender_cpus`` when pinned) or, ``harness``, a
        stub (on this script's CPUs)."""
        cpus = None if harness else self.contender_cpus
        pin = None if cpus is None else lambda: os.sched_setaffinity(0, cpus)
        p = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd,
            preexec_fn=pin,
        )  # fmt: skip
        self.procs.append(p)
        return p

    def splitserve(self, name: str, *extra: str, src: Path | None = None) -> Contender:
        port = free_port()
        env = None
        if src is not None:
            env = {**os.environ, "PYTHONPATH": str(src)}
        cmd = [self.py, "-m", "splitserve.cli", "proxy", "--prefill", self.stub_p,
               "--decode", self.stub_d, "--port", str(port), "--workers", str(self.workers),
               *extra]  # fmt: skip
        # ``python -m`` puts the working directory first on sys.path: run a baseline from its
        # own tree, or it would import the working tree's package.
        p = self.spawn(cmd, env, cwd=src)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready")
        return Contender(name, url, p.pid)

    def bare(self) -> Contender:
        port = free_port()
        p = self.spawn([self.py, self.script, "--bare", str(port), self.stub_p, self.stub_d])
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready")
        return Contender("bare-aiohttp", url, p.pid)

    def vllm_router(self) -> Contender:
        port, metrics = free_port(), free_port()
        exe = shutil.which("vllm-router") or str(Path(self.py).parent / "vllm-router")
        p = self.spawn(
            [exe, "--vllm-pd-disaggregation", "--prefill", self.stub_p, "--decode", self.stub_d,
             "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(metrics), "--log-level", "warning"]
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_completion(url, timeout=120)
        return Contender("vllm-router", url, p.pid)

    def sglang_router(self) -> Contender:
        port, metrics = free_port(), free_port()
        p = self.spawn(
            [self.py, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", self.stub_p, "8998", "--decode", self.stub_d,
             "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(metrics), "--log-level", "warn"]
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_completion(url, timeout=300)  # it registers its workers after listening
        return Contender("sglang-router", url, p.pid)

    def close(self) -> None:
        for p in self.procs[::-1]:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


# Our proxy's flows as contenders: name -> extra ``splitserve proxy`` options.
SPLITSERVE_FLOWS = {
    "splitserve": (),
    "splitserve-concurrent": (
        "--flow", "concurrent", "--side-channel-port", "1", "--no-first-token-from-prefill",
    ),
    "splitserve-first-token": (
        "--flow", "concurrent", "--side-channel-port", "1", "--first-token-from-prefill",
    ),
    "splitserve-sglang": ("--engine", "sglang", "--bootstrap-port", "8998"),
}  # fmt: skip


def start_contenders(
    launcher: Launcher, wanted: Callable[[str], bool], baseline: str | None
) -> tuple[list[Contender], list[str]]:
    """``direct`` and every wanted contender, in the table's order: (started, not installed).

    ``baseline``: our proxy as of that git revision too, as ``<flow>@REV``: the sequential
    flow always (``splitserve@REV``), and every other of our flows that is wanted, so that a
    change to one flow is measured before/after in the same run."""
    contenders = [Contender("direct", launcher.stub_d, None)]
    missing: list[str] = []
    if wanted("bare-aiohttp"):
        contenders.append(launcher.bare())
    if baseline is not None:
        src = export_revision(baseline)
        for name, extra in SPLITSERVE_FLOWS.items():
            if name == "splitserve" or wanted(name):
                contenders.append(launcher.splitserve(f"{name}@{baseline}", *extra, src=src))
    for name in ("splitserve", "splitserve-concurrent", "splitserve-first-token"):
        if wanted(name):
            contenders.append(launcher.splitserve(name, *SPLITSERVE_FLOWS[name]))
    for name, installed, start in (
        ("vllm-router", vllm_router_installed, launcher.vllm_router),
        ("sglang-router", sglang_router_installed, launcher.sglang_router),
    ):
        if wanted(name):
            if installed():
                contenders.append(start())
            else:
                missing.append(name)
    if wanted("splitserve-sglang"):
        contenders.append(
            launcher.splitserve("splitserve-sglang", *SPLITSERVE_FLOWS["splitserve-sglang"])
        )
    return contenders, missing
