"""Proxy overhead: added latency and maximum throughput of disaggregating proxies over a direct
connection, all on the same stub backends, in one run.

Two fast stub OpenAI backends (one process plays the prefill server, one the decode server)
answer at once, so what is measured is the proxies' own cost. Contenders, each
its own process, all on those two stubs, on loopback:

- ``direct``: the client posts straight to the decode stub (one upstream request; the reference);
- ``bare-aiohttp``: the least a Python/aiohttp proxy can do for the vLLM sequential flow (P,
  then D, relayed; no validation, routing, metrics, timeouts or retries): the runtime's floor;
- ``splitserve``: ``splitserve proxy``, vLLM sequential flow (P one token, then D with P's
  ``kv_transfer_params``);
- ``splitserve-concurrent``: ``splitserve proxy --flow concurrent`` (P and D at once, the flow
  of ``SplitserveConnector``), and ``splitserve-first-token``, the same with
  ``--first-token-from-prefill`` (P's token sent first, D's stream parsed and rewritten);
- ``vllm-router``: vLLM's Rust router (PyPI ``vllm-router``) in its PD mode
  (``--vllm-pd-disaggregation``): the same work as ``splitserve``, P then D;
- ``sglang-router``: SGLang's Rust router (PyPI ``sglang-router``) in its PD mode (P and D at
  once with bootstrap fields), and ``splitserve-sglang`` (our proxy, ``--engine sglang``, the
  same work);
- ``--baseline REV``: ``splitserve@REV``, our proxy as of git revision REV (sequential flow),
  to measure a change before/after in the same run.

Both Rust routers run with a policy that needs no tokenizer (``round_robin``; vllm-router's
default ``cache_aware`` asks the prefill server to tokenize every prompt first). A router that
is not installed is listed as not measured.

Per cell (stream or not, concurrency C): ``--requests`` (at least 4 x C) with C clients in a
closed loop, in ``--rounds`` rounds (20 warm-up requests each) with the contenders' order
rotating from round to round, so that load from elsewhere hits them alike. Added latency is the
contender's latency minus ``direct``'s at the same percentile; req/s is the throughput at that
concurrency (at 64 and 256 every contender is saturated, so that is its maximum here);
CPU/request is the user+system CPU time of the contender's processes over the cell divided by
the requests it served (warm-up included), the figure least disturbed by other work on the
machine. A request that fails (not 200, an error, or over 60 s) is counted by reason, not timed.
On a small machine every process shares the cores, so read ratios within one run, not absolute
figures. Writes JSON (``--out``) and a PNG (``--plot``, matplotlib).

Load generator and stubs (``--load``, ``--stub-server``): ``wrk`` (Debian's ``wrk`` package;
C, a few microseconds per request; ``--seconds`` per cell, split over the rounds; latency
percentiles are wrk's per round, their median over the rounds reported) with stubs on
splitserve's own HTTP server (``splitserve.proxy.http_server``), or the older pair, an aiohttp
client in this process with aiohttp stubs. Why wrk is the default where installed: the aiohttp
client and stubs spent about 220 us of CPU per proxied request against the proxies' 80 to 110,
so on two cores every contender hit the harness's ceiling (all near 5,400 req/s at 64 clients)
and "maximum requests/s" measured the harness, not the proxy.

    python benchmarks/proxy_overhead.py --seconds 9 --concurrency 1 64 256 \\
        --out runs/proxy_overhead.json --plot docs/img/proxy_overhead.png
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

# ---------------------------------------------------------------------- the stub backend

STREAM_CHUNKS = 8


def _stub_answers() -> tuple[bytes, bytes, list[bytes]]:
    """P's one-token answer (with ``kv_transfer_params``), D's whole answer, D's SSE chunks."""
    answer_p = json.dumps(
        {
            "id": "p",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "stub",
                "remote_block_ids": [[1]],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
            },
        }
    ).encode()
    answer_d = json.dumps(
        {
            "id": "d",
            "object": "text_completion",
            "choices": [{"index": 0, "text": " tok" * STREAM_CHUNKS, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": STREAM_CHUNKS, "total_tokens": 16},
        }
    ).encode()
    chunks = [
        b"data: "
        + json.dumps({"id": "d", "choices": [{"index": 0, "text": " tok"}]}).encode()
        + b"\n\n"
        for _ in range(STREAM_CHUNKS)
    ]
    return answer_p, answer_d, chunks


def stub_app() -> web.Application:
    answer_p, answer_d, chunks = _stub_answers()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") or (
            body.get("max_tokens") == 1 and "bootstrap_room" in body
        ):
            return web.Response(body=answer_p, content_type="application/json")
        if not body.get("stream"):
            return web.Response(body=answer_d, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for c in chunks:
            await out.write(c)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def info(request: web.Request) -> web.Response:  # what SGLang's router asks workers
        return web.json_response(
            {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True, "dp_size": 1}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", info)
    return app


def run_fast_stub(port: int) -> None:
    """The same stub on splitserve's own HTTP server: a fraction of aiohttp's CPU per request, so
    the proxies, not the stubs, decide the throughput."""
    import uvloop

    from splitserve.proxy.http_server import HTTPServer, Request, Response, StreamResponse

    answer_p, answer_d, chunks = _stub_answers()

    async def completions(request: Request) -> Response | StreamResponse:
        body = json.loads(request.body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") or (
            body.get("max_tokens") == 1 and "bootstrap_room" in body
        ):
            return Response(answer_p)
        if not body.get("stream"):
            return Response(answer_d)
        out = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for c in chunks:
            await out.write(c)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    info = json.dumps(
        {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True, "dp_size": 1}
    ).encode()

    async def health(request: Request) -> Response:
        return Response(b"ok", content_type="text/plain")

    async def server_info(request: Request) -> Response:
        return Response(info)

    def error(status: int, message: str) -> Response:
        return Response(json.dumps({"error": {"message": message}}).encode(), status)

    async def main() -> None:
        server = HTTPServer(
            {
                ("POST", "/v1/completions"): completions,
                ("GET", "/health"): health,
                ("GET", "/server_info"): server_info,
                ("GET", "/model_info"): server_info,
            },
            error,
            max_body_bytes=1 << 22,
        )
        await server.start("127.0.0.1", port, backlog=4096)
        await asyncio.Event().wait()

    uvloop.run(main())


def run_stub(port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    # A listen backlog above aiohttp's 128: a proxy opening a connection per client at 256
    # clients overflowed it (ListenOverflows in nstat), and each dropped SYN cost its request a
    # 1 s retransmit, which then read as the proxy's latency.
    web.run_app(
        stub_app(),
        host="127.0.0.1",
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=1,
        backlog=4096,
    )


# ---------------------------------------------------------------------- the bare floor


def run_bare(port: int, prefill: str, decode: str) -> None:
    """The least a Python/aiohttp proxy can do for the sequential flow: P, then D, relayed, with
    no validation, routing, metrics, timeouts or retries. The floor the runtime sets."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    p_url, d_url = prefill + "/v1/completions", decode + "/v1/completions"
    headers = {"Content-Type": "application/json"}

    async def completions(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.json()
        p_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        async with session.post(p_url, data=json.dumps(p_body).encode(), headers=headers) as r:
            params = (await r.json())["kv_transfer_params"]
        d_body = {**body, "kv_transfer_params": params}
        async with session.post(d_url, data=json.dumps(d_body).encode(), headers=headers) as r:
            if not body.get("stream"):
                return web.Response(body=await r.read(), content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/ready", health)
    web.run_app(
        app,
        host="127.0.0.1",
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=1,
        backlog=1024,
    )


# ---------------------------------------------------------------------- load generator

BODY = {"model": "tiny", "prompt": "hello " * 32, "max_tokens": STREAM_CHUNKS, "temperature": 0}
WARMUP = 20  # per round
REQUEST_TIMEOUT_S = 60.0
PROMPT_CHARS = 0  # --prompt-chars: 0 keeps BODY's prompt (192 characters)


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> float | str:
    """One request's latency in seconds, or why it failed (counted, not fatal: on a loaded
    machine one stalled request must not lose a whole run)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            if r.status != 200:
                return f"HTTP {r.status}"
    except (aiohttp.ClientError, TimeoutError) as e:
        return type(e).__name__
    return time.perf_counter() - t0


async def load(
    url: str, stream: bool, concurrency: int, requests: int
) -> tuple[list[float], float, dict[str, int]]:
    """``requests`` requests by ``concurrency`` clients in a closed loop, after a warm-up:
    (latencies in seconds, wall time, failed requests by reason)."""
    data = request_body(stream)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(min(WARMUP, requests)):  # warm-up: connections, caches
            await one(session, url, data)
        latencies: list[float] = []
        failed: dict[str, int] = {}
        todo = iter(range(requests))

        async def worker() -> None:
            for _ in todo:
                got = await one(session, url, data)
                if isinstance(got, str):
                    failed[got] = failed.get(got, 0) + 1
                else:
                    latencies.append(got)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return latencies, wall, failed


def summary(latencies: list[float], wall: float) -> dict[str, float]:
    if len(latencies) < 2:
        nan = float("nan")
        return {"p50_ms": nan, "p99_ms": nan, "mean_ms": nan, "rps": len(latencies) / wall}
    latencies = sorted(latencies)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "rps": len(latencies) / wall,
    }


def measure_cell(
    contenders: list[Contender], stream: bool, conc: int, n: int, rounds: int
) -> dict[str, dict[str, float]]:
    """One cell for every contender, in ``rounds`` rounds of n/rounds requests with the order of
    the contenders rotating, so that a burst of load from elsewhere hits all of them alike."""
    per_round = max(n // rounds, 2 * conc)
    lat: dict[str, list[float]] = {c.name: [] for c in contenders}
    wall = dict.fromkeys(lat, 0.0)
    cpu = dict.fromkeys(lat, 0.0)
    sent = dict.fromkeys(lat, 0)
    failed: dict[str, dict[str, int]] = {name: {} for name in lat}
    for k in range(rounds):
        for c in contenders[k % len(contenders) :] + contenders[: k % len(contenders)]:
            cpu0 = tree_cpu_seconds(c.pid) if c.pid else 0.0
            got, w, bad = asyncio.run(load(c.url + "/v1/completions", stream, conc, per_round))
            for why, count in bad.items():
                failed[c.name][why] = failed[c.name].get(why, 0) + count
            if c.pid:
                cpu[c.name] += tree_cpu_seconds(c.pid) - cpu0
            lat[c.name] += got
            wall[c.name] += w
            sent[c.name] += per_round + min(WARMUP, per_round)
    out = {}
    for c in contenders:
        out[c.name] = summary(lat[c.name], wall[c.name])
        out[c.name]["failed"] = failed[c.name]
        if c.pid:
            out[c.name]["cpu_us_per_request"] = cpu[c.name] / sent[c.name] * 1e6
    return out


# ---------------------------------------------------------------------- wrk as load generator

_WRK_SCRIPT = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%s]==]
"""
_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def request_body(stream: bool) -> bytes:
    body = {**BODY, "stream": stream}
    if PROMPT_CHARS:
        body["prompt"] = "hello " * (PROMPT_CHARS // 6)
    return json.dumps(body).encode()


def wrk_run(url: str, body: bytes, conc: int, seconds: float) -> dict[str, Any]:
    """One wrk run: C connections in a closed loop for ``seconds``; wrk's own percentiles."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_WRK_SCRIPT % body.decode())
        script = f.name
    try:
        duration, timeout = f"{max(1, round(seconds))}s", f"{REQUEST_TIMEOUT_S:.0f}s"
        cmd = ["wrk", "-t", "1", "-c", str(conc), "-d", duration, "--latency",
               "--timeout", timeout, "-s", script, url]  # fmt: skip
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=seconds + REQUEST_TIMEOUT_S + 30
        ).stdout
    finally:
        os.unlink(script)

    def ms(pattern: str) -> float:
        m = re.search(pattern + r"\s+([\d.]+)(us|ms|s|m)\b", out, re.M)
        if m is None:
            raise RuntimeError(f"wrk printed no {pattern!r}:\n{out}")
        return float(m.group(1)) * _WRK_UNITS[m.group(2)]

    done = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if done is None:
        raise RuntimeError(f"wrk printed no request count:\n{out}")
    requests, wall = int(done.group(1)), float(done.group(2)) * _WRK_UNITS[done.group(3)] / 1e3
    failed: dict[str, int] = {}
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        failed["HTTP non-2xx"] = int(bad.group(1))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        for kind, n in zip(("connect", "read", "write", "timeout"), sock.groups(), strict=True):
            if int(n):
                failed[f"socket {kind}"] = int(n)
    return {
        "p50_ms": ms(r"^\s+50%"),
        "p99_ms": ms(r"^\s+99%"),
        "mean_ms": ms(r"^\s+Latency"),
        "requests": requests,
        "ok": requests - failed.get("HTTP non-2xx", 0),
        "wall_s": wall,
        "failed": failed,
    }


