"""The viability line's arithmetic (pure, no engines): the planner's prediction per point, the
link rate at which streaming stops hiding the transfer, and the run's tables and PNG.

A point is (contender, link rate, prompt length). Its prediction is the planner's
(``splitserve.planner.handoff``): a layer's slice ``s`` (the prompt's KV over ``L`` layers, in
whole blocks) moves in ``t_x = a + s / B`` over a link of goodput ``B`` (the TCP throughput
measured on the shaped link, not its tbf rate) and fixed cost ``a`` (half the link's measured
round trip: the last byte's flight); a layer computes in ``t_c`` (P's measured prefill time of
the same requests over ``L``); exposed = ``t_x + (L - 1) max(0, t_x - t_c)`` (the planner's
plain figure, ``predicted_s``). With the tail (``predicted_tail_s``): the measured exposed
handoff starts at P's forward end, after the last layer's hook posted the last slice, so the
forward's tail ``t_tail`` (P's connector measures it per request,
``vllm:splitserve_forward_tail_seconds``, from the same end) hides that much of it and DONE's
delivery ``t_done`` adds to it: ``max(0, t_x + (L - 1) max(0, t_x - t_c) - t_tail) + t_done``.
``t_done`` is what the protocol adds after the last slice landed (``done_seconds``): push
posts DONE as the notification of one more WRITE (the last layer's last block again) once P has
seen every WRITE complete, so ``2 a + c / B`` (the completion's way back, the carrier of ``c``
bytes and its flight); pull sends DONE right after the last ANNOUNCE, beside D's READs, so only
``a``. Neither counts the engines' poll cadence (P's and D's loops see completions between
their steps).

Crossover (the goodput below which streaming stops hiding the transfer):
- predicted: ``t_x = t_c``, i.e. ``B* = s / (t_c - a)``;
- measured: the excess ``e = exposed - t_x`` (what the queue adds beyond one slice) is, by the
  model, ``(L - 1)(s / B - t_c)`` below ``B*`` and 0 above; the points where it is clearly
  nonzero (``> max(2 ms, 25% of t_x)``) are fitted as a line in ``1 / B`` (one point: slope
  ``(L - 1) s``, the model's) and ``B*`` is where that line reaches 0. No clear point: below
  the lowest goodput measured; every point clear: above the highest. The tail and DONE do not
  move the crossover (the queue starts where ``t_x = t_c`` whatever follows the last layer), so
  it is judged as before; below it the backlog dominates both terms.

Ours against stock: stock ``NixlConnector`` moves the KV after P's answer in one transfer, so by
the same arithmetic its transfer is the bulk time ``a + L s / B``; ``bound`` is our with-tail
prediction over it: the ratio of our exposed transfer to stock's that no connector moving the
same bytes over the same link beats (far below the crossover it tends to
``1 - (L - 1) t_c / (L t_x)``, i.e. to 1 as the link slows).

This module turns a run's rows into the points, crossovers and ours against stock
(``summarize``); the formulas for one point are ``viability_model``'s, the tables and PNG
``viability_report``'s, both importable from here.
"""

from __future__ import annotations

import statistics
from typing import Any

# The formulas per point (viability_model) and the tables and PNG (viability_report); the
# aliased names are re-exported: testbed.py and the tests read them here.
from handoffbench.viability_model import (
    OURS,
    STOCK,
    STOCK_RATIO,
    TOLERANCE,
    done_seconds,
    layer_slice_bytes,
    measured_crossover_bps,
    predict,
    predicted_crossover_bps,
    stock_target_bps,
    within,
)
from handoffbench.viability_report import markdown as markdown
from handoffbench.viability_report import plot as plot
from handoffbench.viability_report import verdict as verdict

MEDIANS = ("exposed_s", "after_p_s", "p_prefill_s", "handoff_s", "d_step_s", "ttft_s")


def rate_label(rate_mbit: float | None) -> str:
    return "unshaped" if rate_mbit is None else f"{rate_mbit:g}"


def _median(group: list[dict], key: str) -> float | None:
    values = [r[key] for r in group if r.get(key) is not None]
    return statistics.median(values) if values else None


def goodputs(links: list[dict]) -> dict[tuple, dict[str, float]]:
    """Per (contender, rate label), and per rate label alone (key ``(None, rate)``): the median
    goodput and round trip of the probes. A contender's points use the probes taken while its
    pair ran (an unshaped link's goodput is CPU-bound: stock NIXL's spinning threads lower it)."""
    by: dict[tuple, list[dict]] = {}
    for probe in links:
        by.setdefault((probe.get("kind"), probe["rate"]), []).append(probe)
        by.setdefault((None, probe["rate"]), []).append(probe)
    return {
        key: {"goodput_bps": _median(group, "goodput_bps"), "rtt_s": _median(group, "rtt_s")}
        for key, group in by.items()
    }


