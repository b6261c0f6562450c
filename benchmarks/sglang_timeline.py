"""Per-request timeline of the splitserve SGLang backend, from a prefill and a decode server's logs.

Both servers must run with ``SPLITSERVE_SGLANG_TIMELINE=1`` (each logs one
``splitserve-timeline room=... event=... wall=...`` line per event,
``splitserve.connectors.sglang.timeline``, which says what each event marks). This script joins
the two logs by room (SGLang's ``bootstrap_room``, the transfer id) and prints one row per
request, times in milliseconds from the request's first event on either server (the clocks are
wall clocks: the servers must share a host or a synchronised clock):

    python benchmarks/sglang_timeline.py --prefill-log p.log --decode-log d.log [--csv out.csv]

Columns: each event's time (a prefill chunk's forward: first start, last end), then the spans
where the time goes: ``wait_reg`` (P's request -> D's REGISTER seen by P's poll), ``queue``
(P's ``init`` -> its first forward), ``forward`` (the sum of its chunks' forwards), ``gaps``
(between its chunks), ``tail`` (last forward end -> DONE seen at D), split into ``p_result``
(last forward end -> the last chunk's ``send``: SGLang's result processing on P) and
``to_done`` (that ``send`` -> DONE seen at D: the final WRITE, its notification and D's next
poll), ``to_decode`` (DONE -> D's first decode step), ``decode1`` (that step's forward),
``handoff`` (D's exposed handoff). A last row gives the medians.

With ``--rows RUN.json`` (a ``benchmarks/handoff.py`` output: its SGLang PD rows carry the
request's ``room`` and the client's ``send_wall`` / ``first_wall``), each request also gets its
prompt ``length``, the client's points ``client_send`` and ``client_first`` (first streamed
token), and the spans ``to_servers`` (client send -> the first server's event), ``to_client``
(DONE at D -> first token at the client) and ``ttft``; medians are then given per length too:

    python benchmarks/sglang_timeline.py --prefill-log p.log --decode-log d.log --rows run.json

``--plot PNG`` (with ``--rows``, when matplotlib is importable) draws the median request of each
length as a bar of consecutive spans, client send to first token.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.connectors.sglang.timeline import parse_line  # noqa: E402

POINTS = (
    "d_request",
    "p_request",
    "d_bootstrapped",
    "d_registered",
    "p_registered",
    "p_init",
    "fwd_first_start",
    "fwd_last_end",
    "last_layer",
    "p_last_chunk",
    "p_sent",
    "d_done",
    "d_first_decode",
    "d_first_decode_end",
)
SPANS = (
    "wait_reg",
    "queue",
    "forward",
    "gaps",
    "chunks",
    "tail",
    "p_result",
    "to_done",
    "to_decode",
    "decode1",
    "handoff",
)
CLIENT_POINTS = ("client_send", "client_first")  # only with --rows
CLIENT_SPANS = ("to_servers", "to_client", "ttft")


@dataclass
class Request:
    room: str
    events: dict[str, float] = field(default_factory=dict)  # first occurrence by event
    forwards: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per chunk
    last_layer: float = 0.0
    handoff_s: float | None = None
    failed: bool = False
    length: int | None = None  # from the client's rows (--rows)
    client: dict[str, float] = field(default_factory=dict)  # client_send, client_first
    _open: float | None = None

    def add(self, name: str, wall: float, fields: dict[str, str]) -> None:
        if name == "p_forward_start":
            self._open = wall
        elif name == "p_forward_end":
            if self._open is not None:
                self.forwards.append((self._open, wall))
                self._open = None
            self.last_layer = max(self.last_layer, float(fields.get("last_layer", 0) or 0))
        else:
            self.events.setdefault(name, wall)
            if name == "d_done":
                self.handoff_s = float(fields.get("handoff", 0) or 0)
            if name in ("p_failed", "d_failed"):
                self.failed = True

    def points(self) -> dict[str, float]:
        out = dict(self.events)
        if self.forwards:
            out["fwd_first_start"] = self.forwards[0][0]
            out["fwd_last_end"] = self.forwards[-1][1]
        if self.last_layer:
            out["last_layer"] = self.last_layer
        return out

    def row(self) -> dict[str, float | str | None]:
        """Milliseconds from the first event: every point, then the spans (and, if the client's
        rows were read, its points and spans, milliseconds from the same origin)."""
        server_points = self.points()
        points = server_points | self.client
        t0 = min(points.values())
        row: dict[str, float | str | None] = {"room": self.room}
        if self.client:
            row["length"] = self.length
        for name in POINTS:
            row[name] = _ms(points.get(name), t0)
        if self.client:
            for name in CLIENT_POINTS:
                row[name] = _ms(points.get(name), t0)

        def span(a: str, b: str) -> float | None:
            return _ms(points.get(b), points.get(a))

        row["wait_reg"] = span("p_request", "p_registered")
        row["queue"] = span("p_init", "fwd_first_start")
        fwd = sum(end - start for start, end in self.forwards)
        row["forward"] = round(1e3 * fwd, 2) if self.forwards else None
        first_last = span("fwd_first_start", "fwd_last_end")
        row["gaps"] = None if first_last is None else round(first_last - row["forward"], 2)
        row["chunks"] = len(self.forwards)
        row["tail"] = span("fwd_last_end", "d_done")
        row["p_result"] = span("fwd_last_end", "p_last_chunk")
        row["to_done"] = span("p_last_chunk", "d_done")
        row["to_decode"] = span("d_done", "d_first_decode")
        row["decode1"] = span("d_first_decode", "d_first_decode_end")
        row["handoff"] = None if self.handoff_s is None else round(1e3 * self.handoff_s, 2)
        if self.client:
            first_server = min(server_points.values()) if server_points else None
            row["to_servers"] = _ms(first_server, points.get("client_send"))
            row["to_client"] = span("d_done", "client_first")
            row["ttft"] = span("client_send", "client_first")
        row["failed"] = "yes" if self.failed else ""
        return row


def _ms(wall: float | None, t0: float | None) -> float | None:
    return None if wall is None or t0 is None else round(1e3 * (wall - t0), 2)


def read_logs(paths: list[Path]) -> dict[str, Request]:
    """Requests by room, from any number of server logs, in order of first appearance."""
    requests: dict[str, Request] = {}
    for path in paths:
        with path.open(errors="replace") as f:
            for line in f:
                parsed = parse_line(line)
                if parsed is None:
                    continue
                room, name, wall, fields = parsed
                requests.setdefault(room, Request(room)).add(name, wall, fields)
    return dict(sorted(requests.items(), key=lambda kv: min(kv[1].points().values())))


def add_client_rows(requests: dict[str, Request], rows: list[dict]) -> int:
    """The client's send and first-token wall clocks and the prompt length of each request the
    benchmark's ``rows`` name by ``room``; returns how many matched a logged request."""
    matched = 0
    for row in rows:
        request = requests.get(str(row.get("room")))
        if request is None or "send_wall" not in row or "first_wall" not in row:
            continue
        request.client = {"client_send": row["send_wall"], "client_first": row["first_wall"]}
        request.length = row.get("length")
        matched += 1
    return matched


