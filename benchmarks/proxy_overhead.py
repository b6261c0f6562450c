"""Proxy overhead: added latency and throughput of the splitserve proxy over a direct connection.

Two fast stub OpenAI backends (aiohttp on uvloop when available; one process plays the prefill
server, one the decode server) answer instantly, and every contender talks to them on loopback:

- ``direct``: the client posts straight to the decode stub (one upstream request);
- ``splitserve``: ``splitserve proxy`` (its own process) in the vLLM sequential flow: one prefill
  request, then the decode request, then the relay;
- ``bare-aiohttp``: the least a Python/aiohttp proxy can do for the same flow (the floor the
  runtime sets), so that the cost of our own logic shows;
- when ``sglang_router`` is importable (the SGLang test venv): SGLang's Rust router and our proxy
  with ``--engine sglang`` (the same work: P and D at once, bootstrap fields);
- ``vllm-router`` and vLLM's toy proxy are not installed here: listed as not measured.

Added latency is the contender's latency minus the direct latency at the same percentile and
concurrency. The load generator is an aiohttp client in this process. On a small machine the
three processes share the cores, so read ratios within one run, not absolute numbers.

    python benchmarks/proxy_overhead.py --requests 1000 --out results/proxy_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

# ---------------------------------------------------------------------- the stub backend

STREAM_CHUNKS = 8


def stub_app() -> web.Application:
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


def run_stub(port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(
        stub_app(), host="127.0.0.1", port=port, access_log=None, print=None, shutdown_timeout=1
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
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, shutdown_timeout=1)


# ---------------------------------------------------------------------- load generator

BODY = {"model": "tiny", "prompt": "hello " * 32, "max_tokens": STREAM_CHUNKS, "temperature": 0}


async def one(session: aiohttp.ClientSession, url: str, stream: bool) -> float:
    body = {**BODY, "stream": stream}
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {await r.text()}")
        await r.read()
    return time.perf_counter() - t0


async def load(url: str, stream: bool, concurrency: int, requests: int) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(min(50, requests)):  # warm-up: connections, caches
            await one(session, url, stream)
        latencies: list[float] = []
        todo = iter(range(requests))

        async def worker() -> None:
            for _ in todo:
                latencies.append(await one(session, url, stream))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    latencies.sort()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "rps": len(latencies) / wall,
    }


def wait_http(url: str, timeout: float = 30.0) -> None:
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


class _TreeCpu:
    """CPU times of a process and its children (the proxy's workers)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total


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
        time.sleep(1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--proxy-workers", type=int, default=1, help="splitserve proxy --workers")
    ap.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bare", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stub is not None:
        run_stub(args.stub)
        return
    if args.bare is not None:
        run_bare(int(args.bare[0]), args.bare[1], args.bare[2])
        return

    py = sys.executable
    p_port, d_port, proxy_port, bare_port, sg_port, sgp_port, sg_metrics = (
        free_port() for _ in range(7)
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # Two stub processes: the prefill and the decode server (SGLang's router refuses one
        # URL in both roles). `direct` talks to the decode stub.
        for port in (p_port, d_port):
            procs.append(subprocess.Popen([py, __file__, "--stub", str(port)]))
        stub_p, stub_d = (f"http://127.0.0.1:{port}" for port in (p_port, d_port))
        wait_http(stub_p + "/health")
        wait_http(stub_d + "/health")
        procs.append(
            subprocess.Popen(
                [py, "-m", "splitserve.cli", "proxy", "--prefill", stub_p, "--decode", stub_d,
                 "--port", str(proxy_port), "--workers", str(args.proxy_workers)],
                stdout=subprocess.DEVNULL,
            )
        )  # fmt: skip
        proxy = f"http://127.0.0.1:{proxy_port}"
        wait_http(proxy + "/ready")
        proxy_cpu = _TreeCpu(procs[-1].pid)
        procs.append(subprocess.Popen([py, __file__, "--bare", str(bare_port), stub_p, stub_d]))
        bare = f"http://127.0.0.1:{bare_port}"
        wait_http(bare + "/ready")
        contenders = {"direct": stub_d, "bare-aiohttp": bare, "splitserve": proxy}
        missing = []
        if importlib.util.find_spec("sglang_router") is not None:
            # SGLang's flow (P and D at once, bootstrap fields): its Rust router against ours.
            procs.append(
                subprocess.Popen(
                    [py, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                     "--prefill", stub_p, "8998", "--decode", stub_d,
                     "--host", "127.0.0.1", "--port", str(sg_port),
                     "--prometheus-port", str(sg_metrics)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [py, "-m", "splitserve.cli", "proxy", "--engine", "sglang",
                     "--prefill", stub_p, "--bootstrap-port", "8998", "--decode", stub_d,
                     "--port", str(sgp_port), "--workers", str(args.proxy_workers)],
                    stdout=subprocess.DEVNULL,
                )
            )  # fmt: skip
            sg_router = f"http://127.0.0.1:{sg_port}"
            wait_completion(sg_router, timeout=300)  # it registers its workers after listening
            wait_http(f"http://127.0.0.1:{sgp_port}/ready")
            contenders["sglang-router"] = sg_router
            contenders["splitserve-sglang"] = f"http://127.0.0.1:{sgp_port}"
        else:
            missing.append("sglang-router")
        if shutil.which("vllm-router") is None:
            missing.append("vllm-router")
        try:
            import vllm.entrypoints.disagg_proxy  # noqa: F401  (not shipped in the 0.32 wheel)
        except ImportError:
            missing.append("vllm toy proxy")
        results: list[dict[str, Any]] = []
        for stream in (False, True):
            for c in args.concurrency:
                n = max(args.requests, 4 * c)
                row: dict[str, Any] = {"stream": stream, "concurrency": c}
                for name, base in contenders.items():
                    cpu0 = proxy_cpu.cpu_seconds()
                    row[name] = asyncio.run(load(base + "/v1/completions", stream, c, n))
                    cpu1 = proxy_cpu.cpu_seconds()
                    if name == "splitserve":  # warm-up requests included: an upper bound
                        used = cpu1 - cpu0
                        row[name]["cpu_us_per_request"] = used / (n + min(50, n)) * 1e6
                d = row["direct"]
                parts = [f"stream={stream!s:5} c={c:<4}"]
                for name in contenders:
                    r = row[name]
                    part = f"{name} p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} ms {r['rps']:.0f}/s"
                    if name != "direct":
                        r["added_p50_ms"] = r["p50_ms"] - d["p50_ms"]
                        r["added_p99_ms"] = r["p99_ms"] - d["p99_ms"]
                        r["rps_vs_direct"] = r["rps"] / d["rps"]
                        part += f" (added p50 {r['added_p50_ms']:+.2f} ms)"
                    parts.append(part)
                s = row["splitserve"]
                parts.append(
                    f"splitserve/bare: rps x{s['rps'] / row['bare-aiohttp']['rps']:.2f}, "
                    f"{s['cpu_us_per_request']:.0f} us CPU/request"
                )
                if "sglang-router" in row:
                    ratio = row["splitserve-sglang"]["rps"] / row["sglang-router"]["rps"]
                    parts.append(f"splitserve-sglang/sglang-router: rps x{ratio:.2f}")
                results.append(row)
                print(" | ".join(parts), flush=True)
        if missing:
            print("not installed here, not measured:", ", ".join(missing))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"results": results, "not_measured": missing}, indent=2))
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
