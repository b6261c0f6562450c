"""Real engines across hosts (issue #16): P and D on two test-bed hosts, the proxy and the
client on a third, KV moved between hosts by the transfer layer over UCX tcp.

Layout (one test bed, ``splitserve.launch.testbed``, built once for the module):

- host ``p``: vLLM with ``SplitserveConnector`` (``kv_both``), its side channel bound to and
  advertised on the host's test-bed address (``side_channel_host``), never 127.0.0.1; P is
  also the colocated reference (a request without ``kv_transfer_params``);
- host ``d``: the same server, the decode side; it dials P's test-bed address (the address the
  proxy passes on: the host of P's URL);
- host ``proxy``: two in-process proxies (``BackgroundProxy``, started from a thread inside
  the host's namespace, so their sockets are the host's): the concurrent flow without and with
  the first token from P; the tests' HTTP client runs there too (``Host.entered``), and
  drives the sequential flow by hand (P's answer names its side channel, D dials it).

Every engine runs with ``Host.ucx_env()`` (UCX over tcp only: between namespaces of one kernel
UCX would otherwise copy by cma, which separate machines cannot). The servers run under the
session's pool (keys ``xh-p`` / ``xh-d``), started once and stopped at the module's end, before
the bed goes down.

The faults (docs/connector-protocol.md, "Failure matrix"; docs/proxy.md, "Faults"): 1 % loss
on P's and D's links, then 1 % loss with 5 ms +- 5 ms of delay on both (outputs equal
colocated, no leak), a silent cut of the P-D path in the
middle of a transfer (the request ends within D's ``liveness_timeout_s`` plus slack, blocks
freed on both within the lease, the next request correct once healed), and the proxy's host
cut from D (the proxy ejects D; requests end with a clean error, the service returns on heal).
Bounds carry slack for this loaded 2-core machine; no assertion is on speed.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from completion_client import Outcome
from fault_fleet import FAULT_MODEL
from metrics_text import fetch_metrics, metric_sum
from session_keys import key_env
from session_keys import test_key_file as key_file
from test_fault_matrix import body_for, send, text_prompt, wait_for
from test_testbed import round_trips
from test_transfer_cross_host import kv_protocols

from splitserve.launch import engines, netdelay
from splitserve.launch import testbed as tbmod
from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec
from splitserve.proxy import dispatch
from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

pytestmark = pytest.mark.integration

HTTP_PORT = 8000  # every host has its own ports: a fresh namespace has them all free
SIDE_PORT = 5701
LEASE_S = 8.0
LIVENESS_S = 5.0  # the side channel's liveness_timeout_s (documented default)
SLACK_S = 30.0  # added to every documented bound: a loaded 2-core machine
START_TIMEOUT = 420.0
REQUEST_S = 90.0
LONG_WORDS = 1650  # about 3,600 tokens: P prefills for seconds (the wider model)
KEYS = ("xh-p", "xh-d", "xh-d2")
HOSTS = {"xh-p": ("p", 0), "xh-d": ("d", 1), "xh-d2": ("d2", 1)}  # key: (host, core)


def kv_config(address: str) -> dict[str, Any]:
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "side_channel_host": address,  # bound and advertised: what D dials
            "side_channel_port": SIDE_PORT,
            "auth_key_file": key_file(),
            "lease_s": LEASE_S,
            "done_timeout_s": 60,
        },
    }


@dataclass
class CrossHost:
    bed: tbmod.Testbed
    group: ServerGroup
    proxies: dict[str, BackgroundProxy] = field(default_factory=dict)

    def url(self, host: str) -> str:
        return f"http://{self.bed[host].address}:{HTTP_PORT}"

    def log(self, key: str) -> str:
        path = self.group.servers[key].process.log_path
        return path.read_text(errors="replace") if path.exists() else ""


def proxy_config(xh: CrossHost, first_token: bool, decode: tuple[str, ...] = ("d",)):
    return build_config(
        {
            "host": "127.0.0.1",  # the proxy host's own loopback: its client is there too
            "port": 0,
            "flow": "concurrent",
            "first_token_from_prefill": first_token,
            "prefill": [{"url": xh.url("p"), "side_channel_port": SIDE_PORT}],
            "decode": [{"url": xh.url(host)} for host in decode],
            "health": {"interval_s": 1.0, "timeout_s": 2.0},
            "timeouts": {
                "connect_s": 3.0,
                "first_byte_s": 30.0,
                "stream_idle_s": 20.0,
                "total_s": REQUEST_S,
            },
        }
    )


@pytest.fixture(scope="module")
def xh(servers, tmp_path_factory) -> Iterator[CrossHost]:
    try:
        tbmod.check()
    except tbmod.TestbedError as exc:
        pytest.fail(f"the test bed cannot run here: {exc}")
    model = build_model(resolve_spec("tiny", **FAULT_MODEL), tmp_path_factory.mktemp("xhost"))
    extra = ["--max-model-len", "4096", "--max-num-batched-tokens", "512"]
    with tbmod.Testbed(["p", "d", "d2", "proxy"]) as bed, contextlib.ExitStack() as stack:
        running = CrossHost(bed, servers.group)
        try:
            for key, (host, core) in HOSTS.items():
                address = bed[host].address
                cmd = engines.vllm_server(
                    str(model),
                    HTTP_PORT,
                    host=address,
                    served_model_name="tiny",
                    kv_transfer_config=kv_config(address),
                    extra_args=extra,
                    cpu_core=core,
                    in_process_worker=True,  # as the test pool's servers (tests/server_pool.py)
                    env={
                        **bed[host].ucx_env(),
                        "UCX_PROTO_INFO": "y",
                        "VLLM_HOST_IP": address,  # no default route: vLLM cannot guess it
                        **key_env(),
                    },
                )
                servers.group.add(
                    key, bed[host].argv(cmd.argv), port=HTTP_PORT, host=address, env=cmd.env
                )
            with bed["proxy"].entered():  # probes from the proxy's host
                servers.group.wait(START_TIMEOUT, names=list(KEYS), stop_group_on_failure=False)
                for name, first_token, decode in (
                    ("plain", False, ("d",)),
                    ("first-token", True, ("d",)),
                    ("two-d", False, ("d", "d2")),  # a second pair to retry on
                ):
                    proxy = BackgroundProxy(proxy_config(running, first_token, decode))
                    running.proxies[name] = stack.enter_context(proxy)
            yield running
        finally:
            stack.close()
            for key in KEYS:
                server = servers.group.servers.pop(key, None)
                if server is not None:
                    server.process.stop()


@pytest.fixture(autouse=True)
def on_proxy_host(xh) -> Iterator[None]:
    """Each test's client (and the threads it starts) runs on the proxy's host."""
    with xh.bed["proxy"].entered():
        yield


# -- helpers -------------------------------------------------------------------------------------


def colocated(xh: CrossHost, prompt: str) -> str:
    """The reference: P serving the prompt alone (no kv_transfer_params)."""
    answer = send(xh.url("p"), body_for(prompt))
    assert answer.text is not None, answer
    return answer.text


def kv_usage(xh: CrossHost, host: str) -> float:
    return metric_sum(fetch_metrics(xh.url(host)), "vllm:kv_cache_usage_perc")


def kv_free(xh: CrossHost, hosts: tuple[str, ...] = ("p", "d")) -> None:
    """KV usage back to 0 on P and D within the lease (plus slack)."""
    bound = LEASE_S + SLACK_S
    for host in hosts:
        wait_for(
            lambda host=host: kv_usage(xh, host) == 0.0,
            f"{host}: KV cache usage back to 0",
            bound=bound,
            step=0.5,
        )


def hints(xh: CrossHost, lines: int = 12) -> str:
    out = []
    for key in KEYS:
        found = [
            line[:240]
            for line in xh.log(key).splitlines()
            if ("WARNING" in line or "ERROR" in line)
            and any(w in line for w in ("side channel", "KV load", "transfer", "sender"))
        ]
        out.append(f"--- {key}: " + ("\n".join(found[-lines:]) or "(nothing)"))
    return "\n".join(out)


def serve_and_compare(xh: CrossHost, proxy: str, seeds: range, words: int = 300) -> None:
    """Streamed and not, through ``proxy``: each answer equals the colocated one."""
    url = xh.proxies[proxy].url
    for seed in seeds:
        prompt = text_prompt(words, seed)
        ref = colocated(xh, prompt)
        for stream in (False, True):
            answer = send(url, body_for(prompt, stream))
            assert answer.text == ref, f"{proxy} stream={stream}: {answer}\n{hints(xh)}"


def established(host: tbmod.Host) -> list[tuple[str, str]]:
    """(local, peer) address:port of the host's established TCP connections."""
    out = host.run(["ss", "-Htn", "state", "established"]).stdout
    return [(f[-2], f[-1]) for f in (line.split() for line in out.splitlines()) if len(f) >= 4]


