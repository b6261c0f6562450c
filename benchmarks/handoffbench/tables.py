"""The run's markdown tables (the summary, the targets) and its PNG."""

from __future__ import annotations

from pathlib import Path

from common.plotting import pyplot


def _ms(row: dict, key: str) -> str:
    """A seconds figure of a table row in milliseconds, "-" where the row has none."""
    return f"{1e3 * row[key]:.1f}" if key in row else "-"


def targets_markdown(rows: list[dict]) -> str:
    lines = [
        "| transport | prompt | bulk transfer ms | bound: bulk/layers + 2 ms | exposed ms | met | "
        "ours: P answer -> D 1st token ms | NixlConnector ms | ratio | <= 0.25x | "
        "first token: TTFT vs colocated | <= 2% | token 2 beyond colocated ms | "
        "token 2 beyond D's step ms | one layer ms | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def ms(key, r=r):
            return _ms(r, key)

        def ok(key, r=r):
            return ("yes" if r[key] else "no") if key in r else "-"

        ratio = f"{r['vs_nixl']:.3f}" if "vs_nixl" in r else "-"
        key = "first_token_ttft_vs_colocated"
        pct = f"{100 * r[key]:+.1f}%" if key in r else "-"
        lines.append(
            f"| {r['transport']} | {r['length']} | {ms('bulk_s')} | {ms('bound_s')} | "
            f"{ms('exposed_s')} | {ok('exposed_ok')} | {ms('after_p_s')} | "
            f"{ms('nixl_handoff_s')} | {ratio} | {ok('vs_nixl_ok')} | {pct} | "
            f"{ok('first_token_ttft_ok')} | {ms('token2_beyond_s')} | "
            f"{ms('token2_beyond_step_s')} | {ms('one_layer_s')} | "
            f"{ok('token2_ok')} |"
        )
    return "\n".join(lines)


def markdown(summary: list[dict]) -> str:
    lines = [
        "| transport | contender | prompt | TTFT ms | TTFT vs colocated | token 1 -> 2 ms | "
        "gap beyond colocated ms | gap beyond its own decode step ms | "
        "TTFT beyond P's answer ms | P answer -> D 1st token ms | "
        "exposed (forward end -> DONE) ms | P's posts ms | D's posts ms | plain fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:

        def ms(key, e=e):
            return _ms(e, key)

        vs = f"{100 * e['ttft_vs_colocated']:+.1f}%" if "ttft_vs_colocated" in e else "-"
        lines.append(
            f"| {e['transport']} | {e['contender']} | {e['length']} | {ms('ttft_s')} | {vs} | "
            f"{ms('gap_s')} | {ms('gap_beyond_colocated_s')} | {ms('gap_beyond_step_s')} | "
            f"{ms('after_p_s')} | "
            f"{ms('handoff_s')} | "
            f"{ms('exposed_s')} | {ms('p_post_s')} | {ms('d_post_s')} | "
            f"{e.get('plain_fallbacks', '-')} |"
        )
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> bool:
    """What the client waits beyond P's answer, per contender against prompt length, one panel
    per transport (False: matplotlib is not installed)."""
    plt = pyplot()
    if plt is None:
        return False
    transports = sorted({e["transport"] for e in summary})
    fig, axes = plt.subplots(1, len(transports), figsize=(6 * len(transports), 4), squeeze=False)
    contenders = sorted({e["contender"] for e in summary})
    colors = {c: f"C{i}" for i, c in enumerate(contenders)}  # one color per contender
    for ax, transport in zip(axes[0], transports, strict=True):
        for contender in contenders:
            # What the client waits beyond P's answer: measured at the client for the direct
            # sequential flows, through the proxy for the concurrent ones.
            points = [
                (e["length"], 1e3 * e.get("handoff_s", e.get("after_p_s", 0.0)))
                for e in summary
                if e["transport"] == transport
                and e["contender"] == contender
                and ("handoff_s" in e or "after_p_s" in e)
            ]
            if points:
                ax.plot(
                    *zip(*points, strict=True), marker="o", label=contender, color=colors[contender]
                )
        ax.set_title(f"beyond P's answer to D's first token ({transport})")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("ms (log)")
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return True
