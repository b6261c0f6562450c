"""Failures of a real SGLang PD pair on the ``splitserve`` transfer backend (CPU, real NIXL):

- the decode server dies while a long prompt streams: the prefill server fails that request
  with an error, frees its KV (token usage back to its baseline) and serves the next request
  with a new decode server;
- the prefill server dies while a long prompt streams: the decode request ends with an error
  (well within the backend's DONE timeout), the decode server frees its KV, and its next
  request (through its other prefill server) has the same tokens as before the kill.

These servers are throwaway (keys ``sglang-fail-*``, started through the session's server group
and stopped at the end of the module), never the shared pair. "While it streams" is observed,
not timed: the kill happens once the prefill server logged the first chunk of the request, which
it only computes after the decode server registered (SGLang prefills a PD request once bootstrap
is done), and the prompt is 40 chunks long.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
from session_keys import key_env

pytest.importorskip("sglang")

from splitserve.launch.engines import sglang_server  # noqa: E402
from splitserve.netutil import free_port, free_ports  # noqa: E402

pytestmark = pytest.mark.integration

CHUNK = 64
LONG = 40 * CHUNK
START_TIMEOUT = 600.0
WAIT_S = 300.0  # bound on every wait below (a loaded 2-core machine is slow, never hung)
ENV = {"SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "120", "SPLITSERVE_SGLANG_LEASE_S": "120"}
CHUNK_MARK = f"#new-token: {CHUNK},"


class Pair:
    """Starts and stops this module's servers in the session's group."""

    def __init__(self, group, model: str) -> None:
        self.group, self.model = group, model
        self.keys: list[str] = []
        self.bootstrap: dict[str, int] = {}

    def start(self, key: str, mode: str) -> None:
        if mode == "prefill":
            port, bootstrap = free_ports(2)
            self.bootstrap[key] = bootstrap
        else:
            port, bootstrap = free_port(), None
        cmd = sglang_server(
            self.model,
            port,
            mode=mode,
            transfer_backend="splitserve",
            bootstrap_port=bootstrap,
            served_model_name="tiny",
            chunked_prefill_size=CHUNK,
            env={**ENV, **key_env()},
        )
        self.group.add(key, cmd.argv, port=port, env=cmd.env)
        self.keys.append(key)

    def wait(self, *keys: str) -> None:
        self.group.wait(START_TIMEOUT, names=list(keys), stop_group_on_failure=False)

    def url(self, key: str) -> str:
        return self.group.servers[key].url

    def log(self, key: str) -> str:
        return (self.group.log_dir / f"{key}.log").read_text(errors="replace")

    def kill(self, key: str) -> None:
        """SIGKILL the server's whole process tree (a crash, no clean shutdown)."""
        server = self.group.servers.pop(key)
        root = psutil.Process(server.process.pid)
        procs = [root, *root.children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)
        server.process.stop()  # reaps what is left, closes the log

    def stop_all(self) -> None:
        for key in self.keys:
            server = self.group.servers.pop(key, None)
            if server is not None:
                server.process.stop()


@pytest.fixture(scope="module")
def pair(servers, tiny_model):
    running = Pair(servers.group, str(tiny_model))
    try:
        yield running
    finally:
        running.stop_all()


def generate(url: str, prompt: list[int], room: int, bootstrap: int) -> tuple[int, dict]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap,
        "bootstrap_room": room,
    }
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read()[:500].decode(errors="replace")}
    except (urllib.error.URLError, ConnectionError) as exc:  # the server we killed
        return -1, {"error": str(exc)}


def used_tokens(url: str) -> int:
    with urllib.request.urlopen(url + "/v1/loads?include=core", timeout=30) as resp:
        loads = json.loads(resp.read())["loads"]
    return sum(int(load["num_used_tokens"]) for load in loads)


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S}s: {what}")
        time.sleep(0.2)


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(LONG)]


