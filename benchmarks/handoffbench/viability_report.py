"""The viability line's tables and PNG (pure): the points, crossovers and ours-against-stock
markdown tables, one verdict line per target, and the exposed handoff against link goodput,
measured and predicted (``viability.summarize``'s summary; importable from ``viability``)."""

from __future__ import annotations

from handoffbench.viability_model import OURS, STOCK, done_seconds, predict


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