# -- serving -------------------------------------------------------------------------------------


def test_concurrent_flow_across_hosts_matches_colocated(xh):
    serve_and_compare(xh, "plain", range(100, 102))
    serve_and_compare(xh, "plain", range(110, 111), words=1300)  # chunked on P

    prompts = [text_prompt(n, 120 + n) for n in (40, 200, 333, 600)]
    refs = [colocated(xh, p) for p in prompts]
    url = xh.proxies["plain"].url
    with ThreadPoolExecutor(len(prompts)) as pool:  # threads start here: on the proxy's host
        answers = list(pool.map(lambda p: send(url, body_for(p, stream=True)), prompts))
    assert [a.text for a in answers] == refs, f"{answers}\n{hints(xh)}"
    kv_free(xh)


def test_first_token_flow_across_hosts_matches_colocated(xh):
    serve_and_compare(xh, "first-token", range(200, 203))
    prompt = text_prompt(120, 210)
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
    }
    import openai

    def ask(url: str) -> str:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=REQUEST_S, max_retries=0)
        return client.chat.completions.create(**chat).choices[0].message.content

    assert ask(xh.proxies["first-token"].url) == ask(xh.url("p"))
    kv_free(xh)


def test_side_channel_and_kv_use_the_test_bed_addresses(xh):
    """P's side channel listens on P's test-bed address (not 127.0.0.1), D's connection to it
    comes from D's address, and the KV's UCX connection joins the two addresses over tcp."""
    p, d = xh.bed["p"], xh.bed["d"]
    assert send(xh.proxies["plain"].url, body_for(text_prompt(200, 300))).text is not None
    listening = p.run(["ss", "-Hltn", f"sport = :{SIDE_PORT}"]).stdout
    assert f"{p.address}:{SIDE_PORT}" in listening, listening
    assert "127.0.0.1" not in listening
    to_side = [peer for local, peer in established(p) if local == f"{p.address}:{SIDE_PORT}"]
    assert any(peer.startswith(f"{d.address}:") for peer in to_side), established(p)
    ucx = [
        (local, peer)
        for local, peer in established(d)
        if peer.split(":")[0] == p.address and peer != f"{p.address}:{SIDE_PORT}"
    ]
    assert ucx, f"no UCX tcp connection between D and P: {established(d)}"
    # What UCX picked for the KV's remote memory access (its proto info, in the engines' logs).
    picked = kv_protocols(xh.log("xh-p")) + kv_protocols(xh.log("xh-d"))
    assert picked and all(proto.startswith("tcp/eth0") for proto in picked), picked


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
        return json.loads(response.read())