def _median_row(label: str, rows: list[dict]) -> dict[str, float | str | None]:
    median: dict[str, float | str | None] = {"room": label}
    for name in rows[0]:
        if name in ("room", "failed"):
            continue
        values = [row[name] for row in rows if isinstance(row.get(name), int | float)]
        median[name] = round(statistics.median(values), 2) if values else None
    median["failed"] = ""
    return median


def table(requests: dict[str, Request]) -> list[dict[str, float | str | None]]:
    """One row per request, then a row of medians per prompt length (when the client's rows
    gave lengths) and a row of medians over all."""
    rows = [r.row() for r in requests.values() if {"p_request", "d_request"} & set(r.events)]
    if rows and any(r.client for r in requests.values()):
        # rows of requests the client did not name (e.g. warm-ups) are left out
        rows = [row for row in rows if row.get("length") is not None]
    if rows:
        medians = []
        lengths = sorted({row["length"] for row in rows if row.get("length") is not None})
        for length in lengths:
            of_length = [row for row in rows if row.get("length") == length]
            medians.append(_median_row(f"median {length}", of_length))
        rows += medians + [_median_row("median", rows)]
    return rows


# consecutive spans of one request, client send -> first token (the plot's segments)
PLOT_SPANS = (
    ("client -> P", "client_send", "p_request"),
    ("wait for D's REGISTER", "p_request", "p_registered"),
    ("to P's forward", "p_registered", "fwd_first_start"),
    ("P's forward(s)", "fwd_first_start", "fwd_last_end"),
    ("last forward -> DONE at D", "fwd_last_end", "d_done"),
    ("DONE -> client's first token", "d_done", "client_first"),
)