def summarize(
    rows: list[dict], links: list[dict], num_layers: int, kv_bytes_per_token: int, block: int
) -> dict[str, Any]:
    """Points (medians per contender, rate, length, with the prediction), crossovers per
    (direction, length), and ours against stock per (rate, length)."""
    link = goodputs(links)
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["kind"], row["flow"], row["rate"], row["length"]), []).append(row)
    colocated = {
        (kind, length): _median(group, "p_prefill_s")
        for (kind, flow, _, length), group in groups.items()
        if flow == "colocated"
    }
    points = []
    for (kind, flow, rate, length), group in sorted(groups.items(), key=_order):
        if flow != "transfer":
            continue
        entry: dict[str, Any] = {"kind": kind, "rate": rate, "length": length}
        entry["rate_mbit"] = group[0].get("rate_mbit")
        for key in (*MEDIANS, "tail_s"):
            value = _median(group, key)
            if value is not None:
                entry[key] = value
        entry["n"] = len(group)
        ref = colocated.get((kind, length))
        if ref and "p_prefill_s" in entry:
            entry["p_prefill_vs_colocated"] = entry["p_prefill_s"] / ref - 1.0
        if "handoff_s" in entry and "d_step_s" in entry:
            entry["stock_transfer_s"] = entry["handoff_s"] - entry["d_step_s"]
        probe = link.get((kind, rate)) or link.get((None, rate), {})
        if probe.get("goodput_bps"):
            entry["goodput_bps"] = probe["goodput_bps"]
            entry["fixed_s"] = (probe.get("rtt_s") or 0.0) / 2
            entry["slice_bytes"] = layer_slice_bytes(length, kv_bytes_per_token, num_layers, block)
            entry["carrier_bytes"] = layer_slice_bytes(block, kv_bytes_per_token, num_layers, block)
            if kind in OURS and "p_prefill_s" in entry and "exposed_s" in entry:
                entry |= predict(
                    num_layers,
                    entry["slice_bytes"],
                    entry["goodput_bps"],
                    entry["fixed_s"],
                    entry["p_prefill_s"] / num_layers,
                    entry.get("tail_s"),
                    done_seconds(
                        kind, entry["fixed_s"], entry["goodput_bps"], entry["carrier_bytes"]
                    ),
                )
                entry["ratio"] = entry["exposed_s"] / entry["predicted_s"]
                entry["within"] = within(entry["exposed_s"], entry["predicted_s"])
                if "predicted_tail_s" in entry:
                    entry["ratio_tail"] = entry["exposed_s"] / entry["predicted_tail_s"]
                    entry["within_tail"] = within(entry["exposed_s"], entry["predicted_tail_s"])
        points.append(entry)
    return {
        "num_layers": num_layers,
        "points": points,
        "crossovers": crossovers(points, num_layers),
        "vs_stock": vs_stock(points),
    }


def _order(item: tuple) -> tuple:
    (kind, flow, rate, length), _ = item
    return (kind, flow, length, _rate_key(rate))


def _rate_key(rate: str) -> float:
    """Rates in order, unshaped last (colocated rows have none: first)."""
    if rate == "unshaped":
        return float("inf")
    try:
        return float(rate)
    except ValueError:
        return -1.0


def crossovers(points: list[dict], num_layers: int) -> list[dict]:
    """Per (direction, length): predicted and measured crossover goodput, and their ratio."""
    out = []
    for kind in OURS:
        for length in sorted({p["length"] for p in points if p["kind"] == kind}):
            pts = [
                p
                for p in points
                if p["kind"] == kind and p["length"] == length and "predicted_s" in p
            ]
            if not pts:
                continue
            slice_bytes = pts[0]["slice_bytes"]
            t_c = statistics.median(p["t_c_s"] for p in pts)
            fixed = statistics.median(p["fixed_s"] for p in pts)
            predicted = predicted_crossover_bps(slice_bytes, t_c, fixed)
            measured = measured_crossover_bps(pts, num_layers, slice_bytes)
            row = {
                "kind": kind,
                "length": length,
                "t_c_s": t_c,
                "predicted_bps": predicted,
                "measured_bps": measured["bps"],
                "how": measured["how"],
                "slice_bytes": slice_bytes,
                "carrier_bytes": pts[0]["carrier_bytes"],
                "fixed_s": fixed,
            }
            if measured["bps"]:
                row["ratio"] = measured["bps"] / predicted
                row["within"] = abs(row["ratio"] - 1.0) <= TOLERANCE
            if all("tail_s" in p for p in pts):  # for the plot's with-tail line
                row["tail_s"] = statistics.median(p["tail_s"] for p in pts)
            row["stock_target_bps"] = stock_target_bps(
                slice_bytes, num_layers, t_c, row.get("tail_s", 0.0), fixed
            )
            out.append(row)
    return out


def vs_stock(points: list[dict]) -> list[dict]:
    """Per (direction, rate, length): ours against ``NixlConnector``: what the client waits
    beyond P's answer (ours through the proxy, stock P answer -> D's first token; the target)
    and the exposed transfer alone (ours exposed, stock's handoff less D's one forward)."""
    stock = {(p["rate"], p["length"]): p for p in points if p["kind"] == STOCK}
    out = []
    for p in points:
        ref = stock.get((p["rate"], p["length"]))
        if p["kind"] not in OURS or ref is None or "handoff_s" not in ref:
            continue
        row = {
            "kind": p["kind"],
            "rate": p["rate"],
            "length": p["length"],
            "stock_handoff_s": ref["handoff_s"],
        }
        if "after_p_s" in p:
            row["after_p_s"] = p["after_p_s"]
            row["ratio"] = p["after_p_s"] / ref["handoff_s"]
            row["within"] = row["ratio"] <= STOCK_RATIO
        if "exposed_s" in p and ref.get("stock_transfer_s", 0) > 0:
            row["exposed_ratio"] = p["exposed_s"] / ref["stock_transfer_s"]
        best = p.get("predicted_tail_s", p.get("predicted_s"))
        if best is not None and p.get("bulk_s"):
            row["bound"] = best / p["bulk_s"]
        out.append(row)
    return out
