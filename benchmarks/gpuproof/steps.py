"""Part 3 of gpu_proof: engine step times of one model layer, against the planner's roofline.

One transformer layer of the model's shapes (``splitserve.planner.calibrate.layer_shape``: the
layer ``splitserve plan --calibrate`` times) runs a whole engine step's worth of tokens: a
prefill chunk of ``n`` tokens after ``c`` cached ones (causal attention aligned lower-right
over ``c + n`` keys), a batch of ``B`` decodes at context ``d``, or both in one step (mixed).
New K/V are written into preallocated caches first, as an engine's cache write does. bf16 on a
GPU (timed with CUDA events), fp32 on the CPU. torch's SDPA stands in for the engine's
attention kernel (FlashAttention on a GPU, where SDPA picks it), and the output says so.

Each point carries the roofline prediction (``roofline.step_cost`` for one layer, no LM head)
with the catalog accelerator's peak figures and with the measured ones (best achieved FLOP/s
over the points, the copy bandwidth); ``write_calibration`` writes the file that
``splitserve plan --calibration FILE`` loads (``splitserve.planner.calibration_file``).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RUNS = 3


@dataclass(frozen=True)
class StepPoint:
    prefill_tokens: int = 0
    prefill_context: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decode_seqs:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"


def grid(
    chunks: list[int],
    cached: list[int],
    batches: list[int],
    contexts: list[int],
    mixed: list[tuple[int, int, int]],
    max_decode_tokens: int,
) -> list[StepPoint]:
    """Prefill chunks x cached contexts, decode batches x contexts (``B * d`` at most
    ``max_decode_tokens``: one layer's KV must fit), and (chunk, batch, context) mixed steps."""
    points = [StepPoint(prefill_tokens=n, prefill_context=c) for c in cached for n in chunks]
    points += [
        StepPoint(decode_seqs=b, decode_context=d)
        for d in contexts
        for b in batches
        if b * d <= max_decode_tokens
    ]
    points += [
        StepPoint(prefill_tokens=n, prefill_context=0, decode_seqs=b, decode_context=d)
        for n, b, d in mixed
    ]
    return points


def time_steps(model_name: str, points: list[StepPoint], device: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from splitserve.planner.calibrate import layer_shape, measure_copy_bandwidth, wall_timer
    from splitserve.planner.catalog import get_model

    model = get_model(model_name)
    shape, notes = layer_shape(model)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    timer = wall_timer(device)
    torch.manual_seed(0)
    h, hd, heads, kv_heads = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    q_dim, kv_dim = heads * hd, kv_heads * hd

    def weight(rows: int, cols: int) -> Any:
        return torch.randn(rows, cols, device=device, dtype=dtype) / math.sqrt(rows)

    w_qkv = weight(h, q_dim + 2 * kv_dim)
    w_o, w_gate_up, w_down = weight(q_dim, h), weight(h, 2 * shape.mlp), weight(shape.mlp, h)
    gqa = heads != kv_heads
    expand = {"kv": False}  # set once SDPA refuses GQA here: repeat KV heads from then on

    def sdpa(q: Any, k: Any, v: Any, mask: Any = None, causal: bool = False) -> Any:
        if expand["kv"]:
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        try:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
            )
        except RuntimeError as exc:
            if not gqa or isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            expand["kv"] = True
            notes.append(
                f"SDPA refused GQA ({exc}); KV heads repeated from then on (slower than a GQA "
                "kernel: step times above the engine's)"
            )
            return sdpa(q, k, v, mask, causal)

    def step_fn(p: StepPoint):
        n, c, b, d = p.prefill_tokens, p.prefill_context, p.decode_seqs, p.decode_context
        x = torch.randn(n + b, h, device=device, dtype=dtype)
        kp = torch.randn(1, kv_heads, c + n, hd, device=device, dtype=dtype) if n else None
        vp = torch.randn_like(kp) if n else None
        kd = torch.randn(b, kv_heads, d + 1, hd, device=device, dtype=dtype) if b else None
        vd = torch.randn_like(kd) if b else None
        mask = causal_lower_right(n, c + n) if n and c else None

        def layer() -> Any:
            y = F.rms_norm(x, (h,))
            q, k, v = (y @ w_qkv).split([q_dim, kv_dim, kv_dim], dim=-1)
            outs = []
            if n:
                kp[0, :, c:].copy_(k[:n].view(n, kv_heads, hd).transpose(0, 1))
                vp[0, :, c:].copy_(v[:n].view(n, kv_heads, hd).transpose(0, 1))
                qp = q[:n].view(1, n, heads, hd).transpose(1, 2)
                o = sdpa(qp, kp, vp, mask=mask, causal=mask is None)
                outs.append(o.transpose(1, 2).reshape(n, q_dim))
            if b:
                kd[:, :, d].copy_(k[n:].view(b, kv_heads, hd))
                vd[:, :, d].copy_(v[n:].view(b, kv_heads, hd))
                qd = q[n:].view(b, 1, heads, hd).transpose(1, 2)
                outs.append(sdpa(qd, kd, vd).transpose(1, 2).reshape(b, q_dim))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            z = x + attn @ w_o
            gate, up = (F.rms_norm(z, (h,)) @ w_gate_up).chunk(2, dim=-1)
            return z + (F.silu(gate) * up) @ w_down

        return layer

    rows = []
    with torch.inference_mode():
        for p in points:
            try:
                layer = step_fn(p)
                timer(layer, 1)  # warm-up (kernel selection, allocator)
                measured = statistics.median(timer(layer, RUNS))
                rows.append({"kind": p.kind, **asdict(p), "measured_s": measured})
            except (RuntimeError, MemoryError) as exc:  # one point, not the whole grid
                rows.append({"kind": p.kind, **asdict(p), "error": f"{type(exc).__name__}: {exc}"})
            layer = None
            if device == "cuda":
                torch.cuda.empty_cache()
    mem_bw = measure_copy_bandwidth(device)
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        mem = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        import platform

        import psutil

        name = f"CPU ({platform.processor() or platform.machine()})"
        mem = float(psutil.virtual_memory().total)
    notes.append(
        "attention is torch scaled_dot_product_attention (lower-right causal after a cached "
        "context), standing in for the engine's kernel"
    )
    return {
        "device_name": name,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "model": model_name,
        "shape": asdict(shape),
        "mem_bytes": mem,
        "copy_bytes_per_s": mem_bw,
        "points": rows,
        "notes": notes,
    }


def compare_roofline(timing: dict[str, Any], catalog_gpu: str | None) -> dict[str, Any]:
    """Attach the roofline's predictions (catalog peak and measured figures) and their error."""
    from splitserve.planner.calibrate import TimedShape
    from splitserve.planner.catalog import Accelerator, get_accelerator
    from splitserve.planner.roofline import make_replica, step_cost

    shape = TimedShape(**timing["shape"])
    model = shape.as_model()
    elem = 2 if timing["device"] == "cuda" else 4
    kv_token_layer = 2 * shape.kv_heads * shape.head_dim * elem

    def cost(p: dict[str, Any], replica: Any) -> Any:
        return step_cost(
            model,
            replica,
            kv_token_layer,
            prefill_tokens=p["prefill_tokens"],
            prefill_context=p["prefill_context"],
            decode_seqs=p["decode_seqs"],
            decode_context=p["decode_context"],
            weight_bytes=elem,
            act_bytes=elem,
            layers=1,
            lm_head=False,
        )

    unit = make_replica(Accelerator(name="unit", bf16_flops=1, mem_bytes_per_s=1, mem_bytes=1))
    timing["failed_points"] = [p for p in timing["points"] if "error" in p]
    timing["points"] = [p for p in timing["points"] if "error" not in p]
    if not timing["points"]:
        raise RuntimeError(f"no step point ran: {timing['failed_points'][:1]}")
    for p in timing["points"]:
        c = cost(p, unit)
        p["flops"], p["bytes"] = c.flops, c.bytes
    achieved = max(p["flops"] / p["measured_s"] for p in timing["points"])
    measured = Accelerator(
        name=f"{timing['device_name']} (measured)",
        bf16_flops=achieved,
        mem_bytes_per_s=timing["copy_bytes_per_s"],
        mem_bytes=timing["mem_bytes"],
        source=f"benchmarks/gpu_proof.py, {timing['dtype']} step timing",
    )
    replicas = {"measured": make_replica(measured)}
    if catalog_gpu:
        replicas["catalog"] = make_replica(get_accelerator(catalog_gpu))
    errors: dict[str, dict[str, float]] = {}
    for label, replica in replicas.items():
        ratios = []
        for p in timing["points"]:
            predicted = cost(p, replica).seconds
            p[f"roofline_{label}_s"] = predicted
            p[f"roofline_{label}_ratio"] = predicted / p["measured_s"]
            ratios.append(predicted / p["measured_s"])
        log_err = [abs(math.log(r)) for r in ratios]
        errors[label] = {
            "median_abs_error": math.exp(statistics.median(log_err)) - 1,
            "worst_ratio": max(ratios, key=lambda r: abs(math.log(r))),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
        }
    return {"accelerator": measured.model_dump(), "errors": errors}


def write_calibration(
    path: Path,
    timing: dict[str, Any],
    roofline: dict[str, Any],
    link: dict[str, Any] | None,
    catalog_gpu: str | None,
) -> dict[str, Any]:
    """The calibration file (format in ``splitserve.planner.calibration_file``)."""
    acc = roofline["accelerator"]
    data = {
        "format": "splitserve-calibration/1",
        "gpu": catalog_gpu or timing["device_name"],
        "device_name": timing["device_name"],
        "device": timing["device"],
        "dtype": timing["dtype"],
        "weight_bytes": 2 if timing["device"] == "cuda" else 4,
        "model": timing["model"],
        "accelerator": acc,
        "transfer_link": link,  # two processes on one device: not a P->D link
        "steps": {
            "shape": timing["shape"],
            "points": timing["points"],
            "failed_points": timing["failed_points"],
        },
        "roofline_error": roofline["errors"],
        "notes": timing["notes"]
        + [
            f"step timing on {timing['device_name']} in {timing['dtype']}: best achieved "
            f"{acc['bf16_flops'] / 1e12:.3g} TFLOP/s, copy {acc['mem_bytes_per_s'] / 1e9:.3g} GB/s",
        ]
        + (
            [
                f"link measured between two processes on this device: "
                f"{link['bytes_per_s'] / 1e9:.3g} GB/s + {link['per_transfer_s'] * 1e6:.0f} us "
                "per transfer (not a P->D link between machines)"
            ]
            if link
            else []
        ),
    }
    path.write_text(json.dumps(data, indent=2))
    return data
