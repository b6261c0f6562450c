"""The fault matrix on real processes (issue #20): real vLLM servers with ``SplitserveConnector``
behind the real proxy, and faults a fleet sees: a P SIGKILLed mid-prefill, a D SIGKILLed
mid-transfer (push and pull), clients that go away at a random point of a long prompt, a P
restarted on its same ports under a live D, and a P or a D frozen (SIGSTOP) for longer than the
lease. And the proxy's own rules against such servers (docs/proxy.md, "Faults"): outlier
ejection of a D that answers 500 to every request and of a frozen D, the half-open probe after
the ejection, and panic routing to a busy single P that misses its health checks.

Pass criterion, per case (docs/connector-protocol.md, "Failure matrix"; docs/proxy.md,
"Faults"): every request ends within its bound with a clear error (an HTTP error with the
OpenAI error body, or an SSE ``error`` event) or the colocated server's greedy answer; KV usage
on every P and D is back to 0 within the lease; the next request is correct.

Servers (keys ``fm-*``, this module's own, stopped at its end): ``fm-p1`` (P, pulls), ``fm-p2``
(P, pushes) and ``fm-d`` (D), all ``kv_both`` (so ``fm-p2`` is also a second working D for
``fm-p1``); a request without ``kv_transfer_params`` makes ``fm-d`` a colocated server: the
reference. ``fm-dx`` is a misconfigured D: started with a deployment key no P accepts, each of
its KV loads fails at the side channel's handshake (``key mismatch``, docs/security.md) and
vLLM's default ``kv_load_failure_policy: fail`` ends the request with HTTP 500, the realistic
"D answers 500 to everything" (tests/integration/fault_fleet.py starts them). Their model is
the tiny preset made wider (hidden 512, MLP 2048: see ``fault_fleet.FAULT_MODEL``) so that a
~3,600-token prompt keeps P busy for seconds on one core, long enough to kill it mid-prefill;
its KV per token is the tiny model's. A killed server is restarted at once (``Fleet.kill`` then
``Fleet.restart``: same command line, same HTTP and side-channel ports) and waited for only by
the test that needs it next.

The outlier and panic tests set their proxy's rules small (2 or 3 failures in a row, ejections
of seconds, a 1 ms health-check timeout) and observe every state through the proxy's metrics,
``/ready`` and live backend state, never by elapsed time.

"Mid-prefill" is observed, not timed: a kill waits until the server's ``/metrics`` show the
request running (``vllm:num_requests_running``), and the prompt takes several chunked steps.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import completion_client
import fault_fleet
import psutil
import pytest
from completion_client import Outcome
from fault_fleet import BAD_D, KEYS, LEASE_S
from metrics_text import fetch_metrics, metric_sum

from splitserve.launch.group import ServerGroup
from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

pytestmark = pytest.mark.integration

START_TIMEOUT = 420.0
WAIT_S = 120.0  # bound on every wait for a state (KV freed, a request running)
REQUEST_S = 90.0  # bound on one request through the proxy (a loaded 2-core machine)
LONG_WORDS = 1650  # about 3,600 tokens of the word prompt below
MAX_TOKENS = 8
# Client disconnects per flow (the 20 rounds: about 33 s per flow here).
ROUNDS = int(os.environ.get("SPLITSERVE_FAULT_ROUNDS", "20"))
PREFILL_LEAD_S = 0.3  # into P's prefill (several seconds long) before the fault


# -- servers -------------------------------------------------------------------------------------


class Fleet:
    """This module's servers in the session's group: started together, killed (SIGKILL of the
    whole tree, as a crash) or frozen one at a time, restarted on their same ports."""

    def __init__(self, group: ServerGroup) -> None:
        self.group = group
        self.side: dict[str, int] = {}

    def url(self, key: str) -> str:
        return self.group.servers[key].url

    def pid(self, key: str) -> int:
        pid = self.group.servers[key].process.pid
        assert pid is not None
        return pid

    def wait(self, *keys: str) -> None:
        """Wait for the servers (all by default), restarting any found dead (a test that
        failed between its kill and its restart must not leave the next one a dead server)."""
        for key in keys or KEYS:
            if not self.group.servers[key].process.alive():
                self.restart(key)
        self.group.wait(START_TIMEOUT, names=list(keys or KEYS), stop_group_on_failure=False)

    def tree(self, key: str) -> list[psutil.Process]:
        root = psutil.Process(self.pid(key))
        return [root, *root.children(recursive=True)]

    def kill(self, key: str) -> None:
        """SIGKILL the server's whole process tree (no clean shutdown)."""
        procs = self.tree(key)
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=30)

    def restart(self, key: str) -> None:
        """Start it again on its same ports (not waited for)."""
        self.group.restart(key, note="restarted by test_fault_matrix")

    def signal(self, key: str, sig: int) -> None:
        for proc in self.tree(key):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(sig)

    def stop_all(self) -> None:
        for key in KEYS:
            server = self.group.servers.pop(key, None)
            if server is not None:
                self.signal_safe_cont(server)
                server.process.stop()

    @staticmethod
    def signal_safe_cont(server: Any) -> None:
        """A frozen tree would not stop on SIGTERM: wake it first."""
        with contextlib.suppress(psutil.Error, TypeError):
            root = psutil.Process(server.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def fleet(servers, tiny_model, tmp_path_factory) -> Iterator[Fleet]:
    running = Fleet(servers.group)
    try:
        fault_fleet.start(servers, tiny_model, tmp_path_factory)  # those not started ahead
        running.side = {key: servers.side_port(key) for key in KEYS}
        running.wait()
        yield running
    finally:
        running.stop_all()


def proxy_config(
    fleet: Fleet, prefill: list[str], decode: tuple[str, ...] = ("fm-d",), **overrides: Any
):
    return build_config(
        {
            "port": 0,
            "flow": "concurrent",
            "prefill": [{"url": fleet.url(k), "side_channel_port": fleet.side[k]} for k in prefill],
            "decode": [{"url": fleet.url(k)} for k in decode],
            "routing": {"prefill": "round_robin"},
            "health": {"interval_s": 1.0, "timeout_s": 5.0},
            "timeouts": {"first_byte_s": 60.0, "stream_idle_s": 30.0, "total_s": REQUEST_S},
            **overrides,
        }
    )


@contextlib.contextmanager
def proxy(
    fleet: Fleet, prefill: list[str], decode: tuple[str, ...] = ("fm-d",), **overrides: Any
) -> Iterator[BackgroundProxy]:
    with BackgroundProxy(proxy_config(fleet, prefill, decode, **overrides)) as running:
        yield running


# -- requests ------------------------------------------------------------------------------------


def text_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "now"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def body_for(prompt: str, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


def send(url: str, body: dict[str, Any], timeout: float = REQUEST_S) -> Outcome:
    """POST a completion through ``completion_client`` under this module's bound."""
    return completion_client.send(url, body, timeout)


def send_and_leave(url: str, body: dict[str, Any], after_s: float) -> None:
    completion_client.send_and_leave(url, body, after_s, REQUEST_S)


def colocated(fleet: Fleet, prompt: str) -> str:
    """The reference: ``fm-d`` serving the prompt alone (no kv_transfer_params)."""
    answer = send(fleet.url("fm-d"), body_for(prompt))
    assert answer.text is not None, answer
    return answer.text


def metric(url: str, name: str) -> float:
    return metric_sum(fetch_metrics(url), name)


def wait_for(predicate, what: str, bound: float = WAIT_S, step: float = 0.05) -> float:
    """Poll ``predicate`` until true; the seconds waited (fails past ``bound``)."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > bound:
            raise AssertionError(f"not within {bound:.0f} s: {what}")
        time.sleep(step)
    return time.monotonic() - t0


def kv_free(fleet: Fleet, keys: tuple[str, ...] = KEYS, bound: float = LEASE_S + 30) -> None:
    """KV usage back to 0 on each server within the lease (plus slack for a loaded machine)."""
    for key in keys:
        url = fleet.url(key)
        wait_for(
            lambda url=url: metric(url, "vllm:kv_cache_usage_perc") == 0.0,
            f"{key}: KV cache usage back to 0",
            bound=bound,
            step=0.5,
        )


def in_prefill(proxy_: BackgroundProxy, *backends: Any) -> None:
    """Wait until the proxy has a prefill request in flight on each of ``backends`` (sent, not
    answered: P computes it), then a little longer, so that a fault lands mid-prefill; fails if
    one answered meanwhile (the fault would not be the case under test)."""
    wait_for(lambda: all(b.outstanding > 0 for b in backends), "P computing the request")
    time.sleep(PREFILL_LEAD_S)
    assert all(b.outstanding > 0 for b in backends), "P answered before the fault: prompt too short"


def backend_of(pool: Any, url: str) -> Any:
    """The proxy's live state of the server at ``url``."""
    port = urlsplit(url).port
    return next(b for b in pool.backends if urlsplit(b.url).port == port)


def hints(fleet: Fleet, lines: int = 12) -> str:
    """The servers' last transfer warnings and errors (side channel, KV loads), for a failure
    message: what the engines saw is most of what explains a wrong outcome."""
    out = []
    for key in KEYS:
        log = fleet.group.servers[key].process.log_path
        text = log.read_text(errors="replace") if log.exists() else ""
        found = [
            line[:240]
            for line in text.splitlines()
            if ("WARNING" in line or "ERROR" in line)
            and any(w in line for w in ("side channel", "KV load", "transfer", "sender"))
        ]
        out.append(f"--- {key}: " + ("\n".join(found[-lines:]) or "(nothing)"))
    return "\n".join(out)


def check_next(fleet: Fleet, proxy_url: str, seed: int, stream: bool = False) -> None:
    prompt = text_prompt(300, seed)
    answer = send(proxy_url, body_for(prompt, stream))
    assert answer.text == colocated(fleet, prompt), f"{answer}\n{hints(fleet)}"


# -- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("first_token", [True, False], ids=["first-token", "concurrent"])
def test_clients_leave_at_random_points_of_a_long_prompt(fleet, first_token):
    """``ROUNDS`` streamed 3,600-token requests whose clients go away at a seeded random point
    in 0-3 s (mid-prefill on P, mid-transfer, or mid-stream on D): nothing is left held (KV back
    to 0 on every server within the lease) and the next request is correct."""
    fleet.wait()
    rng = random.Random(60 + first_token)
    with proxy(fleet, ["fm-p1", "fm-p2"], first_token_from_prefill=first_token) as running:
        for i in range(ROUNDS):
            prompt = text_prompt(LONG_WORDS, 1000 * (1 + first_token) + i)
            send_and_leave(running.url, body_for(prompt, stream=True), rng.uniform(0, 3))
        kv_free(fleet)
        for i in range(2):
            check_next(fleet, running.url, 70 + 2 * first_token + i, stream=bool(i))
        text = fetch_metrics(running.url)
        left = metric_sum(text, "splitserve_proxy_requests_total", status="499")
        assert left >= 1, "no request counted as left by its client"
    kv_free(fleet)


def test_p_killed_mid_prefill_is_retried_with_two_p_and_ends_cleanly_with_one(fleet):
    """``fm-p1`` SIGKILLed mid-prefill with two 3,600-token requests on it (one computing, the
    other queued behind it; nothing reached either client), each sent by a proxy of its own:

    - one that knows two P: it retries on the other pair, and the streamed answer is the
      colocated one;
    - one that knows only ``fm-p1``, while D holds a registration for it: its client gets a
      clean error (no other pair to retry on) within the bound.

    KV is free on the survivors; ``fm-p1`` restarts on its same HTTP and side-channel ports and
    both proxies' health checks readmit it; D, whose side-channel connection was to the dead P,
    serves with the new one. Through the two-P proxy the next requests (one per P) are correct;
    through the one-P proxy, of the next four at most one fails, the others are the colocated
    answers. (One kill and one restart for both cases: a restart is most of a case's time.)"""
    fleet.wait()
    retried_prompt, single_prompt = text_prompt(LONG_WORDS, 10), text_prompt(LONG_WORDS, 30)
    ref = colocated(fleet, retried_prompt)
    refs = [colocated(fleet, text_prompt(200, 31 + i)) for i in range(4)]
    with (
        proxy(fleet, ["fm-p1", "fm-p2"]) as two_p,
        proxy(fleet, ["fm-p1"]) as one_p,
        ThreadPoolExecutor(2) as pool,
    ):
        retried = pool.submit(send, two_p.url, body_for(retried_prompt, stream=True))
        single = pool.submit(send, one_p.url, body_for(single_prompt))
        # round robin: the two-P proxy's first request goes to its first P, fm-p1
        in_prefill(two_p, backend_of(two_p.state.prefill, fleet.url("fm-p1")))
        in_prefill(one_p, one_p.state.prefill.backends[0])
        fleet.kill("fm-p1")
        answer = retried.result(timeout=REQUEST_S + 30)
        assert answer.text == ref, f"{answer}\n{hints(fleet)}"
        assert answer.seconds < REQUEST_S
        answer = single.result(timeout=REQUEST_S + 30)
        assert answer.text is None and answer.clean and answer.status >= 500, answer
        kv_free(fleet, ("fm-p2", "fm-d"))
        fleet.restart("fm-p1")
        fleet.wait("fm-p1")
        for running in (two_p, one_p):
            backend = backend_of(running.state.prefill, fleet.url("fm-p1"))
            wait_for(lambda b=backend: b.healthy, "the restarted P readmitted by health checks")
        for i in range(2):  # round robin: each P serves one
            check_next(fleet, two_p.url, 20 + i, stream=bool(i))
        answers = [send(one_p.url, body_for(text_prompt(200, 31 + i))) for i in range(4)]
    failed = [a for a in answers if a.text is None]
    assert len(failed) <= 1 and all(a.clean for a in failed), f"{answers}\n{hints(fleet)}"
    for answer, want in zip(answers, refs, strict=True):
        assert answer.text in (None, want), answer
    kv_free(fleet)


def test_p_restarted_while_d_idles_serves_every_next_request(fleet):
    """P served D, then was killed and restarted on its ports while D's engine sat idle (so D
    polled nothing: the old connection's loss waited in its channel). Every next request is
    the colocated answer: D handles that loss before it registers, says HELLO to the new P,
    and a connection P answers late (busy starting) is not dropped mid-handshake."""
    fleet.wait()
    refs = [colocated(fleet, text_prompt(200, 61 + i)) for i in range(4)]
    with proxy(fleet, ["fm-p1"]) as running:
        first = send(running.url, body_for(text_prompt(200, 61)))
        assert first.text == refs[0], f"{first}\n{hints(fleet)}"
        fleet.kill("fm-p1")
        fleet.restart("fm-p1")
        fleet.wait("fm-p1")
        backend = running.state.prefill.backends[0]
        wait_for(lambda: backend.healthy, "the restarted P readmitted by health checks")
        answers = [send(running.url, body_for(text_prompt(200, 61 + i))) for i in range(4)]
    assert [a.text for a in answers] == refs, f"{answers}\n{hints(fleet)}"


def test_d_killed_mid_transfer_push_and_pull(fleet):
    """D SIGKILLed while two P compute for it, one pulling (``fm-p1``: P announces, D reads)
    and one pushing (``fm-p2``: P writes into D): each client gets a clean error within the
    bound, each P frees the request's KV within the lease (pull: no PULLED after DONE; push: the
    WRITE fails), D restarts on its ports, and the next request through each P is correct."""
    fleet.wait()
    prompts = [text_prompt(LONG_WORDS, 40 + i) for i in range(2)]
    next_refs = [colocated(fleet, text_prompt(300, 50 + i)) for i in range(2)]
    with (
        proxy(fleet, ["fm-p1"]) as pull,
        proxy(fleet, ["fm-p2"]) as push,
        ThreadPoolExecutor(2) as pool,
    ):
        futures = [
            pool.submit(send, pull.url, body_for(prompts[0], stream=True)),
            pool.submit(send, push.url, body_for(prompts[1])),
        ]
        in_prefill(pull, pull.state.prefill.backends[0])
        in_prefill(push, push.state.prefill.backends[0])
        fleet.kill("fm-d")
        for future in futures:
            answer = future.result(timeout=REQUEST_S + 30)
            assert answer.text is None and answer.clean, answer
        kv_free(fleet, ("fm-p1", "fm-p2"))
        fleet.restart("fm-d")
        fleet.wait("fm-d")
        for proxy_, i in ((pull, 0), (push, 1)):
            backend = proxy_.state.decode.backends[0]
            wait_for(lambda b=backend: b.healthy, "the restarted D readmitted")
            answer = send(proxy_.url, body_for(text_prompt(300, 50 + i)))
            assert answer.text == next_refs[i], f"{answer}\n{hints(fleet)}"
    kv_free(fleet)


@pytest.mark.parametrize("victim", ["fm-p1", "fm-d"])
def test_server_frozen_past_the_lease_then_resumed(fleet, victim):
    """P or D frozen (SIGSTOP of its whole tree) mid-request for longer than the lease, then
    resumed (SIGCONT): the request ends within its bound while the server is still frozen (D:
    the side channel's heartbeats; the proxy: ``first_byte_s`` / ``stream_idle_s``), KV is
    back to 0 on both once it runs again, and the next request is correct."""
    fleet.wait()
    prompt = text_prompt(LONG_WORDS, 80 + (victim == "fm-d"))
    timeouts = {"first_byte_s": 25.0, "stream_idle_s": 15.0, "total_s": REQUEST_S}
    with proxy(fleet, ["fm-p1"], timeouts=timeouts) as running, ThreadPoolExecutor(1) as pool:
        future = pool.submit(send, running.url, body_for(prompt, stream=True))
        in_prefill(running, running.state.prefill.backends[0])
        fleet.signal(victim, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            answer = future.result(timeout=REQUEST_S + 30)
            remaining = LEASE_S + 2 - (time.monotonic() - frozen_at)
            if remaining > 0:
                time.sleep(remaining)  # frozen past the lease, as the case says
        finally:
            fleet.signal(victim, signal.SIGCONT)
        assert answer.clean, answer
        assert answer.text in (None, colocated(fleet, prompt)), answer
        kv_free(fleet, ("fm-p1", "fm-d"))
        check_next(fleet, running.url, 90 + (victim == "fm-d"), stream=True)
    kv_free(fleet)


# -- outlier detection and panic (issue #20) -----------------------------------------------------

ROUND_ROBIN = {"prefill": "round_robin", "decode": "round_robin"}
BASE_EJECTION_S = 8.0
# Below any answer time of /health: vLLM's API server answers it in its own process, so a P
# busy in its engine answered within 50 ms on this machine (first run); the state under test
# (a single P ejected ``health_timeout`` while it computes a long prompt) is made certain.
PANIC_HEALTH_TIMEOUT_S = 0.001


def ejections(proxy_url: str, reason: str, server: str | None = None) -> float:
    labels = {"reason": reason} if server is None else {"reason": reason, "server": server}
    return metric_sum(fetch_metrics(proxy_url), "splitserve_proxy_ejections_total", **labels)


def ready_entry(proxy_url: str, pool: str, server_url: str) -> dict[str, Any]:
    """The proxy's ``/ready`` view of one server (200 or 503: read either)."""
    parts = urlsplit(proxy_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", "/ready")
        data = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    port = urlsplit(server_url).port
    return next(s for s in data[pool]["servers"] if urlsplit(s["url"]).port == port)


def idle(url: str) -> bool:
    text = fetch_metrics(url)
    return (
        metric_sum(text, "vllm:num_requests_running")
        + metric_sum(text, "vllm:num_requests_waiting")
        == 0
    )


def finished(url: str) -> float:
    """Requests the server finished with an answer (not aborted, not failed)."""
    text = fetch_metrics(url)
    return sum(
        metric_sum(text, "vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop")
    )


def test_a_d_whose_loads_all_fail_is_ejected_and_its_probe_ejects_it_for_longer(fleet):
    """Two D, one of them ``fm-dx`` (a key no P accepts: each KV load fails at the handshake
    and vLLM's ``kv_load_failure_policy: fail`` ends the request with HTTP 500). Round robin
    sends it every other request; D's 500 is relayed to that client (not retried: D's request
    is never sent twice), and its ``consecutive_failures`` (3) failures in a row eject it
    (``reason="outlier"``). While it is out every request goes to ``fm-d`` and is the
    colocated answer. Once its ejection is over it is half-open: its one probe (a request, or a
    passing health check then a request on probation) fails and ejects it again, for twice the
    time."""
    fleet.wait()
    prompts = [text_prompt(200, 500 + i) for i in range(3)]
    refs = [colocated(fleet, p) for p in prompts]
    outlier = {"consecutive_failures": 3, "base_ejection_s": BASE_EJECTION_S, "max_ejection_s": 60}
    bad_url = fleet.url(BAD_D)
    with proxy(
        fleet,
        ["fm-p1"],
        ("fm-d", BAD_D),
        routing=ROUND_ROBIN,
        outlier=outlier,
        first_token_from_prefill=False,  # D's status reaches the client (before the commit)
    ) as running:
        bad = backend_of(running.state.decode, bad_url)
        first: list[Outcome] = []
        for i in range(12):  # round robin: the 3rd failure is the 6th request
            if bad.ejected_by is not None:
                break
            answer = send(running.url, body_for(prompts[i % 3]))
            first.append(answer)
            assert answer.text in (None, refs[i % 3]), f"{answer}\n{hints(fleet)}"
        failed = [a for a in first if a.text is None]
        assert [a.status for a in failed] == [500] * 3 and all(a.clean for a in failed), first
        assert ejections(running.url, "outlier", bad.url) == 1
        assert ejections(running.url, "outlier") == 1, "the good D or P was ejected too"
        # Out: every request goes to the good D, until the half-open probe fails.
        served, probe, i = 0, None, 0
        t0 = time.monotonic()
        while probe is None:
            assert time.monotonic() - t0 < WAIT_S + BASE_EJECTION_S, "no half-open probe"
            answer = send(running.url, body_for(prompts[i % 3]))
            if ejections(running.url, "outlier", bad.url) >= 2:
                probe = answer  # the request that probed it
            else:
                assert answer.text == refs[i % 3], f"{answer}\n{hints(fleet)}"
                served += 1
            i += 1
        assert probe.text is None and probe.status == 500 and probe.clean, probe
        assert served >= 1, "no request served while the bad D was out"
        entry = ready_entry(running.url, "decode", bad_url)
        assert entry["ejected_by"] == "outlier", entry
        assert f"out for {2 * BASE_EJECTION_S:g} s" in entry["error"], entry
        for j in range(2):  # out again: the good D serves
            answer = send(running.url, body_for(prompts[j]))
            assert answer.text == refs[j], f"{answer}\n{hints(fleet)}"
        assert ejections(running.url, "outlier") == 2
    kv_free(fleet)


def test_a_frozen_d_is_ejected_after_timeouts_and_serves_again_once_resumed(fleet):
    """Two D: ``fm-d`` and ``fm-p2`` (``kv_both``: a D to ``fm-p1``, which pulls). ``fm-p2``
    is frozen (SIGSTOP: alive, silent); round robin sends it every other streamed request,
    which ends in 504 after ``first_byte_s``, and 2 of them in a row eject it (outlier; its
    health checks, which time out too, are set not to eject here so the outlier rule is the one
    under test). The other D serves meanwhile. Resumed (SIGCONT), it is readmitted once its
    ejection is over (a passing health check or its half-open probe) and serves correct
    answers again."""
    fleet.wait()
    victim = "fm-p2"
    prompts = [text_prompt(200, 600 + i) for i in range(3)]
    refs = [colocated(fleet, p) for p in prompts]
    with proxy(
        fleet,
        ["fm-p1"],
        ("fm-d", victim),
        routing=ROUND_ROBIN,
        outlier={"consecutive_failures": 2, "base_ejection_s": 15.0, "max_ejection_s": 60},
        health={"interval_s": 1.0, "timeout_s": 2.0, "timeouts_to_eject": 1000},
        timeouts={"first_byte_s": 10.0, "stream_idle_s": 30.0, "total_s": REQUEST_S},
        first_token_from_prefill=False,
    ) as running:
        frozen = backend_of(running.state.decode, fleet.url(victim))
        fleet.signal(victim, signal.SIGSTOP)
        try:
            outcomes: list[Outcome] = []
            for i in range(8):  # round robin: the 2nd timeout is the 4th request
                if frozen.ejected_by is not None:
                    break
                answer = send(running.url, body_for(prompts[i % 3], stream=True))
                outcomes.append(answer)
                assert answer.text in (None, refs[i % 3]), f"{answer}\n{hints(fleet)}"
            failed = [a for a in outcomes if a.text is None]
            assert [a.status for a in failed] == [504] * 2, outcomes
            assert all(a.clean for a in failed), failed
            assert ejections(running.url, "outlier", frozen.url) == 1
            for j in range(2):  # out: the other D serves
                answer = send(running.url, body_for(prompts[j], stream=True))
                assert answer.text == refs[j], f"{answer}\n{hints(fleet)}"
        finally:
            fleet.signal(victim, signal.SIGCONT)
        wait_for(lambda: frozen.healthy, "the resumed D readmitted")
        # What it does with the requests the proxy gave up on (their loads fail: P freed the
        # KV at its lease) ends before the count of answers it finished starts.
        victim_url = fleet.url(victim)
        wait_for(lambda: idle(victim_url), "the resumed D done with the abandoned requests")
        served = finished(victim_url)
        for i in range(6):  # round robin: one of the first two goes to it
            answer = send(running.url, body_for(prompts[i % 3], stream=True))
            assert answer.text == refs[i % 3], f"{answer}\n{hints(fleet)}"
            if finished(victim_url) > served:
                break
        else:
            raise AssertionError("the resumed D served none of 6 requests")
    kv_free(fleet)


def test_a_busy_single_p_missing_its_health_checks_still_serves_in_panic(fleet):
    """The issue's case: one P, ejected for health checks that time out (``health_timeout``:
    ``timeout_s`` below any answer time here, and checks 5 s apart, so it stays out), busy with
    a 3,600-token prompt. A request that comes meanwhile is not refused (no 503 ``no healthy
    prefill server available``): the pool is in panic, the soft-ejected P is still a candidate
    (``panic_routes_total{pool="prefill"}`` rises at that request), and both answers are the
    colocated ones."""
    fleet.wait()
    long_prompt = text_prompt(LONG_WORDS, 700)
    short_prompt = text_prompt(200, 701)
    refs = [colocated(fleet, long_prompt), colocated(fleet, short_prompt)]
    health = {"interval_s": 5.0, "timeout_s": PANIC_HEALTH_TIMEOUT_S, "timeouts_to_eject": 1}
    with proxy(fleet, ["fm-p1"], health=health) as running, ThreadPoolExecutor(1) as pool:
        p = running.state.prefill.backends[0]
        assert p.ejected_by == "health_timeout", "P answered its first check within 1 ms"

        def panics() -> float:
            text = fetch_metrics(running.url)
            return metric_sum(text, "splitserve_proxy_panic_routes_total", pool="prefill")

        busy = pool.submit(send, running.url, body_for(long_prompt, stream=True))
        wait_for(lambda: p.outstanding > 0 or busy.done(), "P computing the long prompt")
        before = panics()
        assert before >= 1 and not busy.done(), busy
        assert p.ejected_by == "health_timeout" and p.outstanding > 0, "P no longer out and busy"
        answer = send(running.url, body_for(short_prompt))
        assert answer.text == refs[1], f"{answer}\n{hints(fleet)}"
        assert panics() > before, "the request was not routed in panic"
        long_answer = busy.result(timeout=REQUEST_S + 30)
        assert long_answer.text == refs[0], f"{long_answer}\n{hints(fleet)}"
    kv_free(fleet)
