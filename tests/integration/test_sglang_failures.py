"""Failures of a real SGLang PD pair on the ``splitserve`` transfer backend (CPU, real NIXL):

- the decode server dies while a long prompt streams: the prefill server fails that request
  with an error, frees its KV (token usage back to its baseline) and serves the next request
  with a new decode server;
- the prefill server dies while a long prompt streams: the decode request ends with an error
  (well within the backend's DONE timeout), the decode server frees its KV, and its next
  request (through its other prefill server) has the same tokens as before the kill.

The servers: the session's SGLang PD pair (``sglang-pd-prefill`` / ``sglang-pd-decode``, the
``sglang_pair`` fixture of tests/integration/conftest.py, whose environment is this module's:
tests/integration/sglang_servers.py), which this module runs after test_sglang_pd.py and
test_proxy_sglang.py, as their last user (it kills, restarts and freezes them, and stops them at
its end); and the victims that a kill does not bring back, throwaway (keys ``sglang-fail-d1``
and ``sglang-fail-p2``, stopped at the end of the module). "While it streams" is observed, not
timed: the kill happens once the prefill server logged the first chunk of the request, which it
only computes after the decode server registered (SGLang prefills a PD request once bootstrap is
done), and the prompt is 40 chunks long.

The SGLang rows of the fault matrix (issue #20; tests/integration/test_fault_matrix.py has the
vLLM rows, whose pass criterion these share: every request ends within its bound with a clear
error or the single server's greedy answer, KV usage on P and D is back to its baseline within
the lease, the next request is correct), each through our proxy (``splitserve proxy --engine
sglang``, what users run in front of a pair) over the pair:

- clients that go away at a random point in 0-3 s of a ~4,000-token streamed prompt
  (``ROUNDS`` times, ``SPLITSERVE_FAULT_ROUNDS`` lowers it);
- P SIGKILLed while D holds its registration, restarted on its same HTTP and bootstrap ports
  (a new side-channel port, which D learns from the bootstrap server): only the request in
  flight fails, the next ones are correct, D is never restarted;
- P or D frozen (SIGSTOP of its whole tree) for longer than ``SPLITSERVE_SGLANG_LEASE_S``,
  then resumed.

The reference is a single SGLang server (key ``sglang-single``, the same command line as
tests/integration/test_sglang_pd.py's, so a session shares it) chunking by the same ``CHUNK``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import completion_client
import psutil
import pytest
import sglang_servers
from completion_client import Outcome
from metrics_text import fetch_metrics, metric_sum
from sglang_servers import SGLANG_LEASE_S, SGLANG_PD_KEYS

pytest.importorskip("sglang")

from splitserve.launch.process import ProcessStartError  # noqa: E402
from splitserve.proxy.background import BackgroundProxy  # noqa: E402
from splitserve.proxy.config import build_config  # noqa: E402

pytestmark = pytest.mark.integration

CHUNK = sglang_servers.CHUNK
LONG = 40 * CHUNK
START_TIMEOUT = 600.0
START_ATTEMPTS = 3  # a server that fails to start is started again on fresh ports
WAIT_S = 300.0  # bound on every wait below (a loaded 2-core machine is slow, never hung)
LEASE_S = SGLANG_LEASE_S  # small, so that a freeze can outlast it (docs/sglang.md, "Failures")
CHUNK_MARK = f"#new-token: {CHUNK},"
FAULT_LONG = 62 * CHUNK  # 3,968 tokens: the matrix's ~4,000-token prompt
MAX_TOKENS = 8
REQUEST_S = 120.0  # the proxy's total_s: bound on one request (a loaded 2-core machine)
KV_BOUND_S = LEASE_S + 60  # KV back to baseline: the lease, plus slack for a loaded machine
# Client disconnects (the 20 rounds; the vLLM matrix reads the same variable).
ROUNDS = int(os.environ.get("SPLITSERVE_FAULT_ROUNDS", "20"))
P_KEY, D_KEY = SGLANG_PD_KEYS
SINGLE = sglang_servers.SINGLE
D_VICTIM, P_VICTIM = "sglang-fail-d1", "sglang-fail-p2"
FAILED_MARK = "splitserve transfer failed"


class Pair:
    """The shared pair and this module's victims (started and stopped here), in the session's
    group."""

    def __init__(self, servers, model: str, bootstrap_port: int) -> None:
        self.servers, self.group, self.model = servers, servers.group, model
        self.keys: list[str] = []  # the victims
        self.modes: dict[str, str] = {}
        self.bootstrap: dict[str, int] = {P_KEY: bootstrap_port}

    def start(self, key: str, mode: str) -> None:
        """A victim, started as the pair's P or D are (tests/integration/sglang_servers.py)."""
        if mode == "prefill":
            sglang_servers.start_prefill(self.servers, self.model, key=key)
            self.bootstrap[key] = sglang_servers.bootstrap_port(self.servers, key)
        else:
            sglang_servers.start_decode(self.servers, self.model, key=key)
        self.keys.append(key)
        self.modes[key] = mode

    def wait(self, *keys: str) -> None:
        """Wait for the servers; one that fails to start is started again on fresh ports (a
        port picked free can be taken before SGLang binds it: "address already in use")."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self.group.wait(START_TIMEOUT, names=list(keys), stop_group_on_failure=False)
                return
            except ProcessStartError as e:  # the group stopped and dropped that server
                if attempt == START_ATTEMPTS or e.name not in self.modes:
                    raise
                self.start(e.name, self.modes[e.name])

    def url(self, key: str) -> str:
        return self.group.servers[key].url

    def log(self, key: str) -> str:
        return (self.group.log_dir / f"{key}.log").read_text(errors="replace")

    def kill(self, key: str) -> None:
        """SIGKILL the server's whole process tree (a crash, no clean shutdown); it leaves the
        group."""
        self.crash(key)
        self.group.servers.pop(key).process.stop()  # reaps what is left, closes the log

    def crash(self, key: str) -> None:
        """SIGKILL the server's whole tree, keeping it in the group for ``restart``."""
        procs = self.tree(key)
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)

    def restart(self, key: str) -> None:
        """Start it again with its same command line: same HTTP and bootstrap ports."""
        self.group.restart(key, note="restarted by test_sglang_failures")

    def tree(self, key: str) -> list[psutil.Process]:
        root = psutil.Process(self.group.servers[key].process.pid)
        return [root, *root.children(recursive=True)]

    def signal(self, key: str, sig: int) -> None:
        for proc in self.tree(key):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)

    def ensure(self, key: str) -> None:
        """A server of the pair running (restarted when a failed test left it dead)."""
        server = self.group.servers.get(key)
        assert server is not None, f"{key} is gone from the session's servers"
        if not server.process.alive():
            self.restart(key)

    def stop_all(self) -> None:
        """Stop the victims and the pair (this module is the pair's last user), each woken
        first if a failed test left it frozen."""
        for key in [*self.keys, *SGLANG_PD_KEYS]:
            server = self.group.servers.pop(key, None)
            if server is not None:
                with contextlib.suppress(psutil.Error, TypeError):  # a frozen tree: wake it
                    root = psutil.Process(server.process.pid)
                    for proc in [root, *root.children(recursive=True)]:
                        proc.send_signal(signal.SIGCONT)
                server.process.stop()


