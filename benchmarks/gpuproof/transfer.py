"""Parts 1 and 2 of gpu_proof: the layer-wise transfer between two processes, and its ordering.

The receiver (D) runs in the calling process, the sender (P) in a child (``gpu_proof.py --role
sender``). Both hold a KV-cache-shaped tensor set (one ``(2, blocks, block_size, kv_heads,
head_dim)`` bf16 tensor per layer, vLLM's GPU layout) registered with NIXL as VRAM (cuda) or
DRAM (cpu), and speak through ``splitserve.transfer`` exactly as the connector does:
``KVReceiver.expect`` registers D's blocks, ``KVSender`` posts each layer through the
connector's ``LayerPoster``, DONE rides on P's final WRITE.

Per transfer P runs a synthetic prefill on its stream: per layer a matmul workload with the
layer's FLOPs (``compute_repeats`` GEMMs of ``tokens x hidden x hidden``), then the layer's KV
write (``device.pattern``: distinct per layer and transfer); the compute thread submits the
layer to the poster right after queueing it, as vLLM's ``save_kv_layer`` does. D poisons its
blocks before registering and, once DONE arrived, checks every byte of every layer.

The schedule, known to both sides: ``probe`` (no compute: P times single-layer and all-layer
WRITEs through ``KVAgent.post`` to D's registered blocks, the link the planner is given), then
``timed-i`` (the event poster; per-layer compute, handoff), then ``race-nowait-i`` (a poster
whose events do not wait: the race) and ``race-event-i`` (the real poster again).

This module holds what both sides share (``Setup``, the tensor set and its NIXL agent), the
receiver (``run_receiver``) and the figures (``summarize``); the sender is ``gpuproof.sender``'s
(``run_sender``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuproof.device import pattern

logger = logging.getLogger("gpu_proof")

AUTH_KEY = b"gpu-proof-deployment-key"


@dataclass
class Setup:
    """Everything both processes must agree on (passed to the child as JSON)."""

    device: str
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    tokens: int
    hidden: int
    compute_repeats: int
    timed: int
    race: int
    probe_runs: int
    port: int
    seed: int = 0
    spare_blocks: int = 8
    ucx_params: dict[str, str] = field(default_factory=dict)  # the connector's ucx_backend_params

    @property
    def request_blocks(self) -> int:
        return math.ceil(self.tokens / self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.request_blocks + self.spare_blocks

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One layer's request blocks, in logical order: (K/V, blocks, tokens, heads, dim)."""
        return (2, self.request_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def slice_bytes(self) -> int:
        """Bytes of one layer's request blocks (whole blocks: what a layer's WRITE moves)."""
        return 2 * self.request_blocks * self.block_size * self.kv_heads * self.head_dim * 2

    def blocks(self, side: str) -> list[int]:
        """The request's block ids on ``side`` ("P" or "D"): different permutations."""
        ids = list(range(self.num_blocks))
        random.Random(f"{self.seed}-{side}").shuffle(ids)
        return ids[: self.request_blocks]

    def schedule(self) -> list[tuple[str, str, int]]:
        """(transfer id, mode, iteration) in order; the iteration selects the KV pattern."""
        out = [("probe", "probe", 0)]
        out += [(f"timed-{i}", "event", 1 + i) for i in range(self.timed)]
        base = 1 + self.timed
        out += [(f"race-nowait-{i}", "nowait", base + i) for i in range(self.race)]
        base += self.race
        out += [(f"race-event-{i}", "event", base + i) for i in range(self.race)]
        return out


def _cache(torch: Any, setup: Setup) -> list[Any]:
    shape = (2, setup.num_blocks, setup.block_size, setup.kv_heads, setup.head_dim)
    return [
        torch.zeros(shape, dtype=torch.bfloat16, device=setup.device)
        for _ in range(setup.num_layers)
    ]


def _agent(name: str, cache: list[Any], setup: Setup) -> Any:
    from splitserve.transfer.agent import KVAgent
    from splitserve.transfer.layout import kv_layout_from_tensors

    layout = kv_layout_from_tensors(cache, setup.num_blocks, setup.block_size)
    return KVAgent(name, layout, backend_params=setup.ucx_params)


# ---------------------------------------------------------------------------------------------
# D: the calling process
# ---------------------------------------------------------------------------------------------


def run_receiver(setup: Setup, script: Path, workdir: Path) -> dict[str, Any]:
    """Start P, run the schedule as D, check every byte; the merged per-transfer records."""
    import torch

    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.side_channel import SideChannel

    if setup.device == "cpu":
        torch.set_num_threads(1)
    cache = _cache(torch, setup)
    cache16 = [c.view(torch.int16) for c in cache]
    d_blocks = setup.blocks("D")
    d_index = torch.tensor(d_blocks, device=setup.device)
    agent = _agent(f"gpu-proof-D-{os.getpid()}", cache, setup)
    channel = SideChannel(None, None, AUTH_KEY, name="gpu-proof-D")
    receiver = KVReceiver(agent, channel, done_timeout_s=120.0, abort_ack_timeout_s=5.0)
    out_path = workdir / "sender.json"
    child = subprocess.Popen(
        [sys.executable, str(script), "--role", "sender", "--setup", json.dumps(asdict(setup)),
         "--sender-out", str(out_path)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    results: list[dict[str, Any]] = []
    try:
        _await_ready(child)
        for tid, mode, iteration in setup.schedule():
            for layer in cache16:
                layer[:, d_index] = -1  # poison: a block P never wrote reads as stale
            if setup.device == "cuda":
                torch.cuda.synchronize()
            receiver.expect(tid, "127.0.0.1", setup.port, d_blocks, token_offset=0)
            outcome = None
            end = time.monotonic() + 120
            while outcome is None and time.monotonic() < end:
                outcome = receiver.poll().get(tid)
                if outcome is None:
                    time.sleep(0.0002)
            seen_wall = time.time()
            if outcome is None or not outcome.ok:
                raise RuntimeError(f"transfer {tid}: {outcome}")
            row: dict[str, Any] = {
                "tid": tid,
                "mode": mode,
                "done_seen_wall": seen_wall,
                "outcome_handoff_s": outcome.exposed_handoff_s,
            }
            if mode != "probe":
                row.update(_check(torch, cache16, d_index, setup, iteration))
            logger.info(
                "transfer %s: DONE seen, %s bytes wrong",
                tid,
                row.get("bytes_wrong", "(probe, not checked)"),
            )
            results.append(row)
        if child.wait(timeout=120) != 0:
            raise RuntimeError(f"sender exited with {child.returncode}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        channel.close()
        agent.close()
    sent = json.loads(out_path.read_text())
    by_tid = {r["tid"]: r for r in sent["records"]}
    for row in results:
        row.update({k: v for k, v in by_tid[row["tid"]].items() if k not in row})
    return {"rows": results, "sender_stats": sent["sender_stats"]}


def _await_ready(child: subprocess.Popen) -> None:
    """Read P's stdout up to its ready line (NIXL may log there first), then keep draining it
    to our stderr on a thread, so that P never blocks on a full pipe."""
    for line in child.stdout:
        if line.startswith('{"event": "ready"}'):
            break
        sys.stderr.write(line)
    else:
        raise RuntimeError(f"sender exited before it was ready (exit {child.wait()})")

    def drain() -> None:
        for line in child.stdout:
            sys.stderr.write(line)

    threading.Thread(target=drain, name="sender-stdout", daemon=True).start()


def _check(torch: Any, cache16: list[Any], d_index: Any, setup: Setup, iteration: int) -> dict:
    """Compare every byte of every layer with what P's layer wrote in this iteration."""
    stale_layers = []
    bad_elems = 0
    for layer, tensor in enumerate(cache16):
        got = tensor[:, d_index]
        want = pattern(torch, layer, iteration, setup.block_shape, setup.device)
        bad = int((got != want).sum().item())
        if bad:
            stale_layers.append(layer)
            bad_elems += bad
    return {
        "bytes_checked": setup.slice_bytes * setup.num_layers,
        "bytes_wrong": 2 * bad_elems,
        "stale_layers": stale_layers,
    }


def summarize(data: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """Part 1's figures and the planner's prediction; part 2's counts."""
    from splitserve.planner.catalog import Link
    from splitserve.planner.handoff import exposed_streaming_seconds
    from splitserve.planner.nixl_probe import NixlPoint, fit_bandwidth

    rows = data["rows"]
    probe = next(r["probe"] for r in rows if r["mode"] == "probe")
    t_x = statistics.median(probe["layer_write_s"])
    t_bulk = statistics.median(probe["bulk_write_s"])
    bandwidth, fixed = fit_bandwidth(
        [
            NixlPoint(probe["layer_bytes"], t_x, len(probe["layer_write_s"])),
            NixlPoint(probe["bulk_bytes"], t_bulk, len(probe["bulk_write_s"])),
        ]
    )
    link = Link(name=f"NIXL {setup.device} measured", bytes_per_s=bandwidth, per_transfer_s=fixed)
    timed = [r for r in rows if r["tid"].startswith("timed-")]
    per_layer_c = [s for r in timed for s in r["layer_compute_s"]]
    t_c = statistics.median(per_layer_c)
    exposed = [r["done_seen_wall"] - r["seen_wall"][-1] for r in timed]
    predicted = exposed_streaming_seconds(setup.num_layers, t_x, t_c)
    exposed_median = statistics.median(exposed)

    def race(prefix: str) -> dict[str, Any]:
        runs = [r for r in rows if r["tid"].startswith(prefix)]
        return {
            "iterations": len(runs),
            "iterations_with_stale_bytes": sum(1 for r in runs if r["bytes_wrong"]),
            "bytes_wrong": sum(r["bytes_wrong"] for r in runs),
            "bytes_checked": sum(r["bytes_checked"] for r in runs),
        }

    checked = [r for r in rows if r["mode"] != "probe"]
    return {
        "layer_bytes": probe["layer_bytes"],
        "bulk_bytes": probe["bulk_bytes"],
        "layer_transfer_s": t_x,
        "bulk_transfer_s": t_bulk,
        "link": link.model_dump(),
        "layer_compute_s": t_c,
        "layer_compute_s_min_max": [min(per_layer_c), max(per_layer_c)],
        "prefill_compute_s": statistics.median(sum(r["layer_compute_s"]) for r in timed),
        "exposed_handoff_s": exposed_median,
        "exposed_handoff_s_all": exposed,
        "last_post_after_event_s": statistics.median(
            r["posted_wall"][-1] - r["seen_wall"][-1] for r in timed
        ),
        # the DONE round the planner leaves out: P sees its WRITEs complete, posts the final
        # WRITE with DONE, D's poll reads the notification
        "done_after_last_post_s": statistics.median(
            r["done_seen_wall"] - r["posted_wall"][-1] for r in timed
        ),
        "exposed_handoff_s_from_forward_end": statistics.median(
            r["outcome_handoff_s"] for r in timed
        ),
        "planner_exposed_s": predicted,
        "planner_exposed_s_fitted_link": exposed_streaming_seconds(
            setup.num_layers, fixed + probe["layer_bytes"] / bandwidth, t_c
        ),
        "exposed_over_planner": exposed_median / predicted if predicted else None,
        "bulk_over_exposed": t_bulk / exposed_median if exposed_median else None,
        "timed_bytes_wrong": sum(r["bytes_wrong"] for r in timed),
        "all_bytes_checked": sum(r["bytes_checked"] for r in checked),
        "race_nowait": race("race-nowait-"),
        "race_event": race("race-event-"),
        "sender_stats": data["sender_stats"],
    }