def measure_cell_wrk(
    contenders: list[Contender], stream: bool, conc: int, seconds: float, rounds: int
) -> dict[str, dict[str, float]]:
    """One cell with wrk: a 1 s warm-up per contender, then ``rounds`` rounds of
    ``seconds / rounds`` each, the contenders' order rotating. p50 / p99: the median over the
    rounds of wrk's per-round figure; req/s: successful requests over the timed seconds."""
    body = request_body(stream)
    per_round = max(1.0, seconds / rounds)
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
    cpu = dict.fromkeys(runs, 0.0)
    for c in contenders:
        wrk_run(c.url + "/v1/completions", body, conc, 1)
    for k in range(rounds):
        for c in contenders[k % len(contenders) :] + contenders[: k % len(contenders)]:
            cpu0 = tree_cpu_seconds(c.pid) if c.pid else 0.0
            runs[c.name].append(wrk_run(c.url + "/v1/completions", body, conc, per_round))
            if c.pid:
                cpu[c.name] += tree_cpu_seconds(c.pid) - cpu0
    out: dict[str, dict[str, Any]] = {}
    for c in contenders:
        rs = runs[c.name]
        requests = sum(r["requests"] for r in rs)
        failed: dict[str, int] = {}
        for r in rs:
            for why, n in r["failed"].items():
                failed[why] = failed.get(why, 0) + n
        out[c.name] = {
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
            "mean_ms": statistics.fmean(r["mean_ms"] for r in rs),
            "rps": sum(r["ok"] for r in rs) / sum(r["wall_s"] for r in rs),
            "failed": failed,
        }
        if c.pid:
            out[c.name]["cpu_us_per_request"] = cpu[c.name] / max(1, requests) * 1e6
    return out


