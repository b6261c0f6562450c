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
- ``--baseline REV``: our proxy as of git revision REV, to measure a change before/after in the
  same run: ``splitserve@REV`` (sequential flow) and ``<flow>@REV`` for each other of our
  flows that runs (e.g. ``splitserve-first-token@REV``).

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
splitserve's own HTTP server, or the older pair, an aiohttp client in this process with aiohttp
stubs. Why wrk is the default where installed: the aiohttp client and stubs spent more CPU per
proxied request than the proxies they measured, so on two cores every contender hit the
harness's ceiling and "maximum requests/s" measured the harness, not the proxy
(docs/benchmarks.md, "A server of our own, and a harness that measures the proxy").

``--pin 0:1`` gives every contender's processes CPU 0 and the harness (stubs, wrk, this
script) CPU 1. Unpinned, on two cores, a proxy, two stubs and wrk take turns on both cores
and a contender's requests/s follows how the kernel's scheduler shares them (a third of our
proxy's CPU was the kernel, half of it scheduling; docs/benchmarks.md); pinned, each contender
gets the same one core to itself, the per-core comparison a host with cores to spare makes.

    python benchmarks/proxy_overhead.py --seconds 9 --concurrency 1 64 256 \\
        --out runs/proxy_overhead.json --plot docs/img/proxy_overhead.png

The parts live in ``benchmarks/proxybench/`` (stubs, the bare floor, the launcher, the two load
generators, the report); this script is the entry point and its command line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from proxybench.bare import run_bare
from proxybench.contenders import Contender
from proxybench.launcher import Launcher, start_contenders
from proxybench.load import measure_cell, request_body
from proxybench.report import add_relative, plot, print_table, progress_line, write_json
from proxybench.stubs import run_fast_stub, run_stub
from proxybench.wrk import measure_cell_wrk


def parse_args() -> argparse.Namespace:
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
        help="also run splitserve as of this git revision (the sequential flow and every other "
        "of our flows that runs): before/after",
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
    ap.add_argument(
        "--pin", default=None, metavar="CONTENDER_CPUS:HARNESS_CPUS",
        help="e.g. 0:1: every contender's processes on CPU 0, the stubs, wrk and this script on "
        "CPU 1 (comma-separated lists), so that a contender's requests/s is what its CPUs "
        "give, not how the scheduler shares them with the load generator",
    )  # fmt: skip
    # The stubs and the bare proxy: this script again, each in a process of its own (launcher).
    ap.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fast-stub", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bare", nargs=3, default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def parse_pin(spec: str | None) -> tuple[set[int], set[int]] | None:
    """``--pin A:B`` as (contender CPUs, harness CPUs); refused where they overlap or name a
    CPU this process may not use."""
    if spec is None:
        return None
    try:
        a, b = (set(map(int, part.split(","))) for part in spec.split(":"))
    except ValueError:
        raise SystemExit(
            f"--pin {spec!r}: expected CONTENDER_CPUS:HARNESS_CPUS, e.g. 0:1"
        ) from None
    if a & b:
        raise SystemExit(f"--pin {spec!r}: the two sets must be disjoint")
    allowed = os.sched_getaffinity(0)
    if not (a | b) <= allowed:
        raise SystemExit(f"--pin {spec!r}: this process may only use CPUs {sorted(allowed)}")
    return a, b


def choose_harness(load: str, stub_server: str) -> tuple[str, str]:
    """What ``auto`` stands for: wrk and our stubs where wrk is installed, else the aiohttp
    client and aiohttp stubs."""
    if load == "auto":
        load = "wrk" if shutil.which("wrk") else "python"
    elif load == "wrk" and not shutil.which("wrk"):
        raise SystemExit("--load wrk: no wrk on PATH (Debian: apt-get install wrk)")
    if stub_server == "auto":
        stub_server = "ours" if load == "wrk" else "aiohttp"
    return load, stub_server


def measure_row(
    contenders: list[Contender], stream: bool, conc: int, args: argparse.Namespace, load: str
) -> dict[str, Any]:
    """One cell (streamed or not, ``conc`` clients) for every contender, each one's figures
    also relative to ``direct``'s."""
    row: dict[str, Any] = {"stream": stream, "concurrency": conc}
    body = request_body(stream, args.prompt_chars)
    if load == "wrk":
        row["seconds"] = args.seconds
        row.update(measure_cell_wrk(contenders, body, conc, args.seconds, args.rounds))
    else:
        n = row["requests"] = max(args.requests, 4 * conc)
        row.update(measure_cell(contenders, body, conc, n, args.rounds))
    add_relative(row, [c.name for c in contenders])
    return row


def main() -> None:
    args = parse_args()
    if args.stub is not None:
        run_stub(args.stub)
        return
    if args.fast_stub is not None:
        run_fast_stub(args.fast_stub)
        return
    load, stub_server = choose_harness(args.load, args.stub_server)
    print(f"load generator: {load}; stubs: {stub_server}", flush=True)
    if args.bare is not None:
        run_bare(int(args.bare[0]), args.bare[1], args.bare[2])
        return

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    pin = parse_pin(args.pin)
    if pin is not None:
        os.sched_setaffinity(0, pin[1])  # the stubs and wrk inherit it
        print(f"pinned: contenders on CPUs {sorted(pin[0])}, harness on {sorted(pin[1])}")
    load_before = os.getloadavg()
    launcher = Launcher(
        args.proxy_workers, stub_server, script=__file__, contender_cpus=pin[0] if pin else None
    )
    missing: list[str] = []
    try:
        contenders, missing = start_contenders(launcher, wanted, args.baseline)
        names = [c.name for c in contenders]
        print("contenders:", ", ".join(names), flush=True)
        results: list[dict[str, Any]] = []
        for stream in (False, True):
            for conc in args.concurrency:
                results.append(measure_row(contenders, stream, conc, args, load))
                if args.out:  # after every cell: a run cut short keeps what it measured
                    write_json(args.out, results, missing, load_before, None, load, stub_server)
                print(progress_line(results[-1], names), flush=True)
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