class Request:
    """One PD request sent to P and D at the same time, each answer kept."""

    def __init__(self, pair: Pair, p_key: str, d_key: str, prompt: list[int]) -> None:
        room, bootstrap = random.randrange(2**62), pair.bootstrap[p_key]
        self.answers: dict[str, tuple[int, dict]] = {}
        self.threads = [
            threading.Thread(
                target=lambda k=k, u=pair.url(k): self.answers.__setitem__(
                    k, generate(u, prompt, room, bootstrap)
                ),
                daemon=True,
            )
            for k in (p_key, d_key)
        ]
        for thread in self.threads:
            thread.start()

    def join(self) -> dict[str, tuple[int, dict]]:
        for thread in self.threads:
            thread.join(WAIT_S + 30)
            assert not thread.is_alive(), "a request hung"
        return self.answers


def stream_then_kill(pair: Pair, p_key: str, d_key: str, victim: str, seed: int):
    before = pair.log(p_key).count(CHUNK_MARK)
    request = Request(pair, p_key, d_key, prompt_of(seed))
    wait_for(lambda: pair.log(p_key).count(CHUNK_MARK) > before, "prefill started the prompt")
    pair.kill(victim)
    return request.join()


def test_decode_killed_mid_transfer_prefill_frees_and_keeps_serving(pair):
    pair.start("sglang-fail-p1", "prefill")
    pair.start("sglang-fail-d1", "decode")
    pair.wait("sglang-fail-p1", "sglang-fail-d1")
    p_url = pair.url("sglang-fail-p1")
    baseline = used_tokens(p_url)

    answers = stream_then_kill(pair, "sglang-fail-p1", "sglang-fail-d1", "sglang-fail-d1", 1)
    status, body = answers["sglang-fail-p1"]
    assert status >= 400, f"prefill answered {status} {body} although its decode died"
    wait_for(lambda: used_tokens(p_url) <= baseline, "prefill KV back to baseline")
    assert "splitserve transfer failed" in pair.log("sglang-fail-p1")

    pair.start("sglang-fail-d2", "decode")
    pair.wait("sglang-fail-d2")
    answers = Request(pair, "sglang-fail-p1", "sglang-fail-d2", prompt_of(2)[:200]).join()
    status, body = answers["sglang-fail-d2"]
    assert status == 200 and len(body["output_ids"]) == 8, (status, body)
    assert answers["sglang-fail-p1"][0] == 200


def test_prefill_killed_decode_request_ends_with_an_error(pair):
    """...and the decode server, whose other prefill server stays up, then serves a request
    through that one with the same tokens as before the kill."""
    for key, mode in (("sglang-fail-d2", "decode"), ("sglang-fail-p1", "prefill")):
        if key not in pair.group.servers:
            pair.start(key, mode)
    pair.start("sglang-fail-p2", "prefill")
    pair.wait("sglang-fail-p1", "sglang-fail-p2", "sglang-fail-d2")
    d_url = pair.url("sglang-fail-d2")
    short = prompt_of(4)[:200]
    before = Request(pair, "sglang-fail-p1", "sglang-fail-d2", short).join()["sglang-fail-d2"]
    assert before[0] == 200, before
    baseline = used_tokens(d_url)

    answers = stream_then_kill(pair, "sglang-fail-p2", "sglang-fail-d2", "sglang-fail-p2", 3)
    status, body = answers["sglang-fail-d2"]
    assert status >= 400, f"decode answered {status} {body} although its prefill died"
    wait_for(lambda: used_tokens(d_url) <= baseline, "decode KV back to baseline")
    with urllib.request.urlopen(d_url + "/health", timeout=60) as resp:
        assert resp.status == 200
    after = Request(pair, "sglang-fail-p1", "sglang-fail-d2", short).join()["sglang-fail-d2"]
    assert after[0] == 200 and after[1]["output_ids"] == before[1]["output_ids"], (before, after)
