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
"""

from __future__ import annotations

import statistics
from typing import Any

from splitserve.planner.catalog import Link
from splitserve.planner.handoff import exposed_streaming_seconds, transfer_seconds

OURS = ("push", "pull")
STOCK = "nixl"
TOLERANCE = 0.25  # the targets: within 25% (or 2 ms); crossover within 25%
SLACK_S = 0.002
STOCK_RATIO = 0.25
MEDIANS = ("exposed_s", "after_p_s", "p_prefill_s", "handoff_s", "d_step_s", "ttft_s")


def rate_label(rate_mbit: float | None) -> str:
    return "unshaped" if rate_mbit is None else f"{rate_mbit:g}"


def layer_slice_bytes(length: int, kv_bytes_per_token: int, num_layers: int, block: int) -> int:
    """One layer's share of the prompt's KV, in whole blocks (what the connector moves)."""
    blocks = -(-length // block)
    return blocks * block * kv_bytes_per_token // num_layers


def predict(
    num_layers: int,
    slice_bytes: float,
    goodput_bps: float,
    fixed_s: float,
    layer_compute_s: float,
    tail_s: float | None = None,
    done_s: float | None = None,
) -> dict[str, float]:
    """The planner's figures for one point: ``t_x``, ``t_c``, the plain exposed handoff, the
    stock bulk transfer, and (``tail_s`` known) the exposed handoff with the tail and DONE's
    delivery (``done_s``; default ``fixed_s``, half the round trip)."""
    link = Link(name="testbed", bytes_per_s=goodput_bps, per_transfer_s=fixed_s)
    t_x = transfer_seconds(slice_bytes, link)
    out = {
        "t_x_s": t_x,
        "t_c_s": layer_compute_s,
        "predicted_s": exposed_streaming_seconds(num_layers, t_x, layer_compute_s),
        "bulk_s": transfer_seconds(num_layers * slice_bytes, link),
    }
    if tail_s is not None:
        out |= {
            "tail_s": tail_s,
            "done_s": fixed_s if done_s is None else done_s,
        }
        out["predicted_tail_s"] = exposed_streaming_seconds(
            num_layers, t_x, layer_compute_s, tail_s, out["done_s"]
        )
    return out


def done_seconds(kind: str, fixed_s: float, goodput_bps: float, carrier_bytes: float) -> float:
    """DONE's delivery after the last slice landed, by direction (module docstring)."""
    if kind == "push":
        return 2 * fixed_s + carrier_bytes / goodput_bps
    return fixed_s


def within(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= max(SLACK_S, TOLERANCE * predicted)


def stock_target_bps(
    slice_bytes: float, num_layers: int, t_c: float, tail_s: float, fixed_s: float
) -> float:
    """The slowest goodput at which our exposed transfer can be ``STOCK_RATIO`` of stock's bulk
    one: below the crossover ours is at least ``L t_x - (L - 1) t_c - t_tail`` (the link can
    work only while the forward runs after the first slice) against stock's ``L t_x``, so the
    ratio is at most ``STOCK_RATIO`` only while ``t_x <= ((L - 1) t_c + t_tail) / ((1 - r) L)``
    (DONE and ``a`` left out: microseconds to a few ms here)."""
    t_x = ((num_layers - 1) * t_c + tail_s) / ((1 - STOCK_RATIO) * num_layers)
    spare = t_x - fixed_s
    return slice_bytes / spare if spare > 0 else float("inf")


def predicted_crossover_bps(slice_bytes: float, layer_compute_s: float, fixed_s: float) -> float:
    """The goodput at which one slice moves exactly while the next layer computes."""
    spare = layer_compute_s - fixed_s
    return slice_bytes / spare if spare > 0 else float("inf")


def measured_crossover_bps(points: list[dict], num_layers: int, slice_bytes: float) -> dict:
    """``points``: entries with ``goodput_bps``, ``exposed_s`` and ``t_x_s``. Returns
    ``{"bps": B*|None, "how": ...}`` (module docstring)."""
    pts = sorted(points, key=lambda p: p["goodput_bps"])
    if not pts:
        return {"bps": None, "how": "no points"}
    clear = [p for p in pts if p["exposed_s"] - p["t_x_s"] > max(SLACK_S, TOLERANCE * p["t_x_s"])]
    if not clear:
        return {"bps": None, "how": f"hidden at every rate: below {pts[0]['goodput_bps']:.3g} B/s"}
    xs = [1.0 / p["goodput_bps"] for p in clear]
    es = [p["exposed_s"] - p["t_x_s"] for p in clear]
    if len(clear) == 1:
        slope = (num_layers - 1) * slice_bytes
        intercept = es[0] - slope * xs[0]
        how = "one clear point, the model's slope"
    else:
        mx, me = statistics.fmean(xs), statistics.fmean(es)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (e - me) for x, e in zip(xs, es, strict=True)) / sxx
        intercept = me - slope * mx
        how = f"line through {len(clear)} clear points"
    if slope <= 0 or intercept >= 0:
        return {"bps": None, "how": f"{how}: no zero crossing (slope {slope:.3g})"}
    bps = -slope / intercept
    if len(clear) == len(pts):
        how += "; not hidden at any rate measured"
    return {"bps": bps, "how": how}


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