def test_sequential_flow_dials_the_address_p_advertises(xh):
    """The sequential flow by hand: P answers with ``kv_transfer_params`` naming its side
    channel at its test-bed address (what ``side_channel_host`` binds is what P advertises),
    and D, given them unchanged, loads the KV from there: the colocated answer."""
    prompt = text_prompt(300, 350)
    body = body_for(prompt)
    tid = "xh-sequential-1"
    first = post(xh.url("p"), dispatch.vllm_sequential_prefill_request(body, tid))
    params = first["kv_transfer_params"]
    assert (params["remote_host"], params["remote_port"]) == (xh.bed["p"].address, SIDE_PORT)
    second = post(xh.url("d"), dispatch.vllm_sequential_decode_request(body, first, tid))
    assert second["choices"][0]["text"] == colocated(xh, prompt), hints(xh)
    kv_free(xh)


def test_outputs_equal_colocated_under_one_percent_loss(xh):
    """1 % of frames lost both ways on P's and D's links (netem where the kernel has it, else
    nftables): TCP recovers, every answer equals colocated, nothing leaks."""
    loss = tbmod.LinkShape(loss_pct=1.0)
    for host in ("p", "d"):
        xh.bed.shape(host, loss)
    try:
        serve_and_compare(xh, "plain", range(400, 402), words=600)
        serve_and_compare(xh, "first-token", range(410, 412), words=600)
        kv_free(xh)
    finally:
        for host in ("p", "d"):
            xh.bed.shape(host, None)


def test_outputs_equal_colocated_under_loss_and_jitter(xh):
    """Issue #16's "1 % loss and 5 ms jitter on the P-D link": P's and D's links each lose 1 %
    of frames and delay the rest 5 ms +- 5 ms (normal, so packets overtake each other; netem
    where the kernel has it, else the NFQUEUE delayer). A P-D frame crosses both links, so the
    round trip between them gains about 20 ms (checked: the shape is in force). TCP recovers
    from the loss and the reordering, every answer equals colocated, nothing leaks, and
    unshaping leaves no delayer behind."""
    shape = tbmod.LinkShape(delay_ms=5.0, jitter_ms=5.0, loss_pct=1.0)
    for host in ("p", "d"):
        xh.bed.shape(host, shape)
    try:
        rtt = statistics.median(round_trips(xh.bed, "d", "p", count=40))
        assert rtt >= 15, f"P-D round trip {rtt:.1f} ms: the delay is not in force"
        serve_and_compare(xh, "plain", range(420, 422), words=600)
        serve_and_compare(xh, "first-token", range(430, 431), words=600)
        kv_free(xh)
    finally:
        for host in ("p", "d"):
            xh.bed.shape(host, None)
    assert netdelay.running_in(xh.bed.switch) == {}