# ---------------------------------------------------------------------- processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0) -> None:
    import urllib.request

    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{url} not ready after {timeout} s")
        time.sleep(0.2)


def wait_completion(base: str, timeout: float) -> None:
    """Until ``base`` answers a completion with 200 (a router that registers workers late)."""
    import urllib.error
    import urllib.request

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


def tree_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process and its children (proxy workers, router threads)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


@dataclass
class Contender:
    name: str
    url: str
    pid: int | None  # whose CPU time is counted (None: direct)


def export_revision(rev: str) -> Path:
    """The ``splitserve`` package as of git revision ``rev``, in a temporary directory."""
    root = Path(__file__).resolve().parent.parent
    out = Path(tempfile.mkdtemp(prefix="splitserve-baseline-"))
    archive = subprocess.run(
        ["git", "archive", rev, "splitserve"], cwd=root, check=True, capture_output=True
    ).stdout
    tar_path = out / "src.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(out, filter="data")
    return out


class Launcher:
    """Starts the stubs and the contenders; stops all of them on exit."""

    def __init__(self, proxy_workers: int, stub_server: str = "ours") -> None:
        self.py = sys.executable
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workers = proxy_workers
        p_port, d_port = free_port(), free_port()
        self.stub_p, self.stub_d = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        # Two stub processes, P and D (SGLang's router refuses one URL in both roles).
        for port in (p_port, d_port):
            flag = "--fast-stub" if stub_server == "ours" else "--stub"
            self.spawn([self.py, __file__, flag, str(port)])
        wait_http(self.stub_p + "/health")
        wait_http(self.stub_d + "/health")

    def spawn(
        self, cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd
        )
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
        p = self.spawn([self.py, __file__, "--bare", str(port), self.stub_p, self.stub_d])
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


