"""Goodput under an SLO fixed before the run: colocated servers vs prefill/decode, with and
without the proxy's per-request decision and the adaptive budget on D (issue #18).

A script, not a test. Same two cores for every contender, one core per server, all in one run,
their order rotated from one rate to the next. At each arrival rate of the sweep each contender
gets the same seeded open-loop workload (Poisson arrivals):

- chat requests: prompts of 32 to 512 tokens, outputs of 64 to 256 tokens;
- document requests: prompts of 1,500 to 4,000 tokens, outputs of 16 to 64 tokens;

``DOC_SHARE`` of the requests are documents; every prompt is fresh random token ids (no prefix
is ever reused), sent streamed with ``ignore_eos``. The SLO below is stated before any run and
printed with the results. A request meets it when its TTFT is within its class's bound and the
99th percentile of its own inter-token gaps is within ``SLO_GAP_P99_S`` (a failed request
misses). Per contender and rate: SLO attainment (share of requests that meet it), TTFT and gap
percentiles per class; per contender: its **capacity under SLO**, the highest swept rate at
which it and every lower swept rate keep at least 90% attainment (DistServe's goodput).

Contenders (``--preset`` test model, fp32, one CPU core per server):

- (a) ``colocated``: two plain servers behind the proxy's least-loaded routing (every request
  straight to a server: the proxy's decision with an unbounded threshold), vLLM's default budget;
- (b) ``colocated-lpt``: the same with a 4096 budget and ``--long-prefill-token-threshold 256``;
- (c) ``colocated-adaptive``: the same with the adaptive budget (target ``0.6 x`` the gap SLO);
- (d) ``pd``: 1 P + 1 D with SplitserveConnector, the concurrent flow with the first token from
  P, every request disaggregated;
- (e) ``pd-decide``: the same pair with the per-request decision (default threshold, block 128)
  and the adaptive budget on D (the pair of (d) runs it too: with every request disaggregated D
  prefills nothing, so the budget changes nothing there).

Usage:

    .venv/bin/python benchmarks/goodput.py --dry-run          # the plan: SLO, workload, order
    .venv/bin/python benchmarks/goodput.py --quick --out runs/goodput-quick.json
    .venv/bin/python benchmarks/goodput.py --rates 0.25,0.5,1,1.5 --duration 60 --out ...
    .venv/bin/python benchmarks/goodput.py --preset mid ...   # documents prefill in 2-6 s
    .venv/bin/python benchmarks/goodput.py --from-json A.json B.json --out AB.json --plot AB.png
        # two sweeps of one workload at different rates as one report (nothing is run)

Servers are started per (rate, contender group) and stopped after it (groups: (a), (b), (c),
(d)+(e)), so start-up dominates a short sweep on 2 cores; results go to JSON and a markdown
table on stdout. ``--scheduler-set share_prefill=true`` (repeatable) runs (c) and (e)'s D with
an adaptive option beyond the defaults. The client, the contenders, the report and what is read
from the servers after a run are in ``benchmarks/goodputbench/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.scheduler_settings import HELP as SCHEDULER_SET_HELP
from common.scheduler_settings import parse_scheduler_sets
from goodputbench.client import Result, drive, pct
from goodputbench.contenders import CONTENDERS, Contender, order_for
from goodputbench.report import ATTAINMENT_GOAL, capacity, markdown, merge, plot
from goodputbench.scrape import proxy_decisions, scheduler_figures
from goodputbench.servers import WARM_PROMPTS as WARM_PROMPTS
from goodputbench.servers import start_group
from goodputbench.servers import warm as _warm
from goodputbench.servers import with_tokenizer as _with_tokenizer
from goodputbench.workload import CHAT_OUTPUT as CHAT_OUTPUT
from goodputbench.workload import CHAT_PROMPT as CHAT_PROMPT
from goodputbench.workload import DOC_OUTPUT as DOC_OUTPUT
from goodputbench.workload import DOC_PROMPT as DOC_PROMPT
from goodputbench.workload import DOC_SHARE as DOC_SHARE
from goodputbench.workload import SEED, salted, workload

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec
from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

logger = logging.getLogger("benchmarks.goodput")

# ---------------------------------------------------------------------- stated before any run

SLO_TTFT_CHAT_S = 1.5
SLO_TTFT_DOC_S = 8.0
SLO_GAP_P99_S = 0.25
# ATTAINMENT_GOAL (90%): stated in goodputbench/report.py, beside the capacity rule.
ADAPTIVE_TARGET_SHARE = 0.6  # of the gap bound: docs/scheduler.md, "Tuning"
ADAPTIVE_TARGET_MS = ADAPTIVE_TARGET_SHARE * SLO_GAP_P99_S * 1e3
# The bounds above were set where the mid preset prefilled 2,048 tokens in 2.5 s on one core.
# On a slower core every time scales: --slo-scale multiplies the three bounds (and the adaptive
# target with them) by this machine's time over that one, stated before the run
# (benchmarks/calibrate_engine.py prints the scale for the machine it ran on).
SLO_REFERENCE_PREFILL = (2048, 2.5)  # (tokens, seconds) of mid where the SLO was set
_SLO_BASE = (SLO_TTFT_CHAT_S, SLO_TTFT_DOC_S, SLO_GAP_P99_S)
# The workload's request classes (CHAT_PROMPT, CHAT_OUTPUT, DOC_PROMPT, DOC_OUTPUT, DOC_SHARE)
# and SEED: stated in goodputbench/workload.py, beside the arrivals drawn from them.
MAX_MODEL_LEN = 4096  # the model's own limit; the longest document plus its output fits
BUDGET = 4096  # start-up --max-num-batched-tokens of every server but (a)'s (vLLM's default)
SCHEDULER_CLS = "splitserve.schedulers.vllm.AdaptiveChunkScheduler"
QUICK = {"rates": [0.3, 0.8], "duration": 25.0}
# Extra adaptive-scheduler settings (--scheduler-set KEY=VALUE), e.g. share_prefill=true: the
# policy's options measured one at a time against its defaults.
SCHEDULER_EXTRA: dict[str, Any] = {}


def scale_slo(scale: float) -> None:
    """Set the SLO's bounds and the adaptive target to ``scale`` times the stated ones
    (``--slo-scale``; 1 restores them). Every reader of the bounds (``meets_slo``, the servers'
    target, ``slo_text``, ``sim_vs_goodput``) sees the scaled values."""
    global SLO_TTFT_CHAT_S, SLO_TTFT_DOC_S, SLO_GAP_P99_S, ADAPTIVE_TARGET_MS
    if not scale > 0:
        raise ValueError(f"slo scale must be positive, got {scale}")
    SLO_TTFT_CHAT_S, SLO_TTFT_DOC_S, SLO_GAP_P99_S = (b * scale for b in _SLO_BASE)
    ADAPTIVE_TARGET_MS = ADAPTIVE_TARGET_SHARE * SLO_GAP_P99_S * 1e3


# ---------------------------------------------------------------------- the SLO per request (pure)


def meets_slo(r: Result) -> bool:
    if r.error is not None or r.ttft is None:
        return False
    if r.ttft > (SLO_TTFT_DOC_S if r.kind == "doc" else SLO_TTFT_CHAT_S):
        return False
    gap = pct(r.gaps, 99)
    return gap is None or gap <= SLO_GAP_P99_S


def summarize(results: list[Result]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "attainment": sum(map(meets_slo, results)) / max(1, len(results)),
    }
    out["per_request"] = [
        {
            "kind": r.kind,
            "prompt_tokens": r.prompt_tokens,
            "ttft_s": r.ttft,
            "gap_p99_ms": None if (g := pct(r.gaps, 99)) is None else 1e3 * g,
            "ok": meets_slo(r),
        }
        for r in results
    ]
    for kind in ("chat", "doc"):
        mine = [r for r in results if r.kind == kind and r.ttft is not None]
        ttft = [r.ttft for r in mine if r.ttft is not None]
        gaps = [g for r in mine if (g := pct(r.gaps, 99)) is not None]
        out[kind] = {
            "n": len([r for r in results if r.kind == kind]),
            "attainment": sum(meets_slo(r) for r in results if r.kind == kind)
            / max(1, len([r for r in results if r.kind == kind])),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p90_s": pct(ttft, 90),
            "ttft_p99_s": pct(ttft, 99),
            "gap_p99_p50_ms": None if not gaps else 1e3 * (pct(gaps, 50) or 0),
            "gap_p99_p90_ms": None if not gaps else 1e3 * (pct(gaps, 90) or 0),
        }
    return out


# ---------------------------------------------------------------------- contenders


def _adaptive_args(metrics_port: int | None = None) -> list[str]:
    sched: dict[str, Any] = {"target_itl_ms": ADAPTIVE_TARGET_MS, **SCHEDULER_EXTRA}
    if metrics_port is not None:
        sched["metrics_port"] = metrics_port
    settings = {"splitserve_scheduler": sched}
    return ["--scheduler-cls", SCHEDULER_CLS, "--additional-config", json.dumps(settings)]


def budget_args() -> list[str]:
    """The engine flags every server but (a)'s starts from: context length and budget."""
    return ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(BUDGET)]


