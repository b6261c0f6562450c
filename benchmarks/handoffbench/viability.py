"""The viability line's arithmetic (pure, no engines): the planner's prediction per point, the
link rate at which streaming stops hiding the transfer, and the run's tables and PNG.

A point is (contender, link rate, prompt length). Its prediction is the planner's
(``splitserve.planner.handoff``): a layer's slice ``s`` (the prompt's KV over ``L`` layers, in
whole blocks) moves in ``t_x = a + s / B`` over a link of goodput ``B`` (the TCP throughput
measured on the shaped link, not its tbf rate) and fixed cost ``a`` (half the link's measured
round trip: the last byte's flight); a layer computes in ``t_c`` (P's measured prefill time of
the same requests over ``L``); exposed = ``t_x + (L - 1) max(0, t_x - t_c)``.

Crossover (the goodput below which streaming stops hiding the transfer):
- predicted: ``t_x = t_c``, i.e. ``B* = s / (t_c - a)``;
- measured: the excess ``e = exposed - t_x`` (what the queue adds beyond one slice) is, by the
  model, ``(L - 1)(s / B - t_c)`` below ``B*`` and 0 above; the points where it is clearly
  nonzero (``> max(2 ms, 25% of t_x)``) are fitted as a line in ``1 / B`` (one point: slope
  ``(L - 1) s``, the model's) and ``B*`` is where that line reaches 0. No clear point: below
  the lowest goodput measured; every point clear: above the highest.
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


def rate_label(rate_mbit: float | None) -> str:
    return "unshaped" if rate_mbit is None else f"{rate_mbit:g}"


def layer_slice_bytes(length: int, kv_bytes_per_token: int, num_layers: int, block: int) -> int:
    """One layer's share of the prompt's KV, in whole blocks (what the connector moves)."""
    blocks = -(-length // block)
    return blocks * block * kv_bytes_per_token // num_layers


def predict(
    num_layers: int, slice_bytes: float, goodput_bps: float, fixed_s: float, layer_compute_s: float
) -> dict[str, float]:
    """The planner's figures for one point: ``t_x``, ``t_c`` and the exposed handoff."""
    link = Link(name="testbed", bytes_per_s=goodput_bps, per_transfer_s=fixed_s)
    t_x = transfer_seconds(slice_bytes, link)
    return {
        "t_x_s": t_x,
        "t_c_s": layer_compute_s,
        "predicted_s": exposed_streaming_seconds(num_layers, t_x, layer_compute_s),
    }


def within(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= max(SLACK_S, TOLERANCE * predicted)


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
        for key in ("exposed_s", "after_p_s", "p_prefill_s", "handoff_s", "d_step_s", "ttft_s"):
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
            if kind in OURS and "p_prefill_s" in entry and "exposed_s" in entry:
                entry |= predict(
                    num_layers,
                    entry["slice_bytes"],
                    entry["goodput_bps"],
                    entry["fixed_s"],
                    entry["p_prefill_s"] / num_layers,
                )
                entry["ratio"] = entry["exposed_s"] / entry["predicted_s"]
                entry["within"] = within(entry["exposed_s"], entry["predicted_s"])
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
                "fixed_s": fixed,
            }
            if measured["bps"]:
                row["ratio"] = measured["bps"] / predicted
                row["within"] = abs(row["ratio"] - 1.0) <= TOLERANCE
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
        out.append(row)
    return out


# -- tables and plot ----------------------------------------------------------------------------


def _ms(row: dict, key: str) -> str:
    return f"{1e3 * row[key]:.1f}" if row.get(key) is not None else "-"


def _yes(row: dict, key: str) -> str:
    return ("yes" if row[key] else "no") if key in row else "-"


def _gbit(bps: float | None) -> str:
    return "-" if bps is None else ("inf" if bps == float("inf") else f"{8 * bps / 1e9:.3f}")


