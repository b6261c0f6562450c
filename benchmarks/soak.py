"""Chaos soak: a deployment behind the proxy under steady mixed load, with clients that go away
and servers SIGKILLed on a schedule; nothing may leak and nothing may hang.

What it runs: ``splitserve up`` (1 P + 1 D, or ``--pairs 2``: 2 P + 2 D) with the
SplitserveConnector, the concurrent flow with the first token from P, and the restart policy
``always`` (the supervisor restarts what dies; the proxy readmits it). ``--concurrency`` client
threads send completions of 1 to ``--max-words`` words (about 2.15 tokens a word: up to ~4,000
tokens), streamed and not; ``--disconnect`` of them leave at a random point in 0-2 s. At
``--kill-at`` (fractions of the run) it SIGKILLs ``prefill-0``'s whole process tree, then
``decode-0``'s (never while the previous kill window is open). A kill window runs from the kill
until the proxy's ``/ready`` answers 200 again.

Every ``--sample-s`` seconds it samples each server's (and the proxy's) process-tree RSS, open
file descriptors and KV usage (``vllm:kv_cache_usage_perc``). ``--check`` of the answers are kept
and, once the load stopped, compared with the same request served colocated by a live server
(a request without ``kv_transfer_params``).

Report (stdout, ``--out`` JSON, ``--plot`` PNG): requests, errors inside and outside kill windows,
p50/p99 latency per minute, RSS and fd growth per process (from its first sample after warm-up
to its last), KV usage at idle, checked answers. ``--check-targets`` exits 1 unless the issue's
targets hold: errors < 1% outside kill windows, idle KV 0, proxy RSS growth < 50 MB, engine RSS
growth < 200 MB, checked answers 100% equal.

    python benchmarks/soak.py --minutes 10 --out soak.json --plot soak.png
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import logging
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.metrics import metrics_text, sample_sum  # noqa: E402
from common.plotting import pyplot  # noqa: E402

from splitserve.launch.process import ManagedProcess  # noqa: E402
from splitserve.models import build_model, resolve_spec  # noqa: E402
from splitserve.netutil import free_ports, http_ok  # noqa: E402

logger = logging.getLogger("soak")

MB = 1024 * 1024
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "now"]
KV = "vllm:kv_cache_usage_perc"
TARGETS = {
    "errors_outside_pct": 1.0,
    "proxy_rss_growth_mb": 50.0,
    "engine_rss_growth_mb": 200.0,
}


# -- the deployment ------------------------------------------------------------------------------


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


# -- load ----------------------------------------------------------------------------------------


@dataclass
class Record:
    start: float
    end: float
    words: int
    stream: bool
    outcome: str  # ok | error | left
    error: str = ""
    check: dict[str, Any] | None = None  # body and answer kept for the colocated check


def prompt_of(rng: random.Random, max_words: int) -> str:
    words = max(1, int(math.exp(rng.uniform(0, math.log(max_words)))))
    return " ".join(rng.choice(WORDS) for _ in range(words))


def post(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str] | None = None):
    """(ok, text or error) of one completion, streamed or not."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"Content-Type": "application/json", **(headers or {})},
        )
        r = conn.getresponse()
        if r.status != 200:
            return False, f"{r.status} {r.read()[:200].decode(errors='replace')}"
        if not body.get("stream"):
            return True, json.loads(r.read())["choices"][0]["text"]
        text = []
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return True, "".join(text)
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return False, f"stream error {json.dumps(event)[:200]}"
                text += [c.get("text", "") for c in event.get("choices", [])]
        return False, "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return False, f"transport {exc!r}"
    finally:
        conn.close()


def leave(url: str, body: dict[str, Any], after_s: float) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        time.sleep(after_s)
    except OSError:
        pass
    finally:
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)
        conn.close()


def client(i: int, url: str, args: argparse.Namespace, until: float, records: list[Record]) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < until:
        prompt = prompt_of(rng, args.max_words)
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": rng.randint(1, 16),
            "temperature": 0,
            "stream": rng.random() < 0.5,
        }
        t0 = time.monotonic()
        if rng.random() < args.disconnect:
            leave(url, {**body, "stream": True}, rng.uniform(0, 2))
            records.append(Record(t0, time.monotonic(), len(prompt.split()), True, "left"))
            continue
        ok, result = post(url, body, timeout=args.request_timeout)
        record = Record(t0, time.monotonic(), len(prompt.split()), body["stream"], "ok")
        if not ok:
            record.outcome, record.error = "error", result
            time.sleep(args.error_pause_s)  # as a client would before trying again
        elif rng.random() < args.check:
            record.check = {"body": {**body, "stream": False}, "answer": result}
        records.append(record)


