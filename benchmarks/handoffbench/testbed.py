"""``handoff.py --testbed``: the viability line on real traffic (issue #16). P and D on two
test-bed hosts (``splitserve.launch.testbed``: network namespaces joined through a bridge, UCX
over tcp only), the client and the proxy on a third; P's link shaped (tbf, both directions) to
each rate in turn while the servers run.

Per contender one P/D pair, started once: ``push`` and ``pull`` (``SplitserveConnector`` with
``"direction"`` set, the concurrent flow through the splitserve proxy) and ``nixl`` (stock
``NixlConnector``, sequential flow, ``VLLM_NIXL_SIDE_CHANNEL_HOST`` the host's address). Per
pair: warm-ups, then colocated requests on its P (no transfer: P's compute alone), then per
link rate (unshaped veth last): the link shaped, its TCP goodput and round trip probed from P's
host to D's (the planner's ``B`` and ``a``), then the requests. Per request:

- ours: ``exposed_s`` (the connector's ``vllm:splitserve_exposed_handoff_seconds``, P's forward
  end -> DONE at D), ``after_p_s`` (client TTFT beyond P's answer), ``p_prefill_s`` (P's
  ``vllm:request_prefill_time_seconds`` for the request: ``t_c = p_prefill_s / L``),
  ``tail_s`` (P's ``vllm:splitserve_forward_tail_seconds``: its last layer hook -> the same
  forward end the exposed clock starts at; the planner's ``t_tail``);
- stock: ``handoff_s`` (P's answer -> D's first token, as ``handoff.py`` measures it),
  ``d_step_s`` (D's one forward after its load, so ``handoff - d_step`` is the transfer).

``viability`` turns the rows into the prediction, the ratios, the tables and the PNG. A delay
(``--delay-ms``) goes through ``LinkShape(delay_ms=...)``; where the test bed cannot add one
(``TestbedError``: no sch_netem) the run says so and continues without.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common.metrics import histogram, histogram_in, metrics_text
from common.plotting import pyplot

from handoffbench import viability
from handoffbench.client import request_body
from handoffbench.flows import run_colocated, run_proxied, run_sequential
from handoffbench.servers import START_TIMEOUT, nixl_kv, splitserve_kv, start_proxy
from splitserve.launch import engines
from splitserve.launch import testbed as tb
from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec

PREFILL = "vllm:request_prefill_time_seconds"
# P's forward tail per request: its last layer hook -> the forward's end (the exposed clock's
# start), recorded by our connector; the planner's ``t_tail``.
TAIL = "vllm:splitserve_forward_tail_seconds"
D_STEP = "vllm:request_prefill_time_seconds"
BLOCK = 128  # vLLM CPU's block size
KINDS = ("push", "pull", "nixl")
QUICK = {"rates": [250.0, 1000.0], "lengths": [512], "repeats": 1, "probe_s": 1.0}
FULL = {
    "rates": [250.0, 500.0, 700.0, 1000.0, 1500.0, 3000.0],
    "lengths": [512, 1024],
    "repeats": 2,
    "probe_s": 2.0,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--testbed (issue #16: P and D on separate test-bed hosts)")
    group.add_argument("--testbed", action="store_true", help="run the viability-line sweep")
    group.add_argument("--quick", action="store_true", help="a short sweep (about 5 minutes)")
    group.add_argument(
        "--rates",
        type=float,
        nargs="+",
        help="link rates in Mbit/s (tbf on P's link); unshaped veth is added",
    )
    group.add_argument("--no-unshaped", action="store_true", help="skip the unshaped link")
    group.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="a fixed one-way delay on P's link (needs netem or its substitute)",
    )
    group.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    group.add_argument("--preset", default="bench", help="model preset (splitserve.models)")


def settings(args: argparse.Namespace, lengths_given: bool, repeats_given: bool) -> dict:
    """The sweep: the quick or full defaults, the command line's choices over them."""
    out = dict(QUICK if args.quick else FULL)
    if args.rates:
        out["rates"] = list(args.rates)
    if lengths_given:
        out["lengths"] = list(args.lengths)
    if repeats_given:
        out["repeats"] = args.repeats
    rates: list[float | None] = sorted(out["rates"])
    if not args.no_unshaped:
        rates.append(None)
    out["rates"] = rates
    return out


# -- the link ----------------------------------------------------------------------------------


