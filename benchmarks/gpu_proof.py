"""The GPU path without an engine: NIXL on device memory, the layer poster, Hopper step times.

Three parts, each runnable with ``--device cpu`` (a test in the suite: small shapes, seconds)
and ``--device cuda`` (the H200 run prepared in ``scripts/device/gpu_proof.sh``):

1. **Transfer core.** Two processes with a KV-cache-shaped tensor set each (default
   Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, bf16, 4,096 tokens in 16-token blocks),
   registered with NIXL (VRAM on cuda, DRAM on cpu). P runs a synthetic prefill (per layer, GEMMs
   with that layer's FLOPs, then the layer's KV write) and posts each layer through the
   connector's own ``splitserve.transfer.layer_poster.LayerPoster`` into ``KVSender``; D
   (``KVReceiver``) checks every byte. Reported: per-layer compute ``t_c``, per-layer WRITE
   ``t_x`` and bulk WRITE (``KVAgent.post`` to completion), the exposed handoff (P's poster
   seeing the last layer's event -> D seeing DONE, which rides the final WRITE after every other
   WRITE completed), against the planner's ``t_x + (L-1) max(0, t_x - t_c)`` for the measured
   link.
2. **Event ordering.** ``--race`` transfers through a poster whose events do not wait (post as
   soon as the hook runs, before the layer's kernels ran), then ``--race`` through the real one;
   D counts stale bytes. On cpu a host thread plays the stream (``gpuproof.device``): it shows
   the poster's ordering logic, not CUDA's ordering of UCX copies against the compute stream.
3. **Step times.** One layer of the model timed as whole engine steps (prefill chunks after
   cached contexts, decode batches at several contexts, mixed steps); the roofline's error
   against them; a calibration file for ``splitserve plan --gpu H200 --calibration FILE``.

Outputs under ``--out``: ``report.json`` (everything), ``calibration.json`` (part 3), and a
summary on stdout.

    python benchmarks/gpu_proof.py --device cuda --out $OUT/gpu_proof
    python benchmarks/gpu_proof.py --device cpu --model splitserve-tiny --tokens 256 --out /tmp/g
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without the package installed
    sys.path.insert(1, str(HERE.parent))

from gpuproof import steps  # noqa: E402
from gpuproof.sender import run_sender  # noqa: E402
from gpuproof.transfer import Setup, run_receiver, summarize  # noqa: E402

logger = logging.getLogger("gpu_proof")

GRIDS = {  # part 3's default grid per device
    "cuda": {
        "chunks": [64, 256, 1024, 2048, 4096, 8192],
        "cached": [0, 4096, 16384],
        "batches": [1, 8, 32, 64, 128, 256],
        "contexts": [1024, 4096, 16384],
        "mixed": [(256, 32, 4096), (1024, 32, 4096), (1024, 128, 4096), (2048, 128, 4096)],
        "max_decode_tokens": 1 << 20,
    },
    "cpu": {
        "chunks": [16, 64],
        "cached": [0, 64],
        "batches": [1, 4],
        "contexts": [64],
        "mixed": [(16, 4, 64)],
        "max_decode_tokens": 1 << 12,
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--parts", default="1,2,3", help="comma-separated parts to run")
    ap.add_argument("--model", default="Llama-3.1-8B", help="catalog model for the shapes")
    ap.add_argument("--gpu", default=None, help="catalog GPU for the roofline (cuda: H200)")
    ap.add_argument("--layers", type=int, help="layers of the KV set (default: the model's)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the transfer")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--timed", type=int, default=5, help="timed layer-wise transfers")
    ap.add_argument("--race", type=int, default=20, help="transfers per race-check arm")
    ap.add_argument("--probe-runs", type=int, default=5, help="bulk WRITEs timed (x4 per layer)")
    ap.add_argument("--compute-scale", type=float, default=1.0, help="scale per-layer FLOPs")
    ap.add_argument(
        "--ucx-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="UCX backend parameter for both agents (the connector's ucx_backend_params), "
        "e.g. ucx_error_handling_mode=none",
    )
    ap.add_argument("--grid", help="JSON overriding part 3's grid keys (chunks, cached, ...)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_proof"))
    ap.add_argument("--role", choices=["sender"], help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--sender-out", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def make_setup(args: argparse.Namespace) -> tuple[Setup, dict]:
    """Part 1's shapes from the catalog model; the GEMM repeats that give a layer its FLOPs."""
    from splitserve.netutil import free_port
    from splitserve.planner.catalog import Accelerator, get_model
    from splitserve.planner.roofline import make_replica, step_cost

    model = get_model(args.model)
    unit = make_replica(Accelerator(name="unit", bf16_flops=1, mem_bytes_per_s=1, mem_bytes=1))
    layer_flops = step_cost(
        model, unit, 0, prefill_tokens=args.tokens, layers=1, lm_head=False
    ).flops
    hidden = model.hidden_size
    gemm_flops = 2.0 * args.tokens * hidden * hidden
    repeats = max(1, round(args.compute_scale * layer_flops / gemm_flops))
    setup = Setup(
        device=args.device,
        num_layers=args.layers or model.num_layers,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=args.block_size,
        tokens=args.tokens,
        hidden=hidden,
        compute_repeats=repeats,
        timed=args.timed,
        race=args.race,
        probe_runs=args.probe_runs,
        port=free_port(),
        ucx_params=dict(p.split("=", 1) for p in args.ucx_param),
    )
    info = {
        "model": args.model,
        "layer_flops": layer_flops,
        "synthetic_layer_flops": repeats * gemm_flops,
        "gemm": f"{repeats} x ({args.tokens} x {hidden}) @ ({hidden} x {hidden})",
    }
    return setup, info


