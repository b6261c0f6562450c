"""Part 1's sender (P) of gpu_proof, run in the child process (``gpu_proof.py --role sender``):
the synthetic prefill on its stream, each layer posted through the connector's ``LayerPoster``
into ``KVSender`` (the event poster, and the race arm's poster whose events do not wait), and the
``probe`` transfer's link WRITEs. ``transfer`` holds the ``Setup`` both sides agree on, the
receiver (D) and the figures."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpuproof.device import NoWait, make_stream, pattern
from gpuproof.transfer import AUTH_KEY, Setup, _agent, _cache


def _until(predicate, bound_s: float, what: str, poll=None) -> None:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        if poll is not None:
            poll()
        if predicate():
            return
        time.sleep(0.0002)
    raise TimeoutError(f"{what} within {bound_s}s")


def run_sender(setup: Setup, out_path: Path) -> None:
    import torch

    from splitserve.transfer.layer_poster import LayerPoster, cuda_device
    from splitserve.transfer.sender import KVSender, StepUpdate
    from splitserve.transfer.side_channel import SideChannel
    from splitserve.transfer.state import TransferState
    from splitserve.transfer.strategy import Direction

    if setup.device == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(setup.seed)
    cache = _cache(torch, setup)
    cache16 = [c.view(torch.int16) for c in cache]
    compute_dtype = torch.bfloat16 if setup.device == "cuda" else torch.float32
    x = torch.randn(setup.tokens, setup.hidden, device=setup.device, dtype=compute_dtype)
    w = torch.randn(setup.hidden, setup.hidden, device=setup.device, dtype=compute_dtype)
    w /= math.sqrt(setup.hidden)
    p_blocks = setup.blocks("P")
    p_index = torch.tensor(p_blocks, device=setup.device)
    agent = _agent(f"gpu-proof-P-{os.getpid()}", cache, setup)
    channel = SideChannel("127.0.0.1", setup.port, AUTH_KEY, name="gpu-proof-P")
    sender = KVSender(agent, channel, lease_s=120.0, direction=Direction.PUSH)
    stream = make_stream(torch, setup.device)
    lock = threading.Lock()
    seen: dict[int, float] = {}  # layer -> wall clock when the poster saw its event complete
    posted: dict[int, float] = {}  # layer -> wall clock when its post returned

    def post_layer(layer: int) -> None:
        seen[layer] = time.time()
        sender.layer_done(layer)
        posted[layer] = time.time()

    # The connector's poster, as the worker builds it on a GPU (cuda: its own CUDA event of the
    # stream and thread binding; cpu: the host stream's events); the race arm differs only in
    # events that do not wait.
    on_start = cuda_device(agent.layout.device_id) if setup.device == "cuda" else None
    posters = {
        mode: LayerPoster(post_layer, lock, record_event=record, on_start=on_start, name=mode)
        for mode, record in (("event", stream.record), ("nowait", NoWait))
    }

    def layer_work(layer: int, iteration: int):
        def work() -> None:
            y = x
            for _ in range(setup.compute_repeats):
                y = y @ w
            fresh = pattern(torch, layer, iteration, setup.block_shape, setup.device)
            cache16[layer][:, p_index] = fresh

        return work

    def poll() -> set[str]:
        with lock:
            return sender.poll()

    released: set[str] = set()
    records = []
    print(json.dumps({"event": "ready"}), flush=True)
    for tid, mode, iteration in setup.schedule():
        sender.add_request(tid, setup.tokens)
        _until(
            lambda tid=tid: sender.state_of(tid) is TransferState.STREAMING,
            120,
            f"registration of {tid}",
            poll=lambda: released.update(poll()),
        )
        record: dict[str, Any] = {"tid": tid, "mode": mode}
        if mode == "probe":
            record["probe"] = _probe_link(agent, sender.registration_of(tid), setup, p_blocks)
            with lock:
                sender.begin_step([StepUpdate(tid, p_blocks, setup.tokens)])
                for layer in range(setup.num_layers):
                    sender.layer_done(layer)
                sender.end_step()
        else:
            seen.clear()
            posted.clear()
            poster = posters[mode]
            with lock:
                sender.begin_step([StepUpdate(tid, p_blocks, setup.tokens)])
            record["start_wall"] = time.time()
            for layer in range(setup.num_layers):
                stream.launch(layer, layer_work(layer, iteration))
                poster.submit(layer)
            record["queued_wall"] = time.time()
            poster.drain()
            with lock:
                sender.end_step()
            record["seen_wall"] = [seen[layer] for layer in range(setup.num_layers)]
            record["posted_wall"] = [posted[layer] for layer in range(setup.num_layers)]
        with lock:
            sender.finish_request(tid)
        _until(
            lambda tid=tid: tid in released,
            120,
            f"release of {tid}",
            poll=lambda: released.update(poll()),
        )
        record["released_wall"] = time.time()
        stream.synchronize()
        layer_s = stream.take_layer_seconds()
        record["layer_compute_s"] = [layer_s[layer] for layer in sorted(layer_s)]
        records.append(record)
    stats = asdict(sender.stats)
    for poster in posters.values():
        poster.close()
    stream.close()
    channel.close()
    agent.close()
    out_path.write_text(json.dumps({"records": records, "sender_stats": stats}, default=list))


def _probe_link(agent: Any, registration: Any, setup: Setup, p_blocks: list[int]) -> dict:
    """Single-layer and all-layer WRITEs into D's registered blocks, timed to completion."""
    peer = registration.agent_name
    dst = list(registration.block_ids[0])
    n = len(p_blocks)

    def write(layers: list[int]) -> float:
        start = time.perf_counter()
        handle = agent.post(
            "WRITE", peer, [layer for layer in layers for _ in range(n)], p_blocks * len(layers),
            dst * len(layers),
        )  # fmt: skip
        while agent.check(handle) == "PROC":
            pass
        elapsed = time.perf_counter() - start
        if agent.check(handle) != "DONE":
            raise RuntimeError(f"probe WRITE failed: {agent.check(handle)}")
        agent.release(handle)
        return elapsed

    for layer in range(min(2, setup.num_layers)):
        write([layer])  # warm-up: first use of each path
    layer_s = [write([i % setup.num_layers]) for i in range(setup.probe_runs * 4)]
    all_layers = list(range(setup.num_layers))
    write(all_layers)
    bulk_s = [write(all_layers) for _ in range(setup.probe_runs)]
    return {
        "layer_bytes": setup.slice_bytes,
        "bulk_bytes": setup.slice_bytes * setup.num_layers,
        "layer_write_s": layer_s,
        "bulk_write_s": bulk_s,
        "descriptors_per_layer": n * 2,
    }