class Shaper:
    """``bed.shape`` of P's link, with the delay dropped (once, said) where it cannot be had."""

    def __init__(self, bed: tb.Testbed, delay_ms: float) -> None:
        self.bed, self.delay_ms, self.note = bed, delay_ms, ""

    def __call__(self, rate_mbit: float | None) -> None:
        if self.delay_ms:
            try:
                self.bed.shape("p", tb.LinkShape(rate_mbit=rate_mbit, delay_ms=self.delay_ms))
                return
            except tb.TestbedError as exc:
                self.note = f"--delay-ms {self.delay_ms:g} dropped: {exc}"
                print(self.note, file=sys.stderr, flush=True)
                self.delay_ms = 0.0
        self.bed.shape("p", None if rate_mbit is None else tb.LinkShape(rate_mbit=rate_mbit))


def probe_link(bed: tb.Testbed, seconds: float, pings: int = 20) -> dict[str, float]:
    """TCP from P's host to D's: the median round trip of 1-byte ping-pongs, then the goodput
    of a bulk send for ``seconds`` (received bytes over time at D, the first quarter second of
    slow start and tbf burst left out)."""
    ready, result = threading.Event(), {}

    def receive() -> None:
        with bed["d"].entered(), socket.create_server((bed["d"].address, 0)) as server:
            result["port"] = server.getsockname()[1]
            ready.set()
            server.settimeout(30)
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(pings):
                    conn.sendall(conn.recv(1))
                buf, total, marks = bytearray(1 << 20), 0, []
                while n := conn.recv_into(buf):
                    total += n
                    marks.append((time.perf_counter(), total))
                result["marks"] = marks

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("link probe: D's receiver did not start")
    rtts = []
    with bed["p"].entered(), socket.create_connection((bed["d"].address, result["port"]), 30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pings):
            start = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            rtts.append(time.perf_counter() - start)
        chunk, end = b"\0" * (1 << 20), time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(chunk)
    thread.join(120)
    marks = result.get("marks") or [(0.0, 0)]
    skip = [m for m in marks if m[0] >= marks[0][0] + 0.25] or marks
    elapsed = marks[-1][0] - skip[0][0]
    goodput = (marks[-1][1] - skip[0][1]) / elapsed if elapsed > 0 else 0.0
    rtts.sort()
    return {"goodput_bps": goodput, "rtt_s": rtts[len(rtts) // 2]}


# -- servers -----------------------------------------------------------------------------------


def start_pair(
    bed: tb.Testbed,
    group: ServerGroup,
    kind: str,
    index: int,
    model: Path,
    key_file: Path,
    kv_gib: int,
    max_len: int,
) -> dict:
    """P on host ``p`` (core 0), D on host ``d`` (core 1), each bound to its host's address;
    ports differ per pair (a pair's sockets may linger after it stops)."""
    http, side = 8000 + index, 5701 + 10 * index
    extra = ["--max-model-len", str(max_len), "--max-num-batched-tokens", "2048"]
    urls = {}
    for role, core in (("p", 0), ("d", 1)):
        host = bed[role]
        env = {
            **host.ucx_env(),
            "VLLM_HOST_IP": host.address,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        }
        if kind == "nixl":
            kv = nixl_kv("NixlConnector", role)
            env |= {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": host.address,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
            }
        else:
            kv = splitserve_kv(side, kind)
            kv["kv_connector_extra_config"] |= {
                "side_channel_host": host.address,
                "auth_key_file": str(key_file),
            }
        cmd = engines.vllm_server(
            str(model),
            http,
            host=host.address,
            served_model_name="bench",
            kv_transfer_config=kv,
            extra_args=extra,
            cpu_core=core,
            env=env,
        )
        name = f"tb-{kind}-{role}"
        group.add(name, host.argv(cmd.argv), port=http, host=host.address, env=cmd.env, cpus=[core])
        urls[role] = f"http://{host.address}:{http}"
    group.wait(START_TIMEOUT, names=[f"tb-{kind}-p", f"tb-{kind}-d"])
    return {"p": urls["p"], "d": urls["d"], "p_side": side}


# -- one request per flow ----------------------------------------------------------------------


def _with_prefill(pair: dict, fn) -> dict:  # noqa: ANN001 - a flow
    """``fn``'s row with P's prefill time and (our connector) P's forward tail, from P's
    ``/metrics`` around it."""
    text = metrics_text(pair["p"])
    before, tail_before = histogram_in(text, PREFILL), histogram_in(text, TAIL)
    out = fn()
    time.sleep(0.2)  # P's last step's stats
    text = metrics_text(pair["p"])
    after, tail_after = histogram_in(text, PREFILL), histogram_in(text, TAIL)
    if after[1] > before[1]:
        out["p_prefill_s"] = (after[0] - before[0]) / (after[1] - before[1])
    if tail_after[1] > tail_before[1]:
        out["tail_s"] = (tail_after[0] - tail_before[0]) / (tail_after[1] - tail_before[1])
    return out


def colocated(pair: dict, body: dict) -> dict:
    return _with_prefill(pair, lambda: run_colocated(pair, body))


def ours(pair: dict, body: dict, proxy_url: str) -> dict:
    return _with_prefill(pair, lambda: run_proxied(pair, body, proxy_url))


def stock(pair: dict, body: dict) -> dict:
    def run() -> dict:
        before = histogram(pair["d"], D_STEP)
        out = run_sequential(pair, body, False)
        time.sleep(0.2)
        after = histogram(pair["d"], D_STEP)
        if after[1] > before[1]:
            out["d_step_s"] = (after[0] - before[0]) / (after[1] - before[1])
        return out

    return _with_prefill(pair, run)


# -- the sweep ---------------------------------------------------------------------------------


def measure_kind(
    bed: tb.Testbed,
    shaper: Shaper,
    kind: str,
    pair: dict,
    proxies: list,
    sweep: dict,
    rng: random.Random,
    rows: list,
    links: list,
    out: Path,
) -> None:
    """Warm-ups, colocated requests, then every rate's probe and requests over one pair."""
    if kind == "nixl":
        flow = stock
    else:
        url = start_proxy(pair, False, proxies)
        flow = lambda p, b, u=url: ours(p, b, u)  # noqa: E731
    for _ in range(2):
        flow(pair, request_body(64, rng))
    for length in sweep["lengths"]:
        for _ in range(sweep["repeats"]):
            record(
                rows,
                out,
                links,
                {"kind": kind, "flow": "colocated", "rate": "-", "length": length}
                | colocated(pair, request_body(length, rng)),
            )
    for rate in sweep["rates"]:
        shaper(rate)
        label = viability.rate_label(rate)
        probe = probe_link(bed, sweep["probe_s"])
        links.append({"kind": kind, "rate": label, "rate_mbit": rate} | probe)
        print(json.dumps(links[-1]), flush=True)
        flow(pair, request_body(64, rng))  # the new link's first connection out of the way
        for length in sweep["lengths"]:
            for _ in range(sweep["repeats"]):
                result = flow(pair, request_body(length, rng))
                record(
                    rows,
                    out,
                    links,
                    {
                        "kind": kind,
                        "flow": "transfer",
                        "rate": label,
                        "rate_mbit": rate,
                        "length": length,
                    }
                    | result,
                )
    shaper(None)


def record(rows: list, out: Path, links: list, row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "(partial)", "rows": rows, "links": links}, indent=1))


