"""The viability line's formulas for one point (pure): a layer's slice, the planner's prediction
(plain and with the forward's tail and DONE's delivery), the targets' tolerance, and the
crossover goodput, predicted and fitted from measured points. ``viability``'s module docstring
states the arithmetic; ``viability`` applies it to a run's rows (and re-exports these names).
"""

from __future__ import annotations

import statistics

from splitserve.planner.catalog import Link
from splitserve.planner.handoff import exposed_streaming_seconds, transfer_seconds

OURS = ("push", "pull")
STOCK = "nixl"
TOLERANCE = 0.25  # the targets: within 25% (or 2 ms); crossover within 25%
SLACK_S = 0.002
STOCK_RATIO = 0.25


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
    """DONE's delivery after the last slice landed, by direction (``viability``'s docstring)."""
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
    ``{"bps": B*|None, "how": ...}`` (``viability``'s docstring)."""
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
