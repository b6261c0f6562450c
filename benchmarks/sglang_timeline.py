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
(between its chunks), ``tail`` (last forward end -> DONE seen at D), ``to_decode`` (DONE -> D's
first decode step), ``handoff`` (D's exposed handoff). A last row gives the medians.
"""

from __future__ import annotations

import argparse
import csv
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
)
SPANS = ("wait_reg", "queue", "forward", "gaps", "chunks", "tail", "to_decode", "handoff")


@dataclass
class Request:
    room: str
    events: dict[str, float] = field(default_factory=dict)  # first occurrence by event
    forwards: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per chunk
    last_layer: float = 0.0
    handoff_s: float | None = None
    failed: bool = False
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
        """Milliseconds from the first event: every point, then the spans."""
        points = self.points()
        t0 = min(points.values())
        row: dict[str, float | str | None] = {"room": self.room}
        for name in POINTS:
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
        row["to_decode"] = span("d_done", "d_first_decode")
        row["handoff"] = None if self.handoff_s is None else round(1e3 * self.handoff_s, 2)
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


def table(requests: dict[str, Request]) -> list[dict[str, float | str | None]]:
    """One row per request, then a row of medians."""
    rows = [r.row() for r in requests.values() if {"p_request", "d_request"} & set(r.events)]
    if rows:
        median: dict[str, float | str | None] = {"room": "median"}
        for name in (*POINTS, *SPANS):
            values = [row[name] for row in rows if isinstance(row.get(name), int | float)]
            median[name] = round(statistics.median(values), 2) if values else None
        median["failed"] = ""
        rows.append(median)
    return rows


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
    args = parser.parse_args(argv)
    rows = table(read_logs([args.prefill_log, args.decode_log]))
    print(markdown(rows))
    if args.csv is not None and rows:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