@pytest.fixture(scope="module")
def pair(servers, tiny_model, sglang_pair):
    running = Pair(servers, str(tiny_model), sglang_pair.bootstrap_port)
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
    """P streams to a D (the victim) that is killed mid-prompt; P then serves the next request
    with its other D (the pair's)."""
    for key in (P_KEY, D_KEY):
        pair.ensure(key)
    pair.start(D_VICTIM, "decode")
    pair.wait(P_KEY, D_KEY, D_VICTIM)
    p_url = pair.url(P_KEY)
    baseline = used_tokens(p_url)
    failed_before = pair.log(P_KEY).count(FAILED_MARK)

    answers = stream_then_kill(pair, P_KEY, D_VICTIM, D_VICTIM, 1)
    status, body = answers[P_KEY]
    assert status >= 400, f"prefill answered {status} {body} although its decode died"
    wait_for(lambda: used_tokens(p_url) <= baseline, "prefill KV back to baseline")
    assert pair.log(P_KEY).count(FAILED_MARK) > failed_before

    answers = Request(pair, P_KEY, D_KEY, prompt_of(2)[:200]).join()
    status, body = answers[D_KEY]
    assert status == 200 and len(body["output_ids"]) == 8, (status, body)
    assert answers[P_KEY][0] == 200