def part_transfer(args: argparse.Namespace, report: dict) -> dict | None:
    setup, info = make_setup(args)
    logger.info("part 1/2: %s, %s", asdict(setup), info["gemm"])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-proof-") as tmp:
        data = run_receiver(setup, Path(__file__).resolve(), Path(tmp))
    summary = summarize(data, setup)
    report["transfer"] = {
        "setup": asdict(setup),
        **info,
        **summary,
        "seconds": time.monotonic() - started,
    }
    report["transfer_rows"] = data["rows"]
    return summary["link"]


def part_steps(args: argparse.Namespace, report: dict, link: dict | None) -> None:
    grid = dict(GRIDS[args.device])
    if args.grid:
        grid.update(json.loads(args.grid))
    points = steps.grid(
        grid["chunks"], grid["cached"], grid["batches"], grid["contexts"],
        [tuple(m) for m in grid["mixed"]], grid["max_decode_tokens"],
    )  # fmt: skip
    logger.info("part 3: %d step points of %s on %s", len(points), args.model, args.device)
    started = time.monotonic()
    timing = steps.time_steps(args.model, points, args.device)
    gpu = args.gpu or ("H200" if args.device == "cuda" else None)
    roofline = steps.compare_roofline(timing, gpu)
    path = args.out / "calibration.json"
    steps.write_calibration(path, timing, roofline, link, gpu)
    report["steps"] = {
        "calibration_file": str(path),
        "device_name": timing["device_name"],
        "points": timing["points"],
        "failed_points": timing["failed_points"],
        "roofline_error": roofline["errors"],
        "accelerator": roofline["accelerator"],
        "seconds": time.monotonic() - started,
    }


def print_summary(report: dict) -> None:
    t = report.get("transfer")
    if t:
        ms = 1e3
        print(
            f"## Transfer core ({report['device']}, {t['setup']['num_layers']} layers, "
            f"{t['setup']['tokens']} tokens, {t['layer_bytes'] / 2**20:.2f} MiB per layer)"
        )
        print("| figure | value |\n|---|---|")
        print(f"| per-layer compute t_c (median) | {t['layer_compute_s'] * ms:.3f} ms |")
        print(f"| per-layer WRITE t_x (median) | {t['layer_transfer_s'] * ms:.3f} ms |")
        print(f"| bulk WRITE, all layers | {t['bulk_transfer_s'] * ms:.3f} ms |")
        print(
            f"| link fitted | {t['link']['bytes_per_s'] / 1e9:.3g} GB/s + "
            f"{t['link']['per_transfer_s'] * 1e6:.0f} us |"
        )
        print(
            f"| exposed handoff (median of {len(t['exposed_handoff_s_all'])}) | "
            f"{t['exposed_handoff_s'] * ms:.3f} ms |"
        )
        print(f"| planner: t_x + (L-1) max(0, t_x - t_c) | {t['planner_exposed_s'] * ms:.3f} ms |")
        print(f"| of which: last layer's post | {t['last_post_after_event_s'] * ms:.3f} ms |")
        print(f"| of which: DONE round after it | {t['done_after_last_post_s'] * ms:.3f} ms |")
        ratio = t["exposed_over_planner"]
        print(f"| measured / planner | {'-' if ratio is None else f'{ratio:.2f}'} |")
        print(
            f"| bytes checked, wrong (timed) | {t['all_bytes_checked']}, {t['timed_bytes_wrong']} |"
        )
        for arm in ("race_nowait", "race_event"):
            r = t[arm]
            print(
                f"| {arm}: transfers with stale bytes | {r['iterations_with_stale_bytes']} of "
                f"{r['iterations']} ({r['bytes_wrong']} bytes) |"
            )
    s = report.get("steps")
    if s:
        print(f"\n## Step times ({s['device_name']}), roofline / measured")
        print("| step | measured | roofline (measured figures) | roofline (catalog) |")
        print("|---|---|---|---|")
        for p in s["points"]:
            label = (
                f"{p['kind']} n={p['prefill_tokens']} c={p['prefill_context']} "
                f"B={p['decode_seqs']} d={p['decode_context']}"
            )
            catalog = p.get("roofline_catalog_ratio")
            print(
                f"| {label} | {p['measured_s'] * 1e3:.3f} ms | "
                f"{p['roofline_measured_ratio']:.2f} | "
                f"{'-' if catalog is None else f'{catalog:.2f}'} |"
            )
        for label, e in s["roofline_error"].items():
            print(f"roofline ({label} figures): median |error| {e['median_abs_error']:.0%}, "
                  f"ratio {e['min_ratio']:.2f}..{e['max_ratio']:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.role == "sender":
        run_sender(Setup(**json.loads(args.setup)), args.sender_out)
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
    parts = {int(p) for p in args.parts.split(",") if p.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": args.device, "argv": sys.argv[1:], "errors": {}}
    link = None

    def save() -> None:  # after each part: a run cut short keeps what it measured
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=_finite))

    if parts & {1, 2}:
        try:
            link = part_transfer(args, report)
        except Exception as exc:  # keep going: part 3 needs no NIXL
            logger.exception("parts 1/2 failed")
            report["errors"]["transfer"] = f"{type(exc).__name__}: {exc}"
        save()
    if 3 in parts:
        try:
            part_steps(args, report, link)
        except Exception as exc:
            logger.exception("part 3 failed")
            report["errors"]["steps"] = f"{type(exc).__name__}: {exc}"
        save()
    print_summary(report)
    return 1 if report["errors"] else 0


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
