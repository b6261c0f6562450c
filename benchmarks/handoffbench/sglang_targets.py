"""The SGLang rows' summary, pure (no servers): each SGLang contender against ``sglang-colocated``,
and issue #25's targets per contender against its own round, with their markdown table.

``benchmarks/handoff_sglang.py`` measures the rows (and keeps these names importable from it);
``benchmarks/handoff.py`` reports them.
"""

from __future__ import annotations

import statistics

from splitserve.models import resolve_spec

TTFT_TARGET = 1.10  # issue #25: the pair's TTFT at most 1.1x a colocated server's (same round)


def relative_to_colocated(summary: list[dict]) -> list[dict]:
    """SGLang rows compared with ``sglang-colocated`` (not with vLLM's ``colocated``)."""
    ref = {
        (e["transport"], e["length"]): e for e in summary if e["contender"] == "sglang-colocated"
    }
    for e in summary:
        base = ref.get((e["transport"], e["length"]))
        if not e["contender"].startswith("sglang-") or base is None or e is base:
            continue
        e["ttft_vs_colocated"] = e["ttft_s"] / base["ttft_s"] - 1.0
        if "gap_s" in e and "gap_s" in base:
            e["gap_beyond_colocated_s"] = e["gap_s"] - base["gap_s"]
    return summary


def targets(
    summary: list[dict], links: dict[str, dict], rows: list[dict], model: str = "bench"
) -> list[dict]:
    """Issue #25's targets per SGLang contender, transport and length, each contender against
    the colocated requests of its own round (``summary`` and ``rows`` as ``benchmarks/handoff.py``
    renames them: ``sglang-colocated/<contender>``): median TTFT at most ``TTFT_TARGET`` x the
    round's colocated median, and (where the contender logs it: ours) the exposed handoff within
    the vLLM path's bound, bulk transfer / layers + 2 ms over the run's measured link. With the
    decode steps beside them: token 1 -> 2 and 2 -> 3 (``gap2_s``), colocated and the pair's."""
    spec = resolve_spec(model)
    per_token = spec.kv_bytes_per_token()
    by = {(e["transport"], e["contender"], e["length"]): e for e in summary}
    gap2: dict[tuple, list[float]] = {}
    for r in rows:
        if "gap2_s" in r:
            gap2.setdefault((r["transport"], r["contender"], r["length"]), []).append(r["gap2_s"])
    out = []
    for e in summary:
        name, transport, length = e["contender"], e["transport"], e["length"]
        if not name.startswith("sglang-") or name.startswith("sglang-colocated"):
            continue
        base_name = f"sglang-colocated/{name}"
        base = by.get((transport, base_name, length))
        if base is None:
            continue
        ratio = e["ttft_s"] / base["ttft_s"]
        row: dict = {
            "transport": transport,
            "contender": name,
            "length": length,
            "colocated_ttft_s": base["ttft_s"],
            "ttft_s": e["ttft_s"],
            "ttft_ratio": ratio,
            "ttft_ok": ratio <= TTFT_TARGET,
        }
        for key, who in (("colocated", base_name), ("pair", name)):
            if "gap_s" in by.get((transport, who, length), {}):
                row[f"{key}_gap_s"] = by[(transport, who, length)]["gap_s"]
            if gap2.get((transport, who, length)):
                row[f"{key}_gap2_s"] = statistics.median(gap2[(transport, who, length)])
        link = links.get(transport)
        if link and "exposed_s" in e:
            bulk = link["fixed_s"] + length * per_token / link["bytes_per_s"]
            row["bound_s"] = bulk / spec.num_layers + 0.002
            row["exposed_s"] = e["exposed_s"]
            row["exposed_ok"] = e["exposed_s"] <= row["bound_s"]
        out.append(row)
    return out


def targets_markdown(rows: list[dict]) -> str:
    """``targets`` as a markdown table."""
    lines = [
        "| transport | contender | prompt | colocated TTFT s (its round) | TTFT s | ratio | "
        f"<= {TTFT_TARGET:.1f}x | exposed ms | bound: bulk/layers + 2 ms | met | "
        "token 1 -> 2 ms, colocated / pair | token 2 -> 3 ms, colocated / pair |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(r: dict, key: str) -> str:
        return f"{1e3 * r[key]:.1f}" if key in r else "-"

    for r in rows:
        ok = ("yes" if r["exposed_ok"] else "no") if "exposed_ok" in r else "-"
        lines.append(
            f"| {r['transport']} | {r['contender']} | {r['length']} | "
            f"{r['colocated_ttft_s']:.2f} | {r['ttft_s']:.2f} | {r['ttft_ratio']:.2f}x | "
            f"{'yes' if r['ttft_ok'] else 'no'} | {ms(r, 'exposed_s')} | {ms(r, 'bound_s')} | "
            f"{ok} | {ms(r, 'colocated_gap_s')} / {ms(r, 'pair_gap_s')} | "
            f"{ms(r, 'colocated_gap2_s')} / {ms(r, 'pair_gap2_s')} |"
        )
    return "\n".join(lines)
