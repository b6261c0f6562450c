"""Time whole engine steps of a served model and fit the simulator's step model (issue #24).

The planner's ``--calibrate`` times one model layer's matrix products in torch; a served engine's
step also holds its attention kernels, sampling, scheduling and streaming. This script serves
the ``--preset`` test model on one pinned CPU core, exactly as ``benchmarks/goodput.py`` serves
its budget-4096 contenders (fp32, eager, ``VLLM_CPU_KVCACHE_SPACE=2``, ``taskset``), and times
three kinds of step from a streaming client on the other core:

- **prefill alone**: one prompt of N tokens (``PREFILL_TOKENS``), nothing else running; its
  time to first token is one step (N <= the budget) plus the server's per-request work;
- **decodes alone**: k streams decoding together (``DECODE_STREAMS``); the median gap between
  their tokens while all k run is one step of k decodes;
- **mixed**: k streams decoding when a prompt of N tokens arrives (``MIXED``); the streams'
  largest gap while that prompt is computed is one step of k decodes plus the N-token chunk.

Each measured step becomes a sample of the adaptive budget's own features (tokens, sequences,
attention pairs; ``splitserve.schedulers.step_model``), and the four coefficients are fitted by
non-negative least squares on relative errors (each row weighted by ``1 / measured``, as the
policy's online fit weighs them). The output is a calibration file the simulator reads
(``splitserve simulate --calibration`` and ``benchmarks/sim_vs_goodput.py --calibration``):
``splitserve plan --calibrate --json`` run on the same core with one thread (the machine's
memory and NIXL link, which the step model does not cover), plus a ``step_model`` object (the
coefficients, the model's catalog name, and every point with the fit's error on it).

    .venv/bin/python benchmarks/calibrate_engine.py --preset mid --out runs/engine-cal-mid.json

A script, not a test: one server start (~30 s) and about a minute of requests. Run it on a
quiet machine; a busy second core slows the client and shows as longer steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from scipy.optimize import nnls

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec
from splitserve.schedulers.step_model import FEATURE_NAMES, StepFeatures, chunk_attention_pairs

sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput as gp  # noqa: E402  (the served model's flags, as the goodput run serves it)

logger = logging.getLogger("benchmarks.calibrate_engine")

PREFILL_TOKENS = (32, 128, 512, 1024, 2048, 3072, 4000)
DECODE_STREAMS = (1, 2, 4, 8, 16, 32)
MIXED = ((2, 256), (2, 1024), (4, 512), (4, 2048), (8, 1024), (8, 4000), (16, 256), (16, 2048))
DECODE_PROMPT = 64  # tokens of each decoding stream's prompt
REPEATS = 2
CORE = 0


@dataclass(frozen=True)
class Point:
    kind: str  # prefill, decode, mixed
    features: StepFeatures
    measured_s: float


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[float]]:
    """Post one streamed completion; (send time, token arrival times)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: {") and b'"choices"' in line:
                times.append(time.perf_counter())
    return sent, times


async def _prefill_points(url: str, rng: random.Random, vocab: int) -> list[Point]:
    points = []
    async with aiohttp.ClientSession() as s:
        for n in PREFILL_TOKENS:
            for _ in range(REPEATS):
                sent, times = await _stream(s, url, _prompt(rng, n, vocab), 1)
                feats = StepFeatures(n, 1, chunk_attention_pairs(0, n))
                points.append(Point("prefill", feats, times[0] - sent))
    return points


async def _decode_points(url: str, rng: random.Random, vocab: int) -> list[Point]:
    points = []
    out = 64
    async with aiohttp.ClientSession() as s:
        for k in DECODE_STREAMS:
            for _ in range(REPEATS):
                runs = await asyncio.gather(
                    *(_stream(s, url, _prompt(rng, DECODE_PROMPT, vocab), out) for _ in range(k))
                )
                # the window where every stream decodes: after the last first token, before
                # the first stream's last token
                start = max(t[1][0] for t in runs)
                end = min(t[1][-1] for t in runs)
                gaps = [
                    b - a
                    for _, ts in runs
                    for a, b in zip(ts, ts[1:], strict=False)
                    if a >= start and b <= end
                ]
                if len(gaps) < 8:
                    continue
                ctx = DECODE_PROMPT + out // 2  # mean context over the window
                feats = StepFeatures(k, k, k * (ctx + 1))
                points.append(Point("decode", feats, statistics.median(gaps)))
    return points


async def _mixed_points(url: str, rng: random.Random, vocab: int) -> list[Point]:
    points = []
    async with aiohttp.ClientSession() as s:
        for k, n in MIXED:
            for _ in range(REPEATS):
                out = 400
                streams = [
                    asyncio.ensure_future(_stream(s, url, _prompt(rng, DECODE_PROMPT, vocab), out))
                    for _ in range(k)
                ]
                await asyncio.sleep(1.5)  # the streams are decoding
                sent, times = await _stream(s, url, _prompt(rng, n, vocab), 1)
                done = times[0]
                runs = await asyncio.gather(*streams)
                # each stream's gap spanning the prompt's step: the largest inside the window
                spans = []
                for _, ts in runs:
                    pairs_of = zip(ts, ts[1:], strict=False)
                    inside = [b - a for a, b in pairs_of if b >= sent and a <= done]
                    if inside:
                        spans.append(max(inside))
                if len(spans) < k:
                    continue
                gen = [sum(1 for t in ts if t <= sent) for _, ts in runs]
                ctx = DECODE_PROMPT + statistics.mean(gen)
                pairs = int(k * (ctx + 1)) + chunk_attention_pairs(0, n)
                feats = StepFeatures(k + n, k + 1, pairs)
                points.append(Point("mixed", feats, statistics.median(spans)))
    return points


def fit(points: list[Point]) -> tuple[list[float], list[dict[str, Any]]]:
    """Non-negative least squares on relative errors; coefficients in FEATURE_NAMES order
    (milliseconds per the step model's units) and each point with its fitted error."""
    x = np.array([p.features.vector() for p in points])
    y = np.array([p.measured_s * 1e3 for p in points])
    w = 1.0 / y
    coef, _ = nnls(x * w[:, None], y * w)
    rows = []
    for p, xi, yi in zip(points, x, y, strict=True):
        pred = float(xi @ coef)
        rows.append({"kind": p.kind, "tokens": p.features.tokens,
                     "sequences": p.features.sequences,
                     "attention_pairs": p.features.attention_pairs,
                     "measured_ms": round(float(yi), 3), "fitted_ms": round(pred, 3),
                     "error": round(pred / float(yi) - 1, 4)})  # fmt: skip
    return [float(c) for c in coef], rows


def layer_calibration(preset: str) -> dict[str, Any]:
    """``splitserve plan --calibrate --json`` for the preset's catalog model, one thread, pinned
    to the server's core: the machine's memory figures and NIXL link."""
    exe = Path(sys.executable).with_name("splitserve")
    cmd = ["taskset", "-c", str(CORE), str(exe), "plan", "--model", f"splitserve-{preset}",
           "--kv-dtype", "fp32", "--calibrate", "--calibrate-threads", "1", "--json"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout)["calibration"]


async def measure(url: str, vocab: int, seed: int) -> list[Point]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as s:  # warm-up: first steps compile and allocate
        for n in (64, 2000):
            await _stream(s, url, _prompt(rng, n, vocab), 4)
    points = await _prefill_points(url, rng, vocab)
    points += await _decode_points(url, rng, vocab)
    points += await _mixed_points(url, rng, vocab)
    return points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mid", help="test model preset (splitserve.models)")
    ap.add_argument("--out", type=Path, required=True, help="calibration file to write")
    ap.add_argument("--seed", type=int, default=24)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = resolve_spec(args.preset)
    work = Path(tempfile.mkdtemp(prefix="calibrate-engine-"))
    model = build_model(spec, work / "model")
    cal = layer_calibration(args.preset)
    flags = gp.budget_args()  # goodput's budget-4096 servers, no lpt cap, default scheduler
    with ServerGroup(work / "logs") as servers:
        srv = servers.add_vllm("calibrate", str(model), served_model_name="bench",
                               extra_args=flags, cpu_core=CORE, cpus=[CORE],
                               env={"VLLM_CPU_KVCACHE_SPACE": "2"})  # fmt: skip
        servers.wait(900.0)
        os.sched_setaffinity(0, {c for c in os.sched_getaffinity(0) if c != CORE} or {CORE})
        points = asyncio.run(measure(srv.url, spec.vocab_size, args.seed))
    missing = {"prefill", "decode", "mixed"} - {p.kind for p in points}
    if missing:
        raise SystemExit(f"no usable {', '.join(sorted(missing))} steps: nothing to fit")
    coef, rows = fit(points)
    errors = sorted(abs(r["error"]) for r in rows)
    fitted = dict(zip(FEATURE_NAMES, coef, strict=True))
    step_model = {"model": f"splitserve-{args.preset}", **fitted,
                  "notes": [f"vLLM server flags {flags}, taskset -c {CORE}, fp32, "
                            "VLLM_CPU_KVCACHE_SPACE=2; client on the other core",
                            f"{len(rows)} steps; |error| median {statistics.median(errors):.1%}, "
                            f"max {errors[-1]:.1%}"],
                  "points": rows}  # fmt: skip
    cal["step_model"] = step_model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"calibration": cal}, indent=2))
    print(f"step model of splitserve-{args.preset} ({len(rows)} steps):")
    for name, c in zip(FEATURE_NAMES, coef, strict=True):
        print(f"  {name} = {c:.4g}")
    print("| kind | tokens | sequences | pairs | measured ms | fitted ms | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['tokens']} | {r['sequences']} | {r['attention_pairs']} "
              f"| {r['measured_ms']:.1f} | {r['fitted_ms']:.1f} | {r['error']:+.1%} |")  # fmt: skip
    scale = slo_scale(coef) if args.preset == "mid" else None
    if scale is not None:
        tokens, seconds = gp.SLO_REFERENCE_PREFILL
        print(f"goodput.py's SLO was set where {tokens} tokens prefilled in {seconds:g} s; "
              f"here {scale * seconds:.2f} s: --slo-scale {scale:.2g}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


def slo_scale(coef: list[float]) -> float:
    """This machine's time for goodput.py's reference prefill (one prompt alone, by the fitted
    step model) over the time where its SLO was set: the ``--slo-scale`` to run it with."""
    tokens, seconds = gp.SLO_REFERENCE_PREFILL
    alone = StepFeatures(tokens, 1, chunk_attention_pairs(0, tokens))
    predicted_ms = sum(c * v for c, v in zip(coef, alone.vector(), strict=True))
    return predicted_ms / 1e3 / seconds


if __name__ == "__main__":
    sys.exit(main())