def markdown(summary: dict) -> str:
    """Three tables: points, crossovers, ours against stock."""
    lines = [
        "| contender | link Mbit/s | goodput Gbit/s | prompt | P prefill ms | vs colocated | "
        "t_c ms | t_x ms | predicted ms | measured exposed ms | measured/predicted | "
        "within 25% or 2 ms | beyond P's answer ms | stock handoff ms | stock transfer ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["points"]:
        vs = f"{100 * p['p_prefill_vs_colocated']:+.1f}%" if "p_prefill_vs_colocated" in p else "-"
        ratio = f"{p['ratio']:.2f}" if "ratio" in p else "-"
        lines.append(
            f"| {p['kind']} | {p['rate']} | {_gbit(p.get('goodput_bps'))} | {p['length']} | "
            f"{_ms(p, 'p_prefill_s')} | {vs} | {_ms(p, 't_c_s')} | {_ms(p, 't_x_s')} | "
            f"{_ms(p, 'predicted_s')} | {_ms(p, 'exposed_s')} | {ratio} | {_yes(p, 'within')} | "
            f"{_ms(p, 'after_p_s')} | {_ms(p, 'handoff_s')} | {_ms(p, 'stock_transfer_s')} |"
        )
    lines += [
        "",
        "| direction | prompt | t_c ms | predicted crossover Gbit/s | measured Gbit/s | "
        "measured/predicted | within 25% | how measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["crossovers"]:
        ratio = f"{c['ratio']:.2f}" if "ratio" in c else "-"
        lines.append(
            f"| {c['kind']} | {c['length']} | {_ms(c, 't_c_s')} | {_gbit(c['predicted_bps'])} | "
            f"{_gbit(c['measured_bps'])} | {ratio} | {_yes(c, 'within')} | {c['how']} |"
        )
    lines += [
        "",
        "| direction | link Mbit/s | prompt | ours beyond P's answer ms | stock P answer -> D "
        "1st token ms | ratio | <= 0.25x | ours exposed / stock transfer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in summary["vs_stock"]:
        ratio = f"{v['ratio']:.3f}" if "ratio" in v else "-"
        exposed = f"{v['exposed_ratio']:.3f}" if "exposed_ratio" in v else "-"
        lines.append(
            f"| {v['kind']} | {v['rate']} | {v['length']} | {_ms(v, 'after_p_s')} | "
            f"{_ms(v, 'stock_handoff_s')} | {ratio} | {_yes(v, 'within')} | {exposed} |"
        )
    return "\n".join(lines)


def verdict(summary: dict) -> list[str]:
    """One line per target: how many points hold it."""

    def count(rows: list[dict], key: str) -> str:
        judged = [r for r in rows if key in r]
        return f"{sum(bool(r[key]) for r in judged)} of {len(judged)}"

    return [
        f"exposed within 25% (or 2 ms) of predicted: {count(summary['points'], 'within')}",
        f"crossover within 25% of predicted: {count(summary['crossovers'], 'within')}",
        f"ours <= 0.25x stock (beyond P's answer): {count(summary['vs_stock'], 'within')}",
    ]


def _curve(summary: dict, kind: str, length: int, x: list[float]) -> list[tuple[float, float]]:
    """The prediction as a line over the measured goodputs' range (Gbit/s, ms), from the
    direction's median t_c: the kink is the predicted crossover."""
    row = next((c for c in summary["crossovers"] if (c["kind"], c["length"]) == (kind, length)),
               None)  # fmt: skip
    if row is None or not x:
        return []
    lo, hi = min(x), max(x)
    grid = [lo * (hi / lo) ** (i / 80) for i in range(81)] if hi > lo else [lo]
    return [
        (
            g,
            1e3
            * predict(
                summary["num_layers"], row["slice_bytes"], g * 1e9 / 8, row["fixed_s"], row["t_c_s"]
            )["predicted_s"],
        )  # fmt: skip
        for g in grid
    ]


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
        for c in summary["crossovers"]:
            if c["length"] == length and c["predicted_bps"] != float("inf"):
                ax.axvline(8 * c["predicted_bps"] / 1e9, color=colors[c["kind"]], ls="--", lw=0.8)
        ax.set_title(f"exposed handoff, {length}-token prompt")
        ax.set_xlabel("link goodput, Gbit/s (log)")
        ax.set_ylabel("ms (log)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return True