def server_args(group: str, role: str, metrics_port: int | None = None) -> list[str]:
    """Engine flags of one server of ``group`` (role: ``s0``/``s1`` colocated, ``p``/``d``);
    ``metrics_port``: where an adaptive scheduler serves its own metrics (its step model's
    prediction error on D's mixed steps is read there)."""
    if group == "colocated":  # vLLM's own default budget
        return ["--max-model-len", str(MAX_MODEL_LEN)]
    base = budget_args()
    if group == "colocated-lpt":
        return [*base, "--long-prefill-token-threshold", "256"]
    if group == "colocated-adaptive" or (group == "pd" and role == "d"):
        return [*base, *_adaptive_args(metrics_port)]
    return base


def proxy_settings(c: Contender, urls: dict[str, str], p_side: int | None) -> dict[str, Any]:
    if c.group != "pd":
        # colocated: every request straight to one of the two servers, the less loaded
        return {
            "port": 0,
            "flow": "sequential",
            "prefill": [{"url": urls["s0"]}],  # never used: the decision sends all to D
            "decode": [{"url": urls["s0"]}, {"url": urls["s1"]}],
            "routing": {"decode": "least_outstanding"},
            "decide": {"tokenizer": "", "threshold_tokens": 10**9, "prefix_blocks": 0},
        }
    settings: dict[str, Any] = {
        "port": 0,
        "flow": "concurrent",
        "prefill": [{"url": urls["p"], "side_channel_port": p_side}],
        "decode": [{"url": urls["d"]}],
    }
    if c.name == "pd-decide":
        settings["decide"] = {"tokenizer": "", "block_tokens": 128}
    return settings