def vllm_router_installed() -> bool:
    return importlib.util.find_spec("vllm_router") is not None


def sglang_router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


# ---------------------------------------------------------------------- report


def print_table(results: list[dict[str, Any]], names: list[str]) -> None:
    """A markdown table: per cell and contender, p50 / p99 / added p50 / req/s / CPU."""
    print("\n| stream | conc. | contender | p50 ms | p99 ms | added p50 ms | added p99 ms "
          "| req/s | req/s vs direct | CPU us/request |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        for name in names:
            r = row[name]
            if name == "direct":
                added = ("", "", "")
            else:
                p50, p99, ratio = r["added_p50_ms"], r["added_p99_ms"], r["rps_vs_direct"]
                added = (f"{p50:+.2f}", f"{p99:+.2f}", f"x{ratio:.2f}")
            cpu = f"{r['cpu_us_per_request']:.0f}" if "cpu_us_per_request" in r else ""
            print(f"| {'yes' if row['stream'] else 'no'} | {row['concurrency']} | {name} "
                  f"| {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added[0]} | {added[1]} "
                  f"| {r['rps']:.0f} | {added[2]} | {cpu} |")  # fmt: skip


def plot(results: list[dict[str, Any]], names: list[str], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the JSON has every figure)")
        return False
    concs = sorted({row["concurrency"] for row in results})
    color = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one color per contender
    fig, axes = plt.subplots(3, 2, figsize=(11, 10), sharex=True)
    for col, stream in enumerate((False, True)):
        rows = {row["concurrency"]: row for row in results if row["stream"] == stream}
        xs = [c for c in concs if c in rows]
        what = "streamed" if stream else "not streamed"
        for name in names:
            style = {"color": color[name], "marker": "o", "label": name}
            if name != "direct":
                added = [max(rows[c][name]["added_p50_ms"], 1e-2) for c in xs]
                axes[0][col].plot(xs, added, **style)
                cpu = [rows[c][name]["cpu_us_per_request"] for c in xs]
                axes[2][col].plot(xs, cpu, **style)
            axes[1][col].plot(xs, [rows[c][name]["rps"] for c in xs], **style)
        axes[0][col].set_title(f"{what}: added p50 latency (dotted: 0.5 ms target)")
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("ms over direct (log)")
        axes[0][col].axhline(0.5, color="grey", ls=":", lw=1)
        axes[1][col].set_title(f"{what}: throughput")
        axes[1][col].set_ylabel("requests/s")
        axes[2][col].set_title(f"{what}: CPU time per request (proxy processes)")
        axes[2][col].set_ylabel("us")
        axes[2][col].set_xscale("log", base=2)
        axes[2][col].set_xticks(concs, [str(c) for c in concs])
        axes[2][col].set_xlabel("concurrent clients")
    axes[1][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def write_json(
    path: Path,
    results: list[dict[str, Any]],
    missing: list[str],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float] | None,
    load: str = "python",
    stub_server: str = "aiohttp",
) -> dict[str, Any]:
    meta = {
        "load_generator": load,
        "stub_server": stub_server,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "argv": sys.argv[1:],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"meta": meta, "results": results, "not_measured": missing}, indent=2)
    )
    return meta


