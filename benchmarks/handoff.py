"""Handoff benchmark: TTFT and exposed handoff of a P->D pair, rivals side by side in one run.

Model preset ``bench`` (16 layers, 256 KiB of fp32 KV per token), prompt lengths 512..4096,
fresh random prompts per request (no prefix-cache hits), greedy, on one machine:

- ``colocated``: a plain request to one server (the splitserve P server, no transfer);
- ``splitserve-concurrent``: SplitserveConnector through the splitserve proxy with
  ``first_token_from_prefill`` off: P and D get the request at once, KV streamed per layer and
  per chunk while P computes, D computes the last prompt token and samples every token;
- ``splitserve-first-token``: the same with ``first_token_from_prefill`` on: the proxy streams
  the token P sampled as soon as P answers, D loads every prompt token's KV and continues from
  it (its first step samples token 2);
- ``splitserve-first-token-push``: the same flow on a second pair whose connectors set
  ``"direction": "push"`` (P WRITEs every layer; on ``cma`` the pair above pulls: P announces,
  D reads), started after the first pair in the same run; TTFT is compared with the first
  pair's ``colocated`` rows (same core, same server settings);
- ``splitserve-sequential``: SplitserveConnector behind the stock sequential flow (P first,
  then D; P writes everything once D registers);
- ``nixl``: vLLM's stock ``NixlConnector`` (D pulls after P finished), sequential flow;
- ``nixl-push``: vLLM's ``NixlPushConnector`` when the installed vLLM has it;
- ``sglang-colocated``, ``sglang-splitserve``, ``sglang-nixl``, ``sglang-mooncake-tcp``: SGLang
  rows, same model and prompts: our SGLang backend against SGLang's own ``nixl`` and
  ``mooncake`` (TCP) backends, TTFT against a single SGLang server and our exposed handoff
  (``benchmarks/handoff_sglang.py`` says how each is measured; also ``sglang-splitserve-spin``
  and ``sglang-splitserve-nap``, ours with its nap off or without its wake-up checks, named
  only with ``--contenders``).

Each row is measured on NIXL's default path and, with ``--transports default tcp``, again with
``UCX_TLS=tcp`` (a slower link). Per request the client records:

- ``ttft_s``: client send -> first streamed token (for sequential flows: including P);
- ``gap_s``: first streamed token -> second (colocated: one decode step; first-token flow: D's
  DONE wait after P's answer, plus its one forward, which now samples token 2);
- ``after_p_s`` (flows through the proxy): TTFT minus P's answer time as the proxy measured it,
  i.e. what the client waits beyond P's prefill (first-token flow: only the proxy's relay);
- ``handoff_s`` (direct sequential flows): P's answer received -> D's first token (what the
  client waits beyond P's prefill; includes D's one-token forward);
- ``exposed_s`` (splitserve only): from the end of P's last forward (all layers computed) to
  DONE seen at D, from the connector's own ``vllm:splitserve_exposed_handoff_seconds``
  histogram (server timestamps);
- ``on_first_token`` (flows through the proxy): 1 when D completed the load on the first token
  P's engine relayed (``FIRST_TOKEN``), not on P's DONE (pull with the first-token flow);
- ``plain_fallback`` (flows through the proxy): 1 when the proxy served the request in the
  plain flow after P's answer (first-token flow: P's token had no text of its own, or a stop
  string could span the seam; ``splitserve_proxy_first_token_fallbacks_total``); the summary
  counts them (``plain_fallbacks``);
- ``p_post_s`` / ``d_post_s`` (flows through the proxy): seconds P and D spent inside their
  transfer posts for the request (``vllm:splitserve_post_seconds_total``): push, P's WRITEs
  (over ``cma`` the copy, on P's core); pull, P's ANNOUNCE sends and D's READs (the copy, on
  D's core).

The summary adds, per length, TTFT relative to ``colocated`` and the gap beyond colocated's
(one decode step), the figures the first-token flow's targets are stated in: TTFT within 2% of
colocated, token 2 within one layer's transfer plus one decode step of token 1. SGLang rows are
compared within their round: each SGLang contender's requests alternate with requests to the
``sglang-colocated`` server while that contender's pair runs beside it, and those colocated
requests are summarized apart, as ``sglang-colocated/<contender>`` (``sglang_rounds``): a
colocated request measured beside another pair (SGLang's ``nixl``, whose progress thread spins a
core) is not the reference of ours. A second targets table gives issue #25's per SGLang
contender against its round (``handoffbench.sglang_targets.targets``): TTFT at most 1.1x
colocated, and our exposed handoff within the same bound as the vLLM path's.

Dispatch goes through ``splitserve.proxy.dispatch`` like the proxy. Output: a JSON file, a
markdown table on stdout and, when matplotlib is importable, a PNG next to the JSON.

    python benchmarks/handoff.py --lengths 512 1024 2048 4096 --repeats 3 \\
        --transports default tcp --out results/handoff.json

Heterogeneous tensor parallelism (named only with ``--contenders``): ``splitserve-tp2`` is P
with TP 2 feeding D with TP 1 through the proxy's concurrent flow (each P rank's share of the
KV heads streamed per layer; D loads two shares), ``nixl-tp2`` the same sizes with stock
``NixlConnector`` (sequential flow; D reads each P rank's heads). P's two ranks share core 0,
the compute of the TP 1 pairs' P, so TTFT against ``colocated`` shows what the ranks' transfers
and all-reduces cost, not a speed-up; on 2 cores the rows are about the overlap holding per rank
(exposed handoff), not about TP's speed:

    python benchmarks/handoff.py --transports default --lengths 512 2048 --repeats 3 \
        --contenders colocated splitserve-concurrent splitserve-tp2 nixl nixl-tp2 \
        --out results/handoff_tp.json

With ``--testbed`` it runs the viability-line sweep instead (issue #16): P and D on separate
test-bed hosts over shaped links, push, pull and stock ``NixlConnector`` against the planner's
prediction (``handoffbench/testbed.py`` says what it measures, ``handoffbench/viability.py`` how
it is predicted and judged):

    flock /tmp/splitserve-integration.lock .venv/bin/python benchmarks/handoff.py --testbed \\
        --quick --out results/handoff_testbed.json

The parts live in ``benchmarks/handoffbench/`` (client, servers, flows, runner, summary, tables,
testbed, viability); this script is the entry point and its command line.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
from pathlib import Path

from handoffbench.runner import vllm_rows
from handoffbench.servers import nixl_push_available
from handoffbench.summary import measure_links, summarize, targets
from handoffbench.tables import markdown, plot, targets_markdown
from handoffbench.testbed import add_arguments as add_testbed_arguments

from splitserve.models import build_model, resolve_spec

CONTENDERS = [
    "colocated",
    "splitserve-concurrent",
    "splitserve-first-token",
    "splitserve-first-token-push",
    "splitserve-sequential",
    "nixl",
    "nixl-push",
    "sglang-colocated",
    "sglang-splitserve",
    "sglang-nixl",
    "sglang-mooncake-tcp",
]
# Named only with --contenders: P with tensor parallel 2 feeding a D with 1 (issue #17).
TP_CONTENDERS = ["splitserve-tp2", "nixl-tp2"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", help="default 512 1024 2048 4096")
    parser.add_argument("--repeats", type=int, help="default 3")
    parser.add_argument("--transports", nargs="+", default=["default", "tcp"])
    import handoff_sglang  # benchmarks/handoff_sglang.py, next to this script

    known = sorted(set(CONTENDERS + TP_CONTENDERS + handoff_sglang.CONTENDERS))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=known)
    parser.add_argument("--out", type=Path, default=Path("results/handoff.json"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="VLLM_CPU_KVCACHE_SPACE per server (the bench model needs 256 KiB per token; "
        "2 is enough for prompts up to 2048 on a shared 24 GiB machine)",
    )
    parser.add_argument(
        "--resummarize",
        type=Path,
        help="summarize the rows of an earlier run's JSON (measuring the links now) and exit",
    )
    add_testbed_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/handoff.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.testbed:
        return run_testbed(args, command)
    lengths_given, repeats_given = args.lengths is not None, args.repeats is not None
    args.lengths = args.lengths if lengths_given else [512, 1024, 2048, 4096]
    args.repeats = args.repeats if repeats_given else 3
    if args.resummarize:
        return resummarize(args)
    # A plain kill (SIGTERM) must still stop the servers this run started (the runner's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="splitserve-handoff-"))
    model = build_model(resolve_spec("bench"), work / "bench")
    rng = random.Random(args.seed)
    contenders = list(args.contenders)
    if "nixl-push" in contenders and not nixl_push_available():
        print("NixlPushConnector is not in this vLLM: skipped", file=sys.stderr)
        contenders.remove("nixl-push")
    rows = vllm_rows(args, contenders, work, model, rng)
    import handoff_sglang  # benchmarks/handoff_sglang.py, next to this script

    rows += handoff_sglang.rows_for(args, work, model, rng)
    report(rows, command, args.out, measure_links(args.transports))
    return 0


def run_testbed(args: argparse.Namespace, command: str) -> int:
    """The viability-line sweep across test-bed hosts (``handoffbench.testbed``)."""
    from handoffbench import testbed

    if args.resummarize:
        return testbed.resummarize(args.resummarize, args.out)
    sweep = testbed.settings(args, args.lengths is not None, args.repeats is not None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks still run
    work = Path(tempfile.mkdtemp(prefix="splitserve-handoff-testbed-"))
    return testbed.run(args, sweep, work, command)


def report(rows: list[dict], command: str, out: Path, links: dict[str, dict]) -> None:
    """The JSON (rows, summary, links, targets), the two markdown tables and the PNG."""
    import handoff_sglang  # benchmarks/handoff_sglang.py, next to this script

    rounds = sglang_rounds(rows)
    summary = relative_to_round(handoff_sglang.relative_to_colocated(summarize(rounds)))
    goals = targets(summary, links)
    sglang_goals = handoff_sglang.targets(summary, links, rounds)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": command,
                "rows": rows,
                "summary": summary,
                "links": links,
                "targets": goals,
                "sglang_targets": sglang_goals,
            },
            indent=1,
        )
    )
    print(markdown(summary))
    print()
    print(targets_markdown(goals))
    if sglang_goals:  # each SGLang contender against its own round's colocated requests
        print()
        print(handoff_sglang.targets_markdown(sglang_goals))
    if plot(summary, out.with_suffix(".png")):
        print(f"plot: {out.with_suffix('.png')}")


COLOCATED_SGLANG = "sglang-colocated"


def sglang_rounds(rows: list[dict]) -> list[dict]:
    """Each ``sglang-colocated`` row renamed ``sglang-colocated/<round>``, ``<round>`` the SGLang
    contender it alternated with: the row's ``round`` if it names one, else the SGLang
    contender of the last row before it on its transport (``handoff_sglang.run`` appends each
    colocated request right after the contender's request it follows, so earlier runs' JSON
    resummarizes the same way). A colocated row with no round keeps its name."""
    out, current = [], {}
    for row in rows:
        contender = row["contender"]
        if contender == COLOCATED_SGLANG:
            round_of = row.get("round") or current.get(row["transport"])
            if round_of:
                row = row | {"contender": f"{COLOCATED_SGLANG}/{round_of}"}
        elif contender.startswith("sglang-"):
            current[row["transport"]] = contender
        out.append(row)
    return out


def relative_to_round(summary: list[dict]) -> list[dict]:
    """TTFT and gap of each SGLang contender against the colocated requests of its own round
    (``sglang_rounds``); an entry without a round keeps what ``relative_to_colocated`` said."""
    ref = {(e["transport"], e["length"], e["contender"]): e for e in summary}
    for e in summary:
        if not e["contender"].startswith("sglang-") or "/" in e["contender"]:
            continue
        base = ref.get((e["transport"], e["length"], f"{COLOCATED_SGLANG}/{e['contender']}"))
        if base is None:
            continue
        e["ttft_vs_colocated"] = e["ttft_s"] / base["ttft_s"] - 1.0
        if "gap_s" in e and "gap_s" in base:
            e["gap_beyond_colocated_s"] = e["gap_s"] - base["gap_s"]
    return summary


def resummarize(args: argparse.Namespace) -> int:
    """Report an earlier run's rows again (its links, or the links measured now)."""
    earlier = json.loads(args.resummarize.read_text())
    rows = earlier["rows"]
    transports = sorted({r["transport"] for r in rows})
    command = earlier.get("command", "(partial)")
    report(rows, command, args.out, earlier.get("links") or measure_links(transports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