# ---------------------------------------------------------------------- running


def _start_group(group: str, model: Path, log_dir: Path) -> tuple[ServerGroup, dict, int | None]:
    """One group's servers (goodputbench/servers.py), each with this script's ``server_args``
    for its role: read when the group starts, so ``--slo-scale`` and ``--scheduler-set`` reach
    them."""
    return start_group(group, model, log_dir, server_args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="goodput-"))
    model = build_model(resolve_spec(args.preset), work / "model")
    rows: list[dict[str, Any]] = []
    for i, rate in enumerate(args.rates):
        arrivals = workload(rate, args.duration, args.seed)
        order = [c for c in order_for(i) if c.name in args.only]
        logger.info(
            "rate %.2f/s: %d requests; order %s", rate, len(arrivals), [c.name for c in order]
        )
        current: tuple[str, ServerGroup, dict, int | None] | None = None
        for c in order:
            mine = salted(arrivals, CONTENDERS.index(c))
            if current is None or current[0] != c.group:
                if current is not None:
                    current[1].stop()
                servers, urls, p_side = _start_group(c.group, model, work / f"logs-{i}-{c.group}")
                current = (c.group, servers, urls, p_side)
            _, _, urls, p_side = current
            config = build_config(_with_tokenizer(proxy_settings(c, urls, p_side), model))
            with BackgroundProxy(config) as proxy:
                asyncio.run(_warm(proxy.url))
                t0 = time.perf_counter()
                results = asyncio.run(drive(proxy.url, mine))
                wall = time.perf_counter() - t0
                decisions = proxy.state.metrics.render().decode()
            row = {"contender": c.name, "label": c.label, "rate": rate, "wall_s": wall}
            row.update(summarize(results))
            row["decisions"] = proxy_decisions(decisions) if c.name == "pd-decide" else None
            if c.group in ("pd", "colocated-adaptive"):
                role = "d" if c.group == "pd" else "s0"
                row["scheduler"] = scheduler_figures(urls[f"{role}-scheduler"])
            rows.append(row)
            logger.info("%s @ %.2f/s: attainment %.0f%%", c.name, rate, 100 * row["attainment"])
        if current is not None:
            current[1].stop()
    caps = {
        c.name: capacity(
            {r["rate"]: r["attainment"] for r in rows if r["contender"] == c.name},
        )
        for c in CONTENDERS
        if c.name in args.only
    }
    return {"slo": slo_text(), "args": vars(args), "rows": rows, "capacity": caps}