# ---------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument(
        "--rounds", type=int, default=3,
        help="split each cell into this many rounds, the contenders' order rotating",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG plot (matplotlib)")
    ap.add_argument("--proxy-workers", type=int, default=1, help="splitserve proxy --workers")
    ap.add_argument(
        "--baseline", default=None, metavar="REV",
        help="also run splitserve as of this git revision (sequential flow): before/after",
    )  # fmt: skip
    ap.add_argument(
        "--only", nargs="+", default=None, metavar="NAME",
        help="run only these contenders (direct always runs)",
    )  # fmt: skip
    ap.add_argument(
        "--prompt-chars", type=int, default=0,
        help="prompt length in characters (default: 192); long prompts show the JSON cost",
    )  # fmt: skip
    ap.add_argument(
        "--load", choices=("auto", "wrk", "python"), default="auto",
        help="load generator: wrk (default where installed) or this process's aiohttp client",
    )  # fmt: skip
    ap.add_argument(
        "--seconds", type=float, default=6.0,
        help="wrk: timed seconds per cell and contender, split over the rounds",
    )  # fmt: skip
    ap.add_argument(
        "--stub-server", choices=("auto", "ours", "aiohttp"), default="auto",
        help="stub backends on splitserve's HTTP server (default with wrk) or aiohttp's",
    )  # fmt: skip
    ap.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fast-stub", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bare", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stub is not None:
        run_stub(args.stub)
        return
    if args.fast_stub is not None:
        run_fast_stub(args.fast_stub)
        return
    load = args.load
    if load == "auto":
        load = "wrk" if shutil.which("wrk") else "python"
    elif load == "wrk" and not shutil.which("wrk"):
        raise SystemExit("--load wrk: no wrk on PATH (Debian: apt-get install wrk)")
    stub_server = args.stub_server
    if stub_server == "auto":
        stub_server = "ours" if load == "wrk" else "aiohttp"
    print(f"load generator: {load}; stubs: {stub_server}", flush=True)
    if args.bare is not None:
        run_bare(int(args.bare[0]), args.bare[1], args.bare[2])
        return

    global PROMPT_CHARS
    PROMPT_CHARS = args.prompt_chars

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    load_before = os.getloadavg()
    launcher = Launcher(args.proxy_workers, stub_server)
    missing: list[str] = []
    try:
        contenders = [Contender("direct", launcher.stub_d, None)]
        if wanted("bare-aiohttp"):
            contenders.append(launcher.bare())
        if args.baseline is not None:
            src = export_revision(args.baseline)
            contenders.append(launcher.splitserve(f"splitserve@{args.baseline}", src=src))
        if wanted("splitserve"):
            contenders.append(launcher.splitserve("splitserve"))
        if wanted("splitserve-concurrent"):
            contenders.append(
                launcher.splitserve(
                    "splitserve-concurrent", "--flow", "concurrent", "--side-channel-port", "1",
                    "--no-first-token-from-prefill",
                )
            )  # fmt: skip
        if wanted("splitserve-first-token"):
            contenders.append(
                launcher.splitserve(
                    "splitserve-first-token", "--flow", "concurrent", "--side-channel-port", "1",
                    "--first-token-from-prefill",
                )
            )  # fmt: skip
        if wanted("vllm-router"):
            if vllm_router_installed():
                contenders.append(launcher.vllm_router())
            else:
                missing.append("vllm-router")
        if wanted("sglang-router"):
            if sglang_router_installed():
                contenders.append(launcher.sglang_router())
            else:
                missing.append("sglang-router")
        if wanted("splitserve-sglang"):
            contenders.append(
                launcher.splitserve(
                    "splitserve-sglang", "--engine", "sglang", "--bootstrap-port", "8998"
                )
            )
        names = [c.name for c in contenders]
        print("contenders:", ", ".join(names), flush=True)
        results: list[dict[str, Any]] = []
        for stream in (False, True):
            for conc in args.concurrency:
                row: dict[str, Any] = {"stream": stream, "concurrency": conc}
                if load == "wrk":
                    row["seconds"] = args.seconds
                    row.update(
                        measure_cell_wrk(contenders, stream, conc, args.seconds, args.rounds)
                    )
                else:
                    n = row["requests"] = max(args.requests, 4 * conc)
                    row.update(measure_cell(contenders, stream, conc, n, args.rounds))
                d = row["direct"]
                for name in names[1:]:
                    r = row[name]
                    r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"]
                    r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"]
                    r["rps_vs_direct"] = r["rps"] / d["rps"]
                results.append(row)
                if args.out:  # after every cell: a run cut short keeps what it measured
                    write_json(args.out, results, missing, load_before, None, load, stub_server)
                parts = [f"stream={stream!s:5} c={conc:<4}"]
                for name in names:
                    r = row[name]
                    parts.append(
                        f"{name} p50 {r['p50_ms']:.2f} ms"
                        + (f" ({r['added_p50_ms']:+.2f})" if name != "direct" else "")
                        + f" {r['rps']:.0f}/s"
                        + (f" (FAILED: {r['failed']})" if r["failed"] else "")
                    )
                print(" | ".join(parts), flush=True)
    finally:
        launcher.close()
    load_after = os.getloadavg()
    print_table(results, names)
    print(f"\nload average before {load_before}, after {load_after} ({os.cpu_count()} CPUs)")
    if missing:
        print("not installed here, not measured:", ", ".join(missing))
    if args.out:
        write_json(args.out, results, missing, load_before, load_after, load, stub_server)
    if args.plot:
        title = (
            f"proxy overhead on stub backends, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
            f"{os.cpu_count()} CPUs, load generator {load}, stubs {stub_server}, "
            f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} (noisy: read ratios)"
        )
        if plot(results, names, args.plot, title):
            print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
