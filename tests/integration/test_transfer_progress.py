"""A posted WRITE completes while the poster makes no NIXL call (KVAgent's progress thread),
and a READ of a peer's memory completes while that peer's thread makes none (pull: the peer
holds progress, ``KVAgent.hold_progress``).

Over UCX ``tcp`` a WRITE moves only while someone drives NIXL progress; a prefill server posts a
layer's WRITE and then computes the next layer for a long time without calling into NIXL. Two
real processes, real NIXL: the child (P, ``UCX_TLS=tcp``) posts one large WRITE and then blocks
on its stdin; the test process (D) polls its own agent and its memory until every byte arrived,
then releases P. Without progress on P's side the bytes never arrive and the test fails at its
deadline (a bound for failure, not a timing measurement).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

NUM_LAYERS = 2
NUM_BLOCKS = 16
SHAPE = (2, NUM_BLOCKS, 8, 16, 64)  # 2 MiB per block per layer in fp32: 64 MiB per layer
BLOCK_SIZE = SHAPE[3]
SEED = 77


def make_cache(seed: int | None):
    import torch

    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(NUM_LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(SHAPE, generator=gen) for _ in range(NUM_LAYERS)]


def make_agent(name: str, cache):
    from splitserve.transfer.agent import KVAgent
    from splitserve.transfer.layout import kv_layout_from_tensors

    return KVAgent(name, kv_layout_from_tensors(cache, NUM_BLOCKS, BLOCK_SIZE))


def run_source() -> None:
    """P in a pull: hold progress for D's READ, then make no NIXL call from this thread."""
    cache = make_cache(SEED)
    agent = make_agent(f"P-{os.getpid()}", cache)
    agent.hold_progress()
    hello = {
        "metadata": base64.b64encode(agent.metadata()).decode(),
        "layout": agent.layout.model_dump(mode="json"),
    }
    print("EVENT " + json.dumps(hello), flush=True)
    sys.stdin.readline()  # blocks until D has read every byte
    agent.drop_progress()
    agent.close()


def run_poster() -> None:
    """P: post one WRITE of every block of every layer, then make no NIXL call until told."""
    from splitserve.transfer.layout import KVLayout

    cache = make_cache(SEED)
    agent = make_agent(f"P-{os.getpid()}", cache)
    peer = json.loads(sys.stdin.readline())
    name = agent.add_peer(
        base64.b64decode(peer["metadata"]), KVLayout.model_validate(peer["layout"])
    )
    blocks = list(range(NUM_BLOCKS))
    layers = [layer for layer in range(NUM_LAYERS) for _ in blocks]
    handle = agent.post("WRITE", name, layers, blocks * NUM_LAYERS, blocks * NUM_LAYERS)
    print("EVENT " + json.dumps({"posted": handle.num_bytes}), flush=True)
    sys.stdin.readline()  # blocks: no call into NIXL from this thread until D has every byte
    print("EVENT " + json.dumps({"settled": handle.settled}), flush=True)
    agent.release(handle)
    agent.close()


def next_event(child: subprocess.Popen) -> dict:
    """The child's next ``EVENT`` line (NIXL logs to stdout too)."""
    while True:
        line = child.stdout.readline()
        assert line, f"the posting process exited early with {child.wait()}"
        if line.startswith("EVENT "):
            return json.loads(line[len("EVENT ") :])


@pytest.mark.timeout(300)  # a hang (seen once with the progress thread disabled) fails here
def test_write_completes_without_poster_calls() -> None:
    import torch

    cache = make_cache(None)
    agent = make_agent(f"D-{os.getpid()}", cache)
    child = subprocess.Popen(
        [sys.executable, __file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "UCX_TLS": "tcp"},
    )
    try:
        hello = {
            "metadata": base64.b64encode(agent.metadata()).decode(),
            "layout": agent.layout.model_dump(mode="json"),
        }
        child.stdin.write(json.dumps(hello) + "\n")
        child.stdin.flush()
        posted = next_event(child)
        assert posted["posted"] == NUM_LAYERS * NUM_BLOCKS * 2 * 8 * 16 * 64 * 4
        expected = make_cache(SEED)
        deadline = time.monotonic() + 120
        arrived = False
        while time.monotonic() < deadline and not arrived:
            for _ in range(50):
                agent.notifications()  # D's side of the progress
                time.sleep(0.001)
            arrived = all(torch.equal(c, e) for c, e in zip(cache, expected, strict=True))
        assert arrived, "the WRITE did not complete while its poster made no NIXL call"
        child.stdin.write("go\n")
        child.stdin.flush()
        assert next_event(child) == {"settled": "DONE"}
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        agent.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_read_completes_while_the_source_computes(tls) -> None:
    import torch

    from splitserve.transfer.layout import KVLayout

    cache = make_cache(None)
    agent = make_agent(f"D-{os.getpid()}", cache)
    env = dict(os.environ)
    if tls == "tcp":
        env["UCX_TLS"] = "tcp"
    child = subprocess.Popen(
        [sys.executable, __file__, "source"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        peer = next_event(child)
        name = agent.add_peer(
            base64.b64decode(peer["metadata"]), KVLayout.model_validate(peer["layout"])
        )
        blocks = list(range(NUM_BLOCKS))
        layers = [layer for layer in range(NUM_LAYERS) for _ in blocks]
        handle = agent.post("READ", name, layers, blocks * NUM_LAYERS, blocks * NUM_LAYERS)
        expected = make_cache(SEED)
        deadline = time.monotonic() + 120
        while agent.check(handle) == "PROC":  # D's own progress thread drives it too
            assert time.monotonic() < deadline, "the READ did not complete"
            time.sleep(0.005)
        assert agent.check(handle) == "DONE"
        agent.release(handle)
        assert all(torch.equal(c, e) for c, e in zip(cache, expected, strict=True))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        agent.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["source"]:
        run_source()
    else:
        run_poster()