# -- tables and plot ----------------------------------------------------------------------------


def _ms(row: dict, key: str) -> str:
    return f"{1e3 * row[key]:.1f}" if row.get(key) is not None else "-"


def _yes(row: dict, key: str) -> str:
    return ("yes" if row[key] else "no") if key in row else "-"


def _gbit(bps: float | None) -> str:
    return "-" if bps is None else ("inf" if bps == float("inf") else f"{8 * bps / 1e9:.3f}")


def _ratio(row: dict, key: str, digits: int = 2) -> str:
    return f"{row[key]:.{digits}f}" if key in row else "-"


def markdown(summary: dict) -> str:
    """Three tables: points, crossovers, ours against stock. Each prediction twice: the plain
    formula and with the forward's tail (``-``: no tail measured)."""
    lines = [
        "| contender | link Mbit/s | goodput Gbit/s | prompt | P prefill ms | vs colocated | "
        "t_c ms | t_x ms | t_tail ms | predicted ms | with tail ms | measured exposed ms | "
        "measured/predicted | within 25% or 2 ms | measured/with tail | with tail: within | "
        "beyond P's answer ms | stock handoff ms | stock transfer ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["points"]:
        vs = f"{100 * p['p_prefill_vs_colocated']:+.1f}%" if "p_prefill_vs_colocated" in p else "-"
        lines.append(
            f"| {p['kind']} | {p['rate']} | {_gbit(p.get('goodput_bps'))} | {p['length']} | "
            f"{_ms(p, 'p_prefill_s')} | {vs} | {_ms(p, 't_c_s')} | {_ms(p, 't_x_s')} | "
            f"{_ms(p, 'tail_s')} | {_ms(p, 'predicted_s')} | {_ms(p, 'predicted_tail_s')} | "
            f"{_ms(p, 'exposed_s')} | {_ratio(p, 'ratio')} | {_yes(p, 'within')} | "
            f"{_ratio(p, 'ratio_tail')} | {_yes(p, 'within_tail')} | "
            f"{_ms(p, 'after_p_s')} | {_ms(p, 'handoff_s')} | {_ms(p, 'stock_transfer_s')} |"
        )
    lines += [
        "",
        "| direction | prompt | t_c ms | t_tail ms | predicted crossover Gbit/s | "
        "measured Gbit/s | measured/predicted | within 25% | how measured | "
        "ours <= 0.25x stock possible from Gbit/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["crossovers"]:
        lines.append(
            f"| {c['kind']} | {c['length']} | {_ms(c, 't_c_s')} | {_ms(c, 'tail_s')} | "
            f"{_gbit(c['predicted_bps'])} | {_gbit(c['measured_bps'])} | {_ratio(c, 'ratio')} | "
            f"{_yes(c, 'within')} | {c['how']} | {_gbit(c.get('stock_target_bps'))} |"
        )
    lines += [
        "",
        "| direction | link Mbit/s | prompt | ours beyond P's answer ms | stock P answer -> D "
        "1st token ms | ratio | <= 0.25x | ours exposed / stock transfer | arithmetic bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in summary["vs_stock"]:
        lines.append(
            f"| {v['kind']} | {v['rate']} | {v['length']} | {_ms(v, 'after_p_s')} | "
            f"{_ms(v, 'stock_handoff_s')} | {_ratio(v, 'ratio', 3)} | {_yes(v, 'within')} | "
            f"{_ratio(v, 'exposed_ratio', 3)} | {_ratio(v, 'bound', 3)} |"
        )
    return "\n".join(lines)


def verdict(summary: dict) -> list[str]:
    """One line per target: how many points hold it (the exposed target also with the tail,
    where the run measured it)."""

    def count(rows: list[dict], key: str) -> str:
        judged = [r for r in rows if key in r]
        return f"{sum(bool(r[key]) for r in judged)} of {len(judged)}"

    out = [
        f"exposed within 25% (or 2 ms) of predicted: {count(summary['points'], 'within')}",
        f"crossover within 25% of predicted: {count(summary['crossovers'], 'within')}",
        f"ours <= 0.25x stock (beyond P's answer): {count(summary['vs_stock'], 'within')}",
    ]
    if any("within_tail" in p for p in summary["points"]):
        out.append(
            "exposed within 25% (or 2 ms) of predicted with the tail: "
            f"{count(summary['points'], 'within_tail')}"
        )
    return out


def _curve(
    summary: dict, kind: str, length: int, x: list[float], tail: bool = False
) -> list[tuple[float, float]]:
    """The prediction as a line over the measured goodputs' range (Gbit/s, ms), from the
    direction's median t_c (``tail``: and median t_tail and t_done): the kink is the predicted
    crossover."""
    row = next((c for c in summary["crossovers"] if (c["kind"], c["length"]) == (kind, length)),
               None)  # fmt: skip
    if row is None or not x or (tail and "tail_s" not in row):
        return []
    lo, hi = min(x), max(x)
    grid = [lo * (hi / lo) ** (i / 80) for i in range(81)] if hi > lo else [lo]
    out = []
    for g in grid:
        figures = predict(
            summary["num_layers"],
            row["slice_bytes"],
            g * 1e9 / 8,
            row["fixed_s"],
            row["t_c_s"],
            row["tail_s"] if tail else None,
            done_seconds(kind, row["fixed_s"], g * 1e9 / 8, row["carrier_bytes"]),
        )
        out.append((g, 1e3 * figures["predicted_tail_s" if tail else "predicted_s"]))
    return out


def plot(summary: dict, path, pyplot) -> bool:  # noqa: ANN001 - pathlib.Path, module
    """Exposed handoff against link goodput, measured (markers) and predicted (lines), one
    panel per prompt length, one color per direction; stock's transfer for reference."""
    plt = pyplot()
    if plt is None:
        return False
    points = [p for p in summary["points"] if "goodput_bps" in p]
    lengths = sorted({p["length"] for p in points})
    if not lengths:
        return False
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    colors = {"push": "C0", "pull": "C1", STOCK: "C2"}
    for ax, length in zip(axes[0], lengths, strict=True):
        for kind in (*OURS, STOCK):
            pts = sorted(
                (p for p in points if p["kind"] == kind and p["length"] == length),
                key=lambda p: p["goodput_bps"],
            )
            x = [8 * p["goodput_bps"] / 1e9 for p in pts]
            if kind == STOCK:
                y = [1e3 * p["stock_transfer_s"] for p in pts if "stock_transfer_s" in p]
                if y and len(y) == len(x):
                    ax.plot(x, y, "s:", color=colors[kind], label="NixlConnector transfer")
                continue
            measured = [
                (xi, 1e3 * p["exposed_s"]) for xi, p in zip(x, pts, strict=True) if "exposed_s" in p
            ]
            predicted = _curve(summary, kind, length, x)
            with_tail = _curve(summary, kind, length, x, tail=True)
            if measured:
                ax.plot(
                    *zip(*measured, strict=True), "o", color=colors[kind], label=f"{kind} measured"
                )
            if predicted:
                ax.plot(
                    *zip(*predicted, strict=True),
                    "-",
                    color=colors[kind],
                    alpha=0.6,
                    label=f"{kind} predicted",
                )
            if with_tail:
                ax.plot(
                    *zip(*with_tail, strict=True),
                    "--",
                    color=colors[kind],
                    alpha=0.8,
                    label=f"{kind} predicted with tail",
                )
        for c in summary["crossovers"]:
            if c["length"] == length and c["predicted_bps"] != float("inf"):
                ax.axvline(8 * c["predicted_bps"] / 1e9, color=colors[c["kind"]], ls="--", lw=0.8)
        ax.set_title(f"exposed handoff, {length}-token prompt")
        ax.set_xlabel("link goodput, Gbit/s (log)")
        ax.set_ylabel("ms (log)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.5)  # a tail that hides the whole slice leaves only DONE's us
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return True