def test_prefill_killed_decode_request_ends_with_an_error(pair):
    """...and the decode server, whose other prefill server stays up, then serves a request
    through that one with the same tokens as before the kill."""
    for key in (P_KEY, D_KEY):
        pair.ensure(key)
    pair.start(P_VICTIM, "prefill")
    pair.wait(P_KEY, D_KEY, P_VICTIM)
    d_url = pair.url(D_KEY)
    short = prompt_of(4)[:200]
    before = Request(pair, P_KEY, D_KEY, short).join()[D_KEY]
    assert before[0] == 200, before
    baseline = used_tokens(d_url)

    answers = stream_then_kill(pair, P_VICTIM, D_KEY, P_VICTIM, 3)
    status, body = answers[D_KEY]
    assert status >= 400, f"decode answered {status} {body} although its prefill died"
    wait_for(lambda: used_tokens(d_url) <= baseline, "decode KV back to baseline")
    with urllib.request.urlopen(d_url + "/health", timeout=60) as resp:
        assert resp.status == 200
    after = Request(pair, P_KEY, D_KEY, short).join()[D_KEY]
    assert after[0] == 200 and after[1]["output_ids"] == before[1]["output_ids"], (before, after)


# -- the fault matrix's SGLang rows (issue #20), through our proxy ----------------------------


def body_for(prompt: list[int], stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def send(url: str, body: dict[str, Any], timeout: float = REQUEST_S + 30) -> Outcome:
    """POST a completion through ``completion_client`` under this module's bound."""
    return completion_client.send(url, body, timeout)


def send_and_leave(url: str, body: dict[str, Any], after_s: float) -> None:
    completion_client.send_and_leave(url, body, after_s, REQUEST_S)


@dataclass
class Fronts:
    """The pair behind our proxy, and the single server that is the reference."""

    pair: Pair
    single: str
    p_url: str
    d_url: str

    def reference(self, prompt: list[int]) -> str:
        answer = send(self.single, body_for(prompt))
        assert answer.text is not None, answer
        return answer.text

    def baselines(self) -> dict[str, int]:
        return {key: used_tokens(self.pair.url(key)) for key in (P_KEY, D_KEY)}

    def kv_back(self, baselines: dict[str, int]) -> None:
        """KV usage on P and D back to its baseline within the lease (plus slack)."""
        for key, baseline in baselines.items():
            url = self.pair.url(key)
            deadline = time.monotonic() + KV_BOUND_S
            while (used := used_tokens(url)) > baseline:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{key}: {used} KV tokens used, baseline {baseline}, after "
                        f"{KV_BOUND_S:.0f} s\n{self.hints()}"
                    )
                time.sleep(0.5)

    def hints(self, lines: int = 12) -> str:
        """P's and D's last transfer warnings and errors, for a failure message."""
        out = []
        for key in (P_KEY, D_KEY):
            found = [
                line[:240]
                for line in self.pair.log(key).splitlines()
                if ("WARNING" in line or "ERROR" in line)
                and any(w in line for w in ("splitserve", "transfer", "side channel", "Abort"))
            ]
            out.append(f"--- {key}: " + ("\n".join(found[-lines:]) or "(nothing)"))
        return "\n".join(out)

    def check_next(self, proxy_url: str, seed: int, stream: bool = False) -> None:
        prompt = prompt_of(seed)[:300]
        answer = send(proxy_url, body_for(prompt, stream))
        assert answer.text == self.reference(prompt), f"{answer}\n{self.hints()}"


@pytest.fixture
def fronts(pair, servers, tiny_model) -> Fronts:
    """The pair (restarted as needed when an earlier test left it dead) and the single
    server."""
    group = servers.group
    sglang_servers.start_single(servers, tiny_model)  # first: protected from evictions
    pair.ensure(P_KEY)
    pair.ensure(D_KEY)
    group.wait(START_TIMEOUT, names=[P_KEY, D_KEY, SINGLE], stop_group_on_failure=False)
    return Fronts(pair, group.servers[SINGLE].url, pair.url(P_KEY), pair.url(D_KEY))


@contextlib.contextmanager
def proxy(fronts: Fronts, **timeouts: float) -> Iterator[BackgroundProxy]:
    config = build_config(
        {
            "engine": "sglang",
            "port": 0,
            "prefill": [{"url": fronts.p_url, "bootstrap_port": fronts.pair.bootstrap[P_KEY]}],
            "decode": [{"url": fronts.d_url}],
            # SGLang's /health runs a generation: slow on a loaded CPU, so be patient with it.
            "health": {"interval_s": 1.0, "timeout_s": 30.0, "failures_to_eject": 3},
            "timeouts": {"first_byte_s": 60.0, "stream_idle_s": 30.0, "total_s": REQUEST_S}
            | timeouts,
        }
    )
    with BackgroundProxy(config) as running:
        yield running