# ---------------------------------------------------------------------- reporting


def _scale_note() -> str:
    scale = SLO_GAP_P99_S / _SLO_BASE[2]
    return "" if abs(scale - 1) < 1e-9 else f", scaled {scale:g}x for this machine"


def slo_text() -> str:
    return (
        f"SLO (fixed before the run{_scale_note()}): TTFT <= {SLO_TTFT_CHAT_S:g} s (chat), <= "
        f"{SLO_TTFT_DOC_S:g} s (documents); each request's p99 inter-token gap <= "
        f"{SLO_GAP_P99_S * 1e3:g} ms; capacity = highest swept rate with >= "
        f"{ATTAINMENT_GOAL:.0%} attainment there and below"
    )


def dry_run(args: argparse.Namespace) -> str:
    """The plan without servers: SLO, contenders, each rate's workload and order."""
    lines = [slo_text(), "contenders:"] + [f"  {c.label}" for c in CONTENDERS]
    if SCHEDULER_EXTRA:
        lines.append(f"adaptive scheduler settings beyond its defaults: {SCHEDULER_EXTRA}")
    for i, rate in enumerate(args.rates):
        w = workload(rate, args.duration, args.seed)
        docs = [a for a in w if a.kind == "doc"]
        tokens = sum(len(a.prompt) for a in w)
        order = ", ".join(c.name for c in order_for(i) if c.name in args.only)
        lines.append(
            f"rate {rate:g}/s: {len(w)} requests ({len(docs)} documents, {tokens} prompt "
            f"tokens) over {args.duration:g} s; order: {order}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--rates", default="0.25,0.5,1.0", help="arrival rates (req/s), comma-separated"
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--preset", default="tiny", help="test model preset")
    ap.add_argument(
        "--only", default=",".join(c.name for c in CONTENDERS), help="contenders to run"
    )
    ap.add_argument(
        "--slo-scale", type=float, default=1.0,
        help="multiply the SLO's TTFT and gap bounds and the adaptive target by this: this "
        "machine's prefill time over the one the SLO was set on (calibrate_engine.py prints it)",
    )  # fmt: skip
    ap.add_argument(
        "--scheduler-set", action="append", default=[], metavar="KEY=VALUE",
        help=f"(c) and (e)'s D: {SCHEDULER_SET_HELP}",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"a short sweep: {QUICK}")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--plot", type=Path, help="PNG: attainment vs rate per contender")
    ap.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="re-render written reports (table, --plot; several: merged, written to --out); "
        "run nothing",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rates, args.duration = ",".join(map(str, QUICK["rates"])), QUICK["duration"]
    args.rates = [float(x) for x in str(args.rates).split(",") if x]
    args.only = [x for x in str(args.only).split(",") if x]
    unknown = set(args.only) - {c.name for c in CONTENDERS}
    if unknown:
        ap.error(f"--only: unknown contender(s) {sorted(unknown)}")
    if not args.slo_scale > 0:
        ap.error(f"--slo-scale must be positive, got {args.slo_scale}")
    scale_slo(args.slo_scale)
    SCHEDULER_EXTRA.clear()
    try:
        SCHEDULER_EXTRA.update(parse_scheduler_sets(args.scheduler_set, ADAPTIVE_TARGET_MS))
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    if args.from_json:
        report = merge([json.loads(p.read_text()) for p in args.from_json])
        if args.out and len(args.from_json) > 1:
            args.out.write_text(json.dumps(report, indent=1))
        print(markdown(report))
        if args.plot:
            plot(report, args.plot)
        return 0
    print(dry_run(args), flush=True)
    if args.dry_run:
        return 0
    report = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report["args"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in report["args"].items()
        }
        args.out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