# -- sampling and kills --------------------------------------------------------------------------


def tree_sum(procs: list[psutil.Process], measure) -> int:
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += measure(proc)
    return total


def sample(deployed: Deployed, t0: float) -> dict[str, Any]:
    row: dict[str, Any] = {"t": time.monotonic() - t0}
    for name in deployed.ports:
        procs = deployed.tree(name)
        entry: dict[str, Any] = {
            "pid": procs[0].pid if procs else None,
            "rss_mb": tree_sum(procs, lambda p: p.memory_info().rss) / MB,
            "fds": tree_sum(procs, lambda p: p.num_fds()),
        }
        if name != "proxy":
            try:
                entry["kv"] = sample_sum(metrics_text(deployed.engines[name], timeout=5), KV)
            except Exception:  # noqa: BLE001 - a server being restarted has no /metrics
                entry["kv"] = None
        row[name] = entry
    return row


def sampler(
    deployed: Deployed, t0: float, every: float, stop_at: threading.Event, rows: list
) -> None:
    while not stop_at.is_set():
        rows.append(sample(deployed, t0))
        stop_at.wait(every)


def kill(deployed: Deployed, name: str) -> None:
    procs = deployed.tree(name)
    logger.warning("SIGKILL %s (%d processes)", name, len(procs))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=30)


def wait_back(deployed: Deployed, name: str, bound: float) -> bool:
    """The killed server answers its /health again (the restarted process), then the proxy's
    /ready is 200 (it readmitted it)."""
    end = time.monotonic() + bound
    for url in (deployed.engines[name] + "/health", deployed.proxy_url + "/ready"):
        while not http_ok(url):
            if time.monotonic() > end:
                return False
            time.sleep(1)
    return True


def chaos(
    deployed: Deployed,
    t0: float,
    kills: list[tuple[float, str]],
    windows: list[list[float]],
    stop_at: threading.Event,
) -> None:
    """Each kill at its time (relative to t0), never while an earlier window is open."""
    for at, name in kills:
        if stop_at.wait(max(0.0, t0 + at - time.monotonic())):
            return
        window = [time.monotonic() - t0, math.inf]
        windows.append(window)
        kill(deployed, name)
        ready = wait_back(deployed, name, 900)
        window[1] = time.monotonic() - t0 + 5.0  # readmission and retries settle
        logger.warning("%s back %s at %.0f s", name, "" if ready else "NOT", window[1])
        if stop_at.wait(5.0):
            return


# -- report --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def in_window(r: Record, t0: float, windows: list[list[float]]) -> bool:
    s, e = r.start - t0, r.end - t0
    return any(s <= w1 and e >= w0 for w0, w1 in windows)


def growth(rows: list[dict[str, Any]], name: str, warmup_s: float) -> dict[str, Any]:
    """RSS and fd growth of each process that held ``name``: its last sample minus its first
    sample at least ``warmup_s`` after that process first showed up (a restarted server's warm
    up is not growth)."""
    per_pid: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        entry = row.get(name)
        if entry and entry["pid"]:
            per_pid.setdefault(entry["pid"], []).append({**entry, "t": row["t"]})
    out = {}
    for pid, entries in per_pid.items():
        start = entries[0]["t"] + warmup_s
        steady = [e for e in entries if e["t"] >= start]
        if len(steady) >= 2:
            out[str(pid)] = {
                "rss_mb": round(steady[-1]["rss_mb"] - steady[0]["rss_mb"], 1),
                "fds": steady[-1]["fds"] - steady[0]["fds"],
                "seconds": round(steady[-1]["t"] - steady[0]["t"]),
            }
    return out