def computing(pair: Pair, before: int) -> None:
    """P logged a chunk of a prompt after ``before`` chunks: D registered (P prefills a PD
    request only once its bootstrap is done) and P is computing it."""
    wait_for(lambda: pair.log(P_KEY).count(CHUNK_MARK) > before, "prefill computing the prompt")


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(FAULT_LONG)]


def test_clients_leave_at_random_points_of_a_long_prompt(fronts):
    """``ROUNDS`` streamed 3,968-token requests through the proxy whose clients go away at a
    seeded random point in 0-3 s (waiting for D's bootstrap, mid-prefill on P, mid-transfer or
    mid-stream on D): KV usage on P and D is back to its baseline within the lease and the next
    requests (plain and streamed) are the single server's answers."""
    rng = random.Random(20)
    baselines = fronts.baselines()
    with proxy(fronts) as running:
        for i in range(ROUNDS):
            body = body_for(long_prompt(2000 + i), stream=True)
            send_and_leave(running.url, body, rng.uniform(0, 3))
        fronts.kv_back(baselines)
        for i in range(2):
            fronts.check_next(running.url, 30 + i, stream=bool(i))
        left = metric_sum(
            fetch_metrics(running.url), "splitserve_proxy_requests_total", status="499"
        )
        assert left >= 1, "no request counted as left by its client"
    fronts.kv_back(baselines)


def test_prefill_restarted_on_its_ports_while_decode_holds_registrations(fronts):
    """P SIGKILLed while it computes a prompt D registered for, then started again on its same
    HTTP and bootstrap ports: that request ends with a clean error within its bound (one pair:
    nothing to retry on), D's KV is back to its baseline, and every next request is the single
    server's answer, D never restarted."""
    pair = fronts.pair
    d_pid = pair.group.servers[D_KEY].process.pid
    prompts = [prompt_of(40 + i)[:200] for i in range(4)]
    refs = [fronts.reference(p) for p in prompts]
    baselines = fronts.baselines()
    with proxy(fronts) as running, ThreadPoolExecutor(1) as pool:
        before = pair.log(P_KEY).count(CHUNK_MARK)
        future = pool.submit(send, running.url, body_for(long_prompt(41)))
        computing(pair, before)
        pair.crash(P_KEY)
        answer = future.result(timeout=REQUEST_S + 60)
        assert answer.text is None and answer.clean, f"{answer}\n{fronts.hints()}"
        fronts.kv_back({D_KEY: baselines[D_KEY]})
        pair.restart(P_KEY)
        pair.wait(P_KEY)
        backend = running.state.prefill.backends[0]
        wait_for(lambda: backend.healthy, "the restarted P readmitted by health checks")
        answers = [
            send(running.url, body_for(p, stream=bool(i % 2))) for i, p in enumerate(prompts)
        ]
    assert [a.text for a in answers] == refs, f"{answers}\n{fronts.hints()}"
    assert pair.group.servers[D_KEY].process.pid == d_pid, "D was restarted"
    fronts.kv_back(baselines)


@pytest.mark.parametrize("victim", [P_KEY, D_KEY], ids=["prefill", "decode"])
def test_server_frozen_past_the_lease_then_resumed(fronts, victim):
    """P or D frozen (SIGSTOP of its whole tree) while P computes a prompt, for longer than the
    lease, then resumed (SIGCONT): the request ends within its bound with a clean error or the
    single server's answer, KV usage on P and D is back to its baseline once it runs again, and
    the next request is correct."""
    pair = fronts.pair
    prompt = long_prompt(80 + (victim == D_KEY))
    ref = fronts.reference(prompt)
    baselines = fronts.baselines()
    timeouts = {"first_byte_s": 25.0, "stream_idle_s": 15.0}
    with proxy(fronts, **timeouts) as running, ThreadPoolExecutor(1) as pool:
        before = pair.log(P_KEY).count(CHUNK_MARK)
        future = pool.submit(send, running.url, body_for(prompt, stream=True))
        computing(pair, before)
        pair.signal(victim, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            answer = future.result(timeout=REQUEST_S + 60)
            remaining = LEASE_S + 2 - (time.monotonic() - frozen_at)
            if remaining > 0:
                time.sleep(remaining)  # frozen past the lease, as the case says
        finally:
            pair.signal(victim, signal.SIGCONT)
        assert answer.clean and answer.text in (None, ref), f"{answer}\n{fronts.hints()}"
        fronts.kv_back(baselines)
        fronts.check_next(running.url, 90 + (victim == D_KEY), stream=True)
    fronts.kv_back(baselines)