def colocated_ttft_ms(run_rows: list[dict], requests: dict[str, Request]) -> dict[int, float]:
    """Per length, the median TTFT (ms) of the colocated requests of the round of the logged
    PD requests (``sglang-colocated`` rows whose ``round`` is their contender)."""
    contenders = [r.get("contender") for r in run_rows if str(r.get("room")) in requests]
    if not contenders:
        return {}
    contender = max(set(contenders), key=contenders.count)
    by_length: dict[int, list[float]] = {}
    for r in run_rows:
        if r.get("contender") == "sglang-colocated" and r.get("round") == contender:
            by_length.setdefault(int(r["length"]), []).append(1e3 * float(r["ttft_s"]))
    return {length: statistics.median(v) for length, v in by_length.items()}


def plot(
    rows: list[dict[str, float | str | None]],
    path: Path,
    title: str = "",
    reference_ms: dict[int, float] | None = None,
) -> bool:
    """The median request of each length as consecutive spans (``PLOT_SPANS``), with the
    colocated server's median TTFT of the same round as a black tick (``reference_ms``, by
    length); False when matplotlib is missing or no median row has the client's points."""
    medians = [r for r in rows if str(r["room"]).startswith("median ")]
    medians = [r for r in medians if all(r.get(a) is not None for _, a, _ in PLOT_SPANS)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not medians:
        return False
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(medians)))
    colors = plt.get_cmap("tab10").colors
    for y, row in enumerate(medians):
        for i, (label, a, b) in enumerate(PLOT_SPANS):
            start, end = float(row[a]), float(row[b])  # type: ignore[arg-type]
            ax.barh(y, (end - start) / 1e3, left=start / 1e3, color=colors[i],
                    label=label if y == 0 else None)  # fmt: skip
        ref = (reference_ms or {}).get(int(row["length"]))  # type: ignore[arg-type]
        if ref is not None:
            ax.plot([ref / 1e3] * 2, [y - 0.45, y + 0.45], color="black", linewidth=2,
                    label="colocated TTFT (median, same round)" if y == 0 else None)  # fmt: skip
            ttft = float(row["client_first"])  # type: ignore[arg-type]
            ax.annotate(f"{ttft / ref:.2f}x", (ttft / 1e3, y), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=8)  # fmt: skip
    ax.set_yticks(range(len(medians)), [f"{r['length']} tokens" for r in medians])
    ax.set_xlabel("seconds from the client's send (median request)")
    ax.set_title(title or "SGLang P/D with the splitserve backend: where TTFT goes")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(rows: list[dict[str, float | str | None]]) -> str:
    if not rows:
        return "(no splitserve-timeline lines: run both servers with SPLITSERVE_SGLANG_TIMELINE=1)"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = ["" if row.get(c) is None else str(row.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-log", type=Path, required=True)
    parser.add_argument("--decode-log", type=Path, required=True)
    parser.add_argument("--csv", type=Path, help="also write the rows here")
    parser.add_argument(
        "--rows", type=Path, help="a benchmarks/handoff.py JSON: the client's points and lengths"
    )
    parser.add_argument("--plot", type=Path, help="a PNG of the median request per length")
    parser.add_argument("--title", default="", help="the plot's title")
    args = parser.parse_args(argv)
    requests = read_logs([args.prefill_log, args.decode_log])
    reference: dict[int, float] = {}
    if args.rows is not None:
        run_rows = json.loads(args.rows.read_text())["rows"]
        reference = colocated_ttft_ms(run_rows, requests)
        if not add_client_rows(requests, run_rows):
            print(f"no request of {args.rows} is in these logs", file=sys.stderr)
    rows = table(requests)
    print(markdown(rows))
    if args.csv is not None and rows:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.plot is not None:
        if plot(rows, args.plot, args.title, reference):
            print(f"plot: {args.plot}")
        else:
            print("no plot (needs matplotlib and --rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