def summarize(
    records: list[Record],
    rows: list[dict[str, Any]],
    windows: list[list[float]],
    t0: float,
    checks: list[dict[str, Any]],
    idle_kv: dict[str, float | None],
    args: argparse.Namespace,
) -> dict[str, Any]:
    sent = [r for r in records if r.outcome != "left"]
    outside = [r for r in sent if not in_window(r, t0, windows)]
    inside = [r for r in sent if in_window(r, t0, windows)]
    err_out = [r for r in outside if r.outcome == "error"]
    err_in = [r for r in inside if r.outcome == "error"]
    minutes: dict[int, list[float]] = {}
    for r in sent:
        if r.outcome == "ok":
            minutes.setdefault(int((r.start - t0) // 60), []).append(r.end - r.start)
    per_minute = [
        {
            "minute": m,
            "requests": len(v),
            "p50_s": round(percentile(v, 0.5) or 0, 3),
            "p99_s": round(percentile(v, 0.99) or 0, 3),
        }
        for m, v in sorted(minutes.items())
    ]
    growths = {name: growth(rows, name, args.warmup_s) for name in rows[0] if name != "t"}
    proxy_growth = max((g["rss_mb"] for g in growths.get("proxy", {}).values()), default=None)
    engine_growth = max(
        (g["rss_mb"] for n, gs in growths.items() if n != "proxy" for g in gs.values()),
        default=None,
    )
    equal = sum(1 for c in checks if c["equal"])
    summary = {
        "minutes": args.minutes,
        "pairs": args.pairs,
        "concurrency": args.concurrency,
        "requests": len(records),
        "left_by_client": len(records) - len(sent),
        "ok": sum(1 for r in sent if r.outcome == "ok"),
        "errors_inside_windows": len(err_in),
        "requests_inside_windows": len(inside),
        "errors_outside_windows": len(err_out),
        "requests_outside_windows": len(outside),
        "errors_outside_pct": round(100 * len(err_out) / max(1, len(outside)), 3),
        "kill_windows_s": [[round(a, 1), round(b, 1)] for a, b in windows],
        "per_minute": per_minute,
        "growth": growths,
        "proxy_rss_growth_mb": proxy_growth,
        "engine_rss_growth_mb": engine_growth,
        "idle_kv": idle_kv,
        "checked": len(checks),
        "checked_equal": equal,
        "error_examples_outside": sorted({r.error[:160] for r in err_out})[:10],
        "error_examples_inside": sorted({r.error[:160] for r in err_in})[:10],
    }
    summary["targets_met"] = targets_met(summary)
    return summary


def targets_met(s: dict[str, Any]) -> dict[str, bool]:
    return {
        "errors_outside_lt_1pct": s["errors_outside_pct"] < TARGETS["errors_outside_pct"],
        "idle_kv_zero": all(v == 0.0 for v in s["idle_kv"].values()),
        "proxy_rss_growth_lt_50mb": (s["proxy_rss_growth_mb"] or 0.0)
        < TARGETS["proxy_rss_growth_mb"],
        "engine_rss_growth_lt_200mb": (s["engine_rss_growth_mb"] or 0.0)
        < TARGETS["engine_rss_growth_mb"],
        "checked_all_equal": s["checked"] > 0 and s["checked_equal"] == s["checked"],
    }


def plot(path: Path, records: list[Record], rows: list, windows: list, t0: float) -> None:
    plt = pyplot()
    if plt is None:
        logger.warning("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ok = [r for r in records if r.outcome == "ok"]
    bad = [r for r in records if r.outcome == "error"]
    axes[0].scatter([r.start - t0 for r in ok], [r.end - r.start for r in ok], s=3, label="ok")
    axes[0].scatter(
        [r.start - t0 for r in bad], [r.end - r.start for r in bad], s=12, c="red", label="error"
    )
    axes[0].set_ylabel("latency (s)")
    axes[0].set_yscale("log")
    axes[0].legend(loc="upper right")
    names = [n for n in rows[0] if n != "t"]
    ts = [row["t"] for row in rows]
    for name in names:
        if name != "proxy":
            axes[1].plot(ts, [(row[name].get("kv") or 0) * 100 for row in rows], label=name)
        axes[2].plot(ts, [row[name]["rss_mb"] for row in rows], label=name)
        axes[3].plot(ts, [row[name]["fds"] for row in rows], label=name)
    axes[1].set_ylabel("KV usage (%)")
    axes[2].set_ylabel("RSS of tree (MB)")
    axes[3].set_ylabel("open fds")
    axes[3].set_xlabel("seconds since load start")
    for ax in axes:
        for w0, w1 in windows:
            ax.axvspan(w0, min(w1, ts[-1]), color="orange", alpha=0.2)
        if ax is not axes[0]:
            ax.legend(loc="upper right", fontsize=7)
    fig.suptitle("soak: latency, KV, RSS, fds (orange: kill windows)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# -- main ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.run_dir or tempfile.mkdtemp(prefix="splitserve-soak-"))
    model = build_model(resolve_spec("tiny"), work / "model")
    deployed = start(model, work / "run", args.pairs, work / "up.log")
    records: list[Record] = []
    rows: list[dict[str, Any]] = []
    windows: list[list[float]] = []
    stop_sampling, stop_chaos = threading.Event(), threading.Event()
    try:
        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        duration = args.minutes * 60
        kills = []
        if not args.no_kills:
            at = [float(x) * duration for x in args.kill_at.split(",")]
            kills = list(zip(at, ["prefill-0", "decode-0"], strict=False))
        threads = [
            threading.Thread(
                target=sampler, args=(deployed, t0, args.sample_s, stop_sampling, rows)
            ),
            threading.Thread(target=chaos, args=(deployed, t0, kills, windows, stop_chaos)),
        ]
        clients = [
            threading.Thread(target=client, args=(i, deployed.proxy_url, args, until, records))
            for i in range(args.concurrency)
        ]
        for thread in threads + clients:
            thread.start()
        for thread in clients:
            thread.join(args.minutes * 60 + args.request_timeout + 60)
        stop_chaos.set()  # no new kill; an open window runs until the proxy is ready
        threads[1].join(900)
        # Idle: every server's KV back to 0 within the lease (plus slack).
        idle_kv: dict[str, float | None] = {}
        end = time.monotonic() + args.idle_s
        while True:
            idle_kv = {name: sample(deployed, t0)[name].get("kv") for name in deployed.engines}
            if all(v == 0.0 for v in idle_kv.values()) or time.monotonic() > end:
                break
            time.sleep(1)
        stop_sampling.set()
        threads[0].join(60)
        rows.append(sample(deployed, t0))
        checks = []
        headers = {"Authorization": f"Bearer {deployed.engine_key}"} if deployed.engine_key else {}
        for r in records:
            if r.check is None:
                continue
            url = deployed.engines["decode-0"]
            ok, text = post(url, r.check["body"], args.request_timeout, headers)
            checks.append({"equal": ok and text == r.check["answer"], "words": r.words})
        summary = summarize(records, rows, windows, t0, checks, idle_kv, args)
    finally:
        stop_chaos.set()
        stop_sampling.set()
        rc = stop(deployed)
    summary["up_exit_code"] = rc
    out = {"summary": summary, "samples": rows, "requests": [asdict(r) for r in records]}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if args.plot:
        plot(Path(args.plot), records, rows, windows, t0)
    return summary


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="load duration")
    ap.add_argument("--pairs", type=int, choices=(1, 2), default=1, help="1P+1D or 2P+2D")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=1850, help="~2.15 tokens a word")
    ap.add_argument("--disconnect", type=float, default=0.10, help="share of clients leaving")
    ap.add_argument("--check", type=float, default=0.05, help="share of answers checked")
    ap.add_argument("--kill-at", default="0.3,0.6", help="P's kill, D's kill (fractions)")
    ap.add_argument("--no-kills", action="store_true")
    ap.add_argument("--sample-s", type=float, default=3.0)
    ap.add_argument("--warmup-s", type=float, default=30.0, help="per process, before growth")
    ap.add_argument("--idle-s", type=float, default=60.0, help="bound on KV back to 0 at idle")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument(
        "--error-pause-s", type=float, default=1.0, help="a client's pause after an error"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--out", default=None, help="JSON report")
    ap.add_argument("--plot", default=None, help="PNG plot")
    ap.add_argument("--check-targets", action="store_true", help="exit 1 unless targets hold")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse(argv)
    summary = run(args)
    brief = {k: v for k, v in summary.items() if k not in ("growth", "per_minute")}
    print(json.dumps(brief, indent=1, default=str))
    print("per minute:")
    for m in summary["per_minute"]:
        print(f"  {m['minute']:3d}: {m['requests']:5d} ok, p50 {m['p50_s']} s, p99 {m['p99_s']} s")
    met = summary["targets_met"]
    print("targets:", ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in met.items()))
    return 0 if (not args.check_targets or all(met.values())) else 1


if __name__ == "__main__":
    sys.exit(main())