def run(args: argparse.Namespace, sweep: dict, work: Path, command: str) -> int:
    """The whole sweep, then the report. Servers and the test bed never outlive it."""
    tb.check()
    from splitserve.transfer.auth import write_key_file

    spec = resolve_spec(args.preset)
    model = build_model(spec, work / args.preset)
    key_file = write_key_file(work / "auth.key")
    rng = random.Random(args.seed)
    max_len = max(1024, 2 * max(sweep["lengths"]))
    rows: list[dict] = []
    links: list[dict] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tb.Testbed(["p", "d", "c"]) as bed, bed["c"].entered():
        shaper = Shaper(bed, args.delay_ms)
        for index, kind in enumerate(args.kinds):
            group = ServerGroup(work / f"logs-{kind}")
            proxies: list = []
            try:
                pair = start_pair(
                    bed, group, kind, index, model, key_file, args.kv_cache_gib, max_len
                )
                measure_kind(bed, shaper, kind, pair, proxies, sweep, rng, rows, links, args.out)
            finally:
                for proxy in proxies:
                    proxy.stop()
                group.stop()
                shaper(None)
    meta = {
        "command": command,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "preset": args.preset,
        "delay_ms": shaper.delay_ms,
        "note": shaper.note,
        "sweep": {k: v for k, v in sweep.items()},
    }
    report(rows, links, meta, args.out)
    return 0


def report(rows: list[dict], links: list[dict], meta: dict[str, Any], out: Path) -> None:
    """The JSON (rows, links, summary), the tables and the verdict on stdout, the PNG."""
    spec = resolve_spec(meta.get("preset", "bench"))
    summary = viability.summarize(rows, links, spec.num_layers, spec.kv_bytes_per_token(), BLOCK)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(meta | {"rows": rows, "links": links, "summary": summary}, indent=1))
    print(viability.markdown(summary))
    print()
    print("\n".join(viability.verdict(summary)))
    if meta.get("note"):
        print(meta["note"])
    if viability.plot(summary, out.with_suffix(".png"), pyplot):
        print(f"plot: {out.with_suffix('.png')}")


def resummarize(path: Path, out: Path) -> int:
    earlier = json.loads(path.read_text())
    meta = {k: v for k, v in earlier.items() if k not in ("rows", "links", "summary")}
    report(earlier["rows"], earlier.get("links", []), meta, out)
    return 0
