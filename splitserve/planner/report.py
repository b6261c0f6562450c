"""Render a ``Plan`` as text tables (the CLI prints them) or JSON.

Pure formatting: returns strings, prints nothing; runs in the CLI process. Units: bytes in SI
(kB/MB/GB = 1e3/1e6/1e9) with the exact byte count beside them, times in us/ms/s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from splitserve.planner.plan import Plan, Pools


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def fmt_rate(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.3g} TB/s"
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _section(title: str, body: str) -> str:
    return f"{title}\n{body}\n"


def render_text(plan: Plan) -> str:
    """The plan as text: one block per section, in the order a reader needs them (what is
    moved, over what, how long it takes, then the advice and the assumptions behind it)."""
    out = [
        _model_section(plan),
        _replica_section(plan),
        _kv_section(plan),
        _handoff_section(plan),
        _intensity_section(plan),
        _chunks_section(plan),
    ]
    if plan.pools is not None:
        out += [_pools_section(plan, plan.pools)]
        if plan.hardware.get("phases"):
            out.append(_phases_section(plan.hardware["phases"]))
        out.append(_verdict_section(plan.pools))
    if plan.decide is not None:
        out.append(_decide_section(plan))
    if plan.calibration:
        out.append(render_calibration(plan.calibration))
    out.append(_assumptions_section(plan))
    return "\n".join(out)


def _model_section(plan: Plan) -> str:
    m = plan.model
    kv_shape = "MLA latent" if m["mla"] else f"{m['num_kv_heads']} KV heads x {m['head_dim']}"
    return _section(
        f"Model {m['name']}",
        table(
            ["layers", "KV per layer", "params", "active/token", "weights"],
            [
                [
                    m["num_layers"],
                    kv_shape,
                    f"{m['params_total'] / 1e9:.3g} B",
                    f"{m['params_active_per_token'] / 1e9:.3g} B",
                    fmt_bytes(m["weight_bytes"]),
                ]
            ],
        ),
    )


def _replica_section(plan: Plan) -> str:
    hw = plan.hardware
    per_transfer = (
        f", +{fmt_seconds(hw['link_per_transfer_s'])}/transfer)"
        if hw["link_per_transfer_s"]
        else ")"
    )
    return _section(
        "Replica",
        table(
            ["GPUs", "peak FLOP/s", "memory BW", "memory", "ridge (FLOP/B)", "link"],
            [
                [
                    f"{hw['gpus_per_replica']} x {hw['accelerator']}",
                    f"{hw['flops'] / 1e12:.4g} T",
                    fmt_rate(hw["mem_bytes_per_s"]),
                    fmt_bytes(hw["mem_bytes"]),
                    f"{hw['ridge_flop_per_byte']:.0f}",
                    f"{hw['link']} ({fmt_rate(hw['link_bytes_per_s'])}" + per_transfer,
                ]
            ],
        ),
    )


def _phases_section(ph: dict[str, Any]) -> str:
    """Hardware per pool (--prefill-gpu / --decode-gpu) and its price."""
    rows = [
        [role, f"{ph[role]['gpus_per_replica']} x {ph[role]['accelerator']}",
         _price(ph[role]["price_per_gpu_hour"])]
        for role in ("prefill", "decode", "colocated")
    ]  # fmt: skip
    return _section("Hardware per pool", table(["pool", "replica", "$/GPU-hour"], rows))


def _price(x: float) -> str:
    return "n/a (give --price)" if x != x else f"{x:.2f}"


def _kv_section(plan: Plan) -> str:
    kv = plan.kv
    return _section(
        f"KV cache ({kv.kv_dtype}, request of {kv.tokens} prompt tokens)",
        table(
            ["per token", "per token per layer", "per layer slice", "per request"],
            [
                [
                    f"{fmt_bytes(kv.bytes_per_token)} ({kv.bytes_per_token} B)",
                    f"{kv.bytes_per_token_per_layer} B",
                    f"{fmt_bytes(kv.layer_slice_bytes)} ({kv.layer_slice_bytes} B)",
                    f"{fmt_bytes(kv.request_bytes)} ({kv.request_bytes} B)",
                ]
            ],
        ),
    )


def _handoff_section(plan: Plan) -> str:
    rows = []
    for h in plan.handoff_by_link:
        links = f"{h.links_in_parallel} x " if h.links_in_parallel > 1 else ""
        rows.append(
            [
                h.link + (" *" if h is plan.handoff else ""),
                links + fmt_rate(h.link_bytes_per_s),
                fmt_seconds(h.bulk_s),
                fmt_seconds(h.layer_transfer_s),
                fmt_seconds(h.layer_compute_s),
                f"{h.transfer_to_compute:.2g}",
                fmt_seconds(h.exposed_bulk_s),
                fmt_seconds(h.exposed_streaming_s),
                "yes" if h.streaming_hides else "no",
            ]
        )
    return _section(
        f"Handoff of one {plan.kv.tokens}-token request (* = chosen link)",
        table(
            [
                "link",
                "bandwidth",
                "bulk",
                "layer xfer",
                "layer prefill",
                "xfer/prefill",
                "exposed bulk",
                "exposed streamed",
                "hidden",
            ],
            rows,
        ),
    )


def _intensity_section(plan: Plan) -> str:
    it = plan.intensity
    return _section(
        "Prefill arithmetic intensity (GEMMs; bytes = weights + input activations)",
        table(
            ["what", "FLOP/byte", "ridge", "smallest budget above ridge"],
            [
                [
                    f"mean layer, {it.prompt_tokens} tokens",
                    f"{it.layer_flop_per_byte:.0f}",
                    f"{it.ridge_flop_per_byte:.0f}",
                    _tokens(it.min_budget_tokens),
                ],
                [
                    f"one GEMM d'={it.gemm_d_out}, {it.prompt_tokens} tokens",
                    f"{it.gemm_flop_per_byte:.0f}",
                    f"{it.ridge_flop_per_byte:.0f}",
                    _tokens(it.gemm_min_tokens),
                ],
            ],
        ),
    )


def _chunks_section(plan: Plan) -> str:
    return _section(
        "Largest prefill chunk that keeps a decode step under ITL "
        f"{fmt_seconds(plan.slo['itl_s'])}",
        table(
            ["decodes", "context", "decode step alone", "largest chunk"],
            [
                [
                    c.decode_seqs,
                    c.decode_context,
                    fmt_seconds(c.decode_step_s),
                    "decodes alone exceed ITL" if c.largest_chunk is None else c.largest_chunk,
                ]
                for c in plan.chunks
            ],
        ),
    )


def _decide_section(plan: Plan) -> str:
    d = plan.decide
    assert d is not None
    chunk = "none (the decodes fill the step)" if not d.one_step_chunk else d.one_step_chunk
    return _section(
        "Per-request disaggregation (proxy decide.threshold_tokens)",
        f"threshold_tokens: {d.tokens} = max(break-even {d.break_even_tokens}, one-step chunk "
        f"{chunk})\n"
        f"  break-even: handoff {fmt_seconds(d.handoff_s)} (exposed streamed + one hop) / "
        f"prefill {d.prefill_s_per_token * 1e6:.3g} us per token\n"
        f"  one-step chunk: largest prefill chunk beside {d.decodes} decodes under ITL "
        f"{fmt_seconds(plan.slo['itl_s'])}\n"
        "  prompts with at most this many uncached tokens go straight to a decode server",
    )


def _pools_section(plan: Plan, p: Pools) -> str:
    wl, slo = plan.workload, plan.slo
    rate = wl["request_rate"]
    title = (f"Pools for {rate:g} req/s" if rate else "Pools (no --rate: one request)") + (
        f", {wl['prompt_tokens']} in / {wl['output_tokens']} out, "
        f"TTFT {fmt_seconds(slo['ttft_s'])}, ITL {fmt_seconds(slo['itl_s'])}"
    )
    rows = [
        [
            "prefill (P)",
            _count(p.prefill.replicas),
            fmt_seconds(p.prefill.ttft_s),
            f"{p.prefill.prompts_per_iteration} prompt(s) per "
            f"{fmt_seconds(p.prefill.iteration_s)} iteration",
            p.prefill.why,
        ],
        [
            "decode (D)",
            _count(p.decode.replicas),
            "-",
            f"batch {p.decode.batch} ({p.decode.batch_limit}), step {fmt_seconds(p.decode.step_s)}",
            p.decode.why,
        ],
        [
            "colocated",
            _count(p.colocated.replicas),
            fmt_seconds(p.colocated.ttft_s),
            f"chunk {p.colocated.chunk_tokens}, {p.colocated.decode_seqs} decodes",
            p.colocated.why,
        ],
    ]
    return _section(title, table(["pool", "replicas", "TTFT", "operating point", "why"], rows))


def _verdict_section(p: Pools) -> str:
    reasons = "\n".join(f"  - {r}" for r in p.verdict.reasons)
    return f"Verdict: {p.verdict.choice.upper()}\n{reasons}\n"


def _assumptions_section(plan: Plan) -> str:
    return "Assumptions\n" + "\n".join(f"  - {a}" for a in plan.assumptions) + "\n"


def render_calibration(cal: dict[str, Any]) -> str:
    lines = [cal.get("title", "Calibration (measured on this machine)")]
    for note in cal.get("notes", []):
        lines.append(f"  - {note}")
    steps = cal.get("steps")
    if steps:  # a calibration file of benchmarks/gpu_proof.py: one layer's step times
        lines.append(
            table(
                ["step (prefill n after c, B decodes at d)", "measured layer", "roofline"],
                [
                    [
                        f"n={p['prefill_tokens']} c={p['prefill_context']} "
                        f"B={p['decode_seqs']} d={p['decode_context']}",
                        fmt_seconds(p["measured_s"]),
                        fmt_seconds(p.get("roofline_measured_s")),
                    ]
                    for p in steps["points"]
                ],
            )
        )
    layer = cal.get("layer")
    if layer:
        lines.append(
            table(
                ["tokens", "measured layer", "roofline with measured figures"],
                [
                    [r["tokens"], fmt_seconds(r["measured_s"]), fmt_seconds(r.get("predicted_s"))]
                    for r in layer["points"]
                ],
            )
        )
    nixl = cal.get("nixl")
    if nixl:
        lines.append(
            table(
                ["bytes", "median transfer", "GB/s"],
                [
                    [
                        fmt_bytes(r["bytes"]),
                        fmt_seconds(r["median_s"]),
                        f"{r['bytes'] / r['median_s'] / 1e9:.3g}",
                    ]
                    for r in nixl["points"]
                ],
            )
        )
    check = cal.get("handoff_check")
    if check:
        lines.append(
            table(
                ["prompt tokens", "benchmark transfer", "planner bulk", "ratio"],
                [
                    [
                        r["prompt_tokens"],
                        fmt_seconds(r["measured_s"]),
                        fmt_seconds(r["predicted_s"]),
                        f"{r['ratio']:.2f}",
                    ]
                    for r in check["rows"]
                ],
            )
        )
    return "\n".join(lines) + "\n"


def _tokens(n: int | None) -> str:
    return "never (activations outweigh)" if n is None else f"{n} tokens"


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def render_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2, allow_nan=False)