# -- faults --------------------------------------------------------------------------------------


def wait_in_prefill(proxy: BackgroundProxy) -> None:
    """Until the proxy has the request in flight on P (P computes it, D has it), a little
    longer, so that the fault lands mid-transfer; fails if P answered meanwhile."""
    backend = proxy.state.prefill.backends[0]
    wait_for(lambda: backend.outstanding > 0, "P computing the request", bound=REQUEST_S)
    time.sleep(0.5)
    assert backend.outstanding > 0, "P answered before the cut: the prompt is too short"


def test_silent_cut_of_the_p_d_path_mid_transfer(xh):
    """P and D stop hearing each other (no FIN, no RST) while P streams a long prompt's KV:
    D's load fails on the side channel's heartbeats (``liveness_timeout_s``), the client gets a
    clean error (or the colocated answer), both free the request's blocks within the lease,
    and once the path is back the next request is served across hosts again."""
    proxy = xh.proxies["plain"]
    prompt = text_prompt(LONG_WORDS, 500)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(send, proxy.url, body_for(prompt, stream=True))
        wait_in_prefill(proxy)
        xh.bed.cut("p", "d")
        cut_at = time.monotonic()
        try:
            answer: Outcome = future.result(timeout=REQUEST_S + SLACK_S)
            ended_after = time.monotonic() - cut_at
            assert answer.clean, answer
            assert ended_after < LIVENESS_S + SLACK_S, (ended_after, answer, hints(xh))
            kv_free(xh)  # while still cut: P's stalled posts end at the lease, D's at once
        finally:
            xh.bed.heal("p", "d")
    if answer.text is not None:
        assert answer.text == colocated(xh, prompt)
    serve_and_compare(xh, "plain", range(510, 511))
    kv_free(xh)


def test_proxy_host_cut_from_d(xh):
    """The proxy's host loses D silently (issue #16: "the proxy ejects D, retries on another
    pair before the first byte"). Through the proxy with a second D (``two-d``), every request
    is answered correctly: an attempt on the cut D fails to connect before anything reached the
    client and is retried on the other pair (``splitserve_proxy_retries_total`` rises), and the
    cut D is ejected. Through the proxy whose only D is cut (``plain``), a request ends with a
    clean error within the proxy's bounds (no pair to retry on), D is ejected and the next
    request is refused at once with a clean error. P (and D2) free what they held within the
    lease; once healed, D is readmitted by both proxies and serves again."""
    plain, two = xh.proxies["plain"], xh.proxies["two-d"]
    cut_d = [b for p in (plain, two) for b in p.state.decode.backends if b.url == xh.url("d")]
    assert len(cut_d) == 2 and all(b.healthy for b in cut_d)
    retries_before = metric_sum(fetch_metrics(two.url), "splitserve_proxy_retries_total")
    xh.bed.cut("proxy", "d")
    try:
        for seed in range(600, 604):  # least-loaded routing sends some of these to the cut D
            prompt = text_prompt(300, seed)
            assert send(two.url, body_for(prompt)).text == colocated(xh, prompt), hints(xh)
        wait_for(lambda: not cut_d[1].healthy, "the two-D proxy ejects D", bound=SLACK_S)
        retried = metric_sum(fetch_metrics(two.url), "splitserve_proxy_retries_total")
        assert retried > retries_before, "no attempt on the cut D was retried on the other pair"

        answer = send(plain.url, body_for(text_prompt(300, 610)))
        assert answer.clean and answer.text is None, answer
        wait_for(lambda: not cut_d[0].healthy, "the one-D proxy ejects D", bound=SLACK_S)
        refused = send(plain.url, body_for(text_prompt(300, 611)))
        assert refused.error is not None and '"error"' in refused.error, refused
        assert refused.status in (502, 503, 504), refused
        kv_free(xh, ("p", "d2"))  # D is out of the client's reach until healed
    finally:
        xh.bed.heal("proxy", "d")
    for backend in cut_d:
        wait_for(lambda b=backend: b.healthy, "D readmitted", bound=300.0, step=0.5)
    serve_and_compare(xh, "plain", range(620, 621))
    kv_free(xh, ("p", "d", "d2"))
