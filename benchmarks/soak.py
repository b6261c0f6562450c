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
import json
import logging
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soakbench.chaos import chaos, sample, sampler  # noqa: E402
from soakbench.deployment import start, stop  # noqa: E402
from soakbench.load import Record, client, post  # noqa: E402
from soakbench.report import plot, summarize  # noqa: E402

from splitserve.models import build_model, resolve_spec  # noqa: E402


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
