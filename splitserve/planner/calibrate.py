"""``splitserve plan --calibrate``: measure this machine instead of trusting the catalog.

Runs in the CLI process (torch is imported here, never by the rest of the planner); the NIXL
probe adds one child process (``nixl_probe``). Three measurements:

1. one transformer layer of the model's shapes (QKV projection, causal SDPA attention with the
   model's GQA ratio, output projection, gated MLP, two RMSNorms), timed with torch at a few
   prompt lengths: on the GPU in bf16 with CUDA events, on the CPU in fp32 with
   ``time.perf_counter`` (bf16 matmuls are hundreds of times slower on CPUs without
   AVX512-BF16, and our CPU servers run fp32). A layer too large for the time budget or for
   memory is scaled down (hidden, MLP width and head counts divided by a power of two, head dim
   and GQA ratio kept) and the output says so; the achieved FLOP/s then stands in for the
   model's;
2. memory bandwidth: a large tensor copy (bytes read + written per second);
3. NIXL WRITE bandwidth and fixed cost between two processes (``nixl_probe``).

The plan then uses a measured ``Accelerator`` (achieved FLOP/s, copy bandwidth, memory size)
and a measured ``Link``. Invariants: every measurement is bounded (time budget, memory cap,
probe deadline); every scaled or approximated shape is stated in ``notes``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitserve.planner.catalog import Accelerator, Link, ModelShape, PlannerInputError
from splitserve.planner.handoff import transfer_seconds
from splitserve.planner.kv import kv_bytes_per_token
from splitserve.planner.roofline import Replica, step_cost

logger = logging.getLogger(__name__)

# Largest layer (weights) the timing may allocate, per device.
MAX_LAYER_WEIGHT_BYTES = {"cpu": 1 << 30, "cuda": 16 << 30}
RUNS = 3


@dataclass(frozen=True)
class TimedShape:
    """The layer actually timed (possibly scaled down from the model's)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    scale: int

    def as_model(self) -> ModelShape:
        return ModelShape(
            name="timed layer",
            num_layers=1,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.mlp,
            vocab_size=1,
        )

    def weight_elems(self) -> int:
        h, hd = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * hd + self.heads * hd * h + 3 * h * self.mlp


def layer_shape(model: ModelShape, scale: int = 1) -> tuple[TimedShape, list[str]]:
    """The model's layer for timing, divided by ``scale``; notes on every approximation."""
    notes = []
    heads, kv_heads, head_dim = model.num_attention_heads, model.num_kv_heads, model.head_dim
    if model.is_mla:
        kv_heads = heads
        notes.append(
            "MLA timed as plain multi-head attention with the same head count and "
            f"head dim {head_dim} (the latent projections are not timed)"
        )
    mlp = model.intermediate_size
    if model.is_moe:
        mlp = model.experts_per_token * model.moe_intermediate_size + (
            model.shared_expert_intermediate_size
        )
        notes.append(f"MoE timed as one dense MLP of width {mlp} (the experts one token uses)")
    group = heads // kv_heads
    kv_scaled = max(1, kv_heads // scale)
    shape = TimedShape(
        hidden=max(64, model.hidden_size // scale),
        heads=kv_scaled * group,
        kv_heads=kv_scaled,
        head_dim=head_dim,
        mlp=max(64, mlp // scale),
        scale=scale,
    )
    return shape, notes


@dataclass
class LayerTiming:
    device: str
    dtype: str
    shape: TimedShape
    points: list[dict[str, Any]]
    flops_per_s: float
    mem_bytes_per_s: float
    mem_bytes: float
    notes: list[str] = field(default_factory=list)


def wall_timer(device: str) -> Callable[[Callable[[], object], int], list[float]]:
    """Seconds per call of ``fn``, ``runs`` times: CUDA events on the GPU, the clock on the CPU
    (also ``benchmarks/gpu_proof.py``'s step timings)."""
    import torch

    def cpu(fn: Callable[[], object], runs: int) -> list[float]:
        out = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    def cuda(fn: Callable[[], object], runs: int) -> list[float]:
        out = []
        for _ in range(runs):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            out.append(begin.elapsed_time(end) / 1e3)
        return out

    return cuda if device == "cuda" else cpu


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PlannerInputError("--calibrate-device cuda: torch sees no CUDA device here")
    return device


def _probe_flops(device: str, dtype: Any, timer: Callable[..., list[float]]) -> float:
    """A quick GEMM to size the layer timing against the budget."""
    import torch

    n, d = (256, 1024) if device == "cpu" else (4096, 8192)
    a = torch.randn(n, d, device=device, dtype=dtype)
    w = torch.randn(d, d, device=device, dtype=dtype)
    timer(lambda: a @ w, 1)
    return 2 * n * d * d / statistics.median(timer(lambda: a @ w, 3))


def measure_copy_bandwidth(device: str, nbytes: int | None = None) -> float:
    """Bytes read + written per second by a large tensor copy."""
    import torch

    nbytes = nbytes or ((128 << 20) if device == "cpu" else (2 << 30))
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    timer = wall_timer(device)
    timer(lambda: dst.copy_(src), 1)
    return 2 * nbytes / statistics.median(timer(lambda: dst.copy_(src), 5))


def _memory_bytes(device: str) -> float:
    if device == "cuda":
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    return float(psutil.virtual_memory().total)


def time_layer(
    model: ModelShape, tokens: list[int], device: str = "auto", budget_s: float = 20.0
) -> LayerTiming:
    """Time one layer of ``model``'s shapes at each prompt length in ``tokens``."""
    import torch
    import torch.nn.functional as F

    device = _resolve_device(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    elem = 2 if device == "cuda" else 4
    timer = wall_timer(device)
    torch.manual_seed(0)
    probe = _probe_flops(device, dtype, timer)
    scale = 1
    while True:
        shape, notes = layer_shape(model, scale)
        flops = sum(
            step_cost(
                shape.as_model(), _unit_replica(probe), 0, prefill_tokens=n, layers=1, lm_head=False
            ).flops
            for n in tokens
        )
        fits_memory = shape.weight_elems() * elem <= MAX_LAYER_WEIGHT_BYTES[device]
        if (fits_memory and flops * (RUNS + 1) / probe <= budget_s) or shape.hidden <= 64:
            break
        scale *= 2
    if scale > 1:
        notes.insert(
            0,
            f"layer scaled down {scale}x to fit the time and memory budget (hidden "
            f"{shape.hidden}, {shape.heads}/{shape.kv_heads} heads of {shape.head_dim}, "
            f"MLP {shape.mlp}); its achieved FLOP/s stands in for the full layer's",
        )
    h, hd = shape.hidden, shape.head_dim

    def weight(rows: int, cols: int) -> Any:
        return torch.randn(rows, cols, device=device, dtype=dtype) / math.sqrt(rows)

    w_qkv = weight(h, (shape.heads + 2 * shape.kv_heads) * hd)
    w_o, w_gate_up, w_down = (
        weight(shape.heads * hd, h),
        weight(h, 2 * shape.mlp),
        weight(shape.mlp, h),
    )
    q_dim, kv_dim = shape.heads * hd, shape.kv_heads * hd

    def layer(x: Any) -> Any:
        n = x.shape[0]
        y = F.rms_norm(x, (h,))
        q, k, v = (y @ w_qkv).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(n, shape.heads, hd).transpose(0, 1)
        k = k.view(n, shape.kv_heads, hd).transpose(0, 1)
        v = v.view(n, shape.kv_heads, hd).transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=shape.heads != shape.kv_heads
        )
        x = x + attn.transpose(0, 1).reshape(n, q_dim) @ w_o
        gate, up = (F.rms_norm(x, (h,)) @ w_gate_up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ w_down

    mem_bw = measure_copy_bandwidth(device)
    points = []
    with torch.inference_mode():
        for n in tokens:
            x = torch.randn(n, h, device=device, dtype=dtype)
            timer(lambda x=x: layer(x), 1)  # warm-up
            measured = statistics.median(timer(lambda x=x: layer(x), RUNS))
            cost = step_cost(
                shape.as_model(),
                _unit_replica(probe),
                0,
                prefill_tokens=n,
                layers=1,
                lm_head=False,
                weight_bytes=elem,
                act_bytes=elem,
            )
            points.append(
                {"tokens": n, "measured_s": measured, "flops": cost.flops, "bytes": cost.bytes}
            )
    largest = max(points, key=lambda p: p["flops"])
    achieved = largest["flops"] / largest["measured_s"]
    for p in points:
        p["predicted_s"] = max(p["flops"] / achieved, p["bytes"] / mem_bw)
    return LayerTiming(
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        shape=shape,
        points=points,
        flops_per_s=achieved,
        mem_bytes_per_s=mem_bw,
        mem_bytes=_memory_bytes(device),
        notes=notes,
    )


def _unit_replica(flops: float) -> Replica:
    return Replica(
        name="probe", gpus=1, flops=flops, mem_bytes_per_s=1.0, mem_bytes=1.0, efficiency=1.0
    )


# Keys benchmarks/handoff.py may use for a record's prompt length and its measured transfer.
_PROMPT_KEYS = ("prompt_tokens", "prompt_len", "prompt_length")
_TRANSFER_KEYS = (
    "bulk_transfer_s",
    "transfer_s",
    "kv_transfer_s",
    "nixl_transfer_s",
    "pull_s",
    "bulk_transfer_ms",
    "transfer_ms",
    "kv_transfer_ms",
    "nixl_transfer_ms",
    "pull_ms",
)


def _records(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        found = (
            [value]
            if any(k in value for k in _PROMPT_KEYS) and any(k in value for k in _TRANSFER_KEYS)
            else []
        )
        return found + [r for v in value.values() for r in _records(v)]
    if isinstance(value, list):
        return [r for v in value for r in _records(v)]
    return []


def check_handoff_results(
    path: Path, model: ModelShape, kv_dtype: str, link: Link
) -> dict[str, Any]:
    """Compare the benchmark's measured bulk transfers with the planner's prediction over the
    measured link: ``a + kv_bytes(prompt) / B``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlannerInputError(f"--handoff-results {path}: {e}") from None
    rows = []
    for rec in _records(data):
        prompt = next(rec[k] for k in _PROMPT_KEYS if k in rec)
        key = next(k for k in _TRANSFER_KEYS if k in rec)
        measured = float(rec[key]) / (1e3 if key.endswith("_ms") else 1.0)
        predicted = transfer_seconds(int(prompt) * kv_bytes_per_token(model, kv_dtype), link)
        rows.append(
            {
                "prompt_tokens": int(prompt),
                "key": key,
                "measured_s": measured,
                "predicted_s": predicted,
                "ratio": measured / predicted,
            }
        )
    if not rows:
        raise PlannerInputError(
            f"--handoff-results {path}: no record with one of {', '.join(_PROMPT_KEYS)} and one "
            f"of {', '.join(_TRANSFER_KEYS)}"
        )
    return {"file": str(path), "rows": rows}


@dataclass
class CalibrationResult:
    accelerator: Accelerator
    link: Link
    weight_bytes: int
    layer: LayerTiming
    nixl: Any  # nixl_probe.NixlBandwidth
    handoff_check: dict[str, Any] | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        layer = asdict(self.layer)
        notes = (
            self.layer.notes
            + self.nixl.notes
            + [
                f"layer timed on {self.layer.device} in {self.layer.dtype}: achieved "
                f"{self.layer.flops_per_s / 1e9:.3g} GFLOP/s; copy bandwidth "
                f"{self.layer.mem_bytes_per_s / 1e9:.3g} GB/s; NIXL "
                f"{self.link.bytes_per_s / 1e9:.3g} GB/s + "
                f"{self.link.per_transfer_s * 1e6:.0f} us per transfer",
                f"calibration took {self.seconds:.1f} s",
            ]
        )
        return {
            "notes": notes,
            "layer": layer,
            "nixl": asdict(self.nixl),
            "accelerator": self.accelerator.model_dump(),
            "link": self.link.model_dump(),
            "handoff_check": self.handoff_check,
        }


def calibrate_machine(
    model: ModelShape,
    *,
    kv_dtype: str,
    device: str = "auto",
    tokens: list[int] | None = None,
    budget_s: float = 20.0,
    nixl_sizes: list[int] | None = None,
    nixl_runs: int = 5,
    handoff_results: Path | None = None,
    threads: int | None = None,
) -> CalibrationResult:
    """Measure layer time, memory bandwidth and NIXL bandwidth; return what to plan with.

    ``threads``: the CPU threads the layer timing may use (None: torch's default, every core).
    A CPU server pinned to one core computes with one thread, so timing its layer on all of
    them overstates its FLOP/s (here 241 against 143 GFLOP/s on one thread: docs/benchmarks.md)."""
    started = time.monotonic()
    try:
        with _torch_threads(threads):
            layer = time_layer(model, tokens or [128, 512], device, budget_s)
        if threads is not None and layer.device == "cpu":
            layer.notes.append(f"layer timed with {threads} CPU thread(s)")
    except (RuntimeError, MemoryError) as e:
        raise CalibrationError(f"layer timing failed on {device}: {e}") from e
    nixl_sizes = nixl_sizes or [1 << 20, 8 << 20, 32 << 20]
    nixl = _probe_nixl(nixl_sizes, nixl_runs, layer.device)
    acc = Accelerator(
        name=f"measured {layer.device}",
        bf16_flops=layer.flops_per_s,
        mem_bytes_per_s=layer.mem_bytes_per_s,
        mem_bytes=layer.mem_bytes,
        source=f"calibrated ({layer.dtype})",
    )
    link = Link(
        name="NIXL measured",
        bytes_per_s=nixl.bytes_per_s,
        per_transfer_s=nixl.per_transfer_s,
        source="calibrated",
    )
    check = (
        check_handoff_results(handoff_results, model, kv_dtype, link) if handoff_results else None
    )
    weight_bytes = 2 if layer.device == "cuda" else 4
    return CalibrationResult(
        acc, link, weight_bytes, layer, nixl, check, time.monotonic() - started
    )


def _probe_nixl(sizes: list[int], runs: int, device: str) -> Any:
    """The NIXL probe in the device's memory; on a GPU whose VRAM transfer fails, host memory,
    with the failure kept in the notes. Any other failure is a ``CalibrationError``."""
    from splitserve.planner.nixl_probe import measure_nixl_bandwidth

    # Pin the probe's target away from core 0, where this process usually runs.
    core = _other_core()
    try:
        return measure_nixl_bandwidth(sizes, runs=runs, cpu_core=core, memory=device)
    except Exception as e:  # nixl raises its own binding types; all end here, named
        if device != "cuda":
            raise CalibrationError(f"NIXL probe failed: {type(e).__name__}: {e}") from e
        vram_error = f"{type(e).__name__}: {e}"
        logger.warning("NIXL probe in GPU memory failed (%s); probing host memory", vram_error)
    try:
        result = measure_nixl_bandwidth(sizes, runs=runs, cpu_core=core, memory="cpu")
    except Exception as e:
        raise CalibrationError(f"NIXL probe failed: {type(e).__name__}: {e}") from e
    result.notes.append(f"the GPU-memory (VRAM) probe failed ({vram_error}): host memory measured")
    return result


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` for the block (None: unchanged)."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class CalibrationError(RuntimeError):
    """A measurement failed; the message says which and why."""


def _other_core() -> int | None:
    import os

    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    return cores[-1] if len(cores) > 1 else None
