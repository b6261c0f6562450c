"""Stock vLLM ``NixlConnector`` and our SGLang transfer backend across hosts (issue #16): P and D
on two test-bed hosts, our proxy and the client on a third, the KV moved between the hosts'
addresses over UCX tcp. ``test_serving_cross_host.py`` does the same for ``SplitserveConnector``.

Layout (one test bed, ``splitserve.launch.testbed``, built once for the module; hosts ``p``,
``d``, ``proxy``), one pair at a time (2 cores; NIXL's progress threads spin):

- SGLang (keys ``xe-sglang-p`` / ``xe-sglang-d``): ``--disaggregation-transfer-backend
  splitserve``, P in mode prefill, D in mode decode, each bound to its host's address
  (``--host``) with ``SGLANG_HOST_IP`` set to it: SGLang's bootstrap server binds ``--host``, P
  registers ``SGLANG_HOST_IP`` with it as its ``rank_ip``, and our backend binds P's side
  channel there (what D dials); D allows only P's address
  (``SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS``). Our proxy (``--engine sglang``) on the proxy
  host. The reference is the session's single SGLang server (``sglang-single``, the command
  line of test_sglang_pd.py and test_sglang_failures.py: same model, same chunk), shared if it
  still runs; it is on loopback outside the test bed, which is fine for a reference (only
  outputs are compared), so its answers are asked for from the tests' own namespace.
- stock NIXL (keys ``xe-nixl-p`` / ``xe-nixl-d``): vLLM with ``NixlConnector`` (``kv_both``,
  ``kv_buffer_device: cpu``), each with ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and ``VLLM_HOST_IP`` set
  to its host's test-bed address, niced (NIXL's progress thread spins a core). Our proxy on
  the proxy host serves them in the flow it uses for a stock connector (``--engine vllm
  --flow sequential``: P prefills with ``do_remote_decode``, its ``kv_transfer_params`` go to
  D unchanged, D reads the KV from P). P is also the colocated reference (a request without
  ``kv_transfer_params``).

Every engine runs with ``Host.ucx_env()`` (UCX over tcp only) and ``UCX_PROTO_INFO=y``: what
UCX picked for the KV's remote memory access is read from the engines' logs (``kv_protocols``)
and must be ``tcp/eth0``; the sockets inside the namespaces (``ss``) show the hosts' addresses,
never 127.0.0.1 or a wildcard. KV usage on P and D returns to what it was before the requests.
No assertion is on speed; waits are bounded, with slack for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import sglang_servers
from metrics_text import fetch_metrics, metric_sum
from session_keys import key_env
from starters import NIXL, NIXL_SPINNER_NICE
from test_fault_matrix import body_for as text_body
from test_fault_matrix import send, text_prompt, wait_for
from test_proxy_vllm import NIXL_EXPIRY_MARKS
from test_transfer_cross_host import kv_protocols

from splitserve.launch import engines
from splitserve.launch import testbed as tbmod
from splitserve.launch.group import ServerGroup
from splitserve.proxy import dispatch
from splitserve.proxy.background import BackgroundProxy
from splitserve.proxy.config import build_config

pytestmark = pytest.mark.integration

VLLM_HTTP = 8000  # every host has its own ports: a fresh namespace has them all free
NIXL_SIDE = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT on each host
SGLANG_HTTP = 8100  # not the NIXL pair's port: no TIME_WAIT of theirs in the way
BOOTSTRAP = 8998  # P's --disaggregation-bootstrap-port
CHUNK = sglang_servers.CHUNK  # as sglang-single (and the loopback pair): the same numerics
MAX_TOKENS = 8
START_TIMEOUT = 600.0
REQUEST_S = 90.0  # the proxy's total_s; test_fault_matrix.send's bound too
KV_BOUND_S = 90.0  # KV back: stock NIXL's 30 s lease, plus slack for a loaded machine
NIXL_KEYS = ("xe-nixl-p", "xe-nixl-d")
SGLANG_KEYS = ("xe-sglang-p", "xe-sglang-d")
SINGLE = sglang_servers.SINGLE


@dataclass
class Bed:
    bed: tbmod.Testbed
    group: ServerGroup
    pairs: dict[tuple[str, ...], BackgroundProxy | None] = field(default_factory=dict)

    def log(self, key: str) -> str:
        path = self.group.servers[key].process.log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_pairs(self) -> None:
        """Stop every pair started on the bed: its proxy, then its servers."""
        for keys, proxy in list(self.pairs.items()):
            if proxy is not None:
                proxy.stop()
            for key in keys:
                server = self.group.servers.pop(key, None)
                if server is not None:
                    server.process.stop()
            del self.pairs[keys]


@pytest.fixture(scope="module")
def bed(servers) -> Iterator[Bed]:
    try:
        tbmod.check()
    except tbmod.TestbedError as exc:
        pytest.fail(f"the test bed cannot run here: {exc}")
    with tbmod.Testbed(["p", "d", "proxy"]) as testbed:
        running = Bed(testbed, servers.group)
        try:
            yield running
        finally:
            running.stop_pairs()  # before the bed goes down


def health(**kw: float) -> dict[str, float]:
    # Engines beside spinning NIXL agents, or SGLang's /health (a generation): be patient.
    return {"interval_s": 1.0, "timeout_s": 30.0, "failures_to_eject": 3} | kw


def timeouts() -> dict[str, float]:
    return {"connect_s": 30.0, "first_byte_s": 90.0, "stream_idle_s": 60.0, "total_s": REQUEST_S}


def established(host: tbmod.Host) -> list[tuple[str, str]]:
    """(local, peer) address:port of the host's established TCP connections."""
    out = host.run(["ss", "-Htn", "state", "established"]).stdout
    return [(f[-2], f[-1]) for f in (line.split() for line in out.splitlines()) if len(f) >= 4]


def listening(host: tbmod.Host, port: int) -> set[str]:
    """The local address:port of every TCP socket of the host listening on ``port``."""
    out = host.run(["ss", "-Hltn", f"sport = :{port}"]).stdout
    return {f[-2] for f in (line.split() for line in out.splitlines()) if len(f) >= 4}


def between(p: tbmod.Host, d: tbmod.Host, but: set[str]) -> list[tuple[str, str]]:
    """Established connections of D with P's address, and of P with D's, other than ``but``
    (P's address:port of a control channel): UCX's tcp connections."""
    out = [(loc, peer) for loc, peer in established(d) if peer.split(":")[0] == p.address]
    out += [(loc, peer) for loc, peer in established(p) if peer.split(":")[0] == d.address]
    return [(loc, peer) for loc, peer in out if loc not in but and peer not in but]


def assert_kv_over_tcp(bed: Bed, keys: tuple[str, ...]) -> None:
    """What UCX picked for the KV's remote memory access: tcp on the test bed's link only."""
    picked = [proto for key in keys for proto in kv_protocols(bed.log(key))]
    assert picked, f"no UCX remote-memory protocol in the logs of {keys}"
    assert all(proto.startswith("tcp/eth0") for proto in picked), picked


# -- SGLang with our transfer backend ------------------------------------------------------------


@dataclass
class SglangBed:
    bed: Bed
    single: str  # the reference's URL, on loopback outside the test bed
    proxy: BackgroundProxy
    baseline: dict[str, int]  # KV tokens in use on P and D before any request

    def url(self, host: str) -> str:
        return f"http://{self.bed.bed[host].address}:{SGLANG_HTTP}"


@pytest.fixture(scope="module")
def sglang(bed: Bed, servers, tiny_model) -> SglangBed:
    """P on host p, D on host d (our backend), our proxy on the proxy host, the session's
    single server as the reference. Another pair on the bed is stopped first."""
    pytest.importorskip("sglang")
    bed.stop_pairs()
    group, model = bed.group, str(tiny_model)
    p_host, d_host = bed.bed["p"], bed.bed["d"]
    # First: protected from the evictions the pair's start makes.
    sglang_servers.start_single(servers, tiny_model)
    bed.pairs[SGLANG_KEYS] = None
    for key, host, mode in (("xe-sglang-p", p_host, "prefill"),
                            ("xe-sglang-d", d_host, "decode")):  # fmt: skip
        env = {
            **host.ucx_env(),
            "UCX_PROTO_INFO": "y",
            # P registers it with its bootstrap server as its rank_ip, and our backend binds
            # (so advertises) P's side channel there; D's own address on D.
            "SGLANG_HOST_IP": host.address,
            **key_env(),
        }
        if mode == "decode":
            env["SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS"] = p_host.address
        cmd = engines.sglang_server(
            model,
            SGLANG_HTTP,
            host=host.address,  # the HTTP server and P's bootstrap server bind it
            mode=mode,
            transfer_backend="splitserve",
            bootstrap_port=BOOTSTRAP if mode == "prefill" else None,
            served_model_name="tiny",
            chunked_prefill_size=CHUNK,
            env=env,
        )
        group.add(key, host.argv(cmd.argv), port=SGLANG_HTTP, host=host.address, env=cmd.env)
    with bed.bed["proxy"].entered():  # probes, the proxy's sockets and threads on its host
        group.wait(START_TIMEOUT, names=list(SGLANG_KEYS), stop_group_on_failure=False)
    group.wait(START_TIMEOUT, names=[SINGLE], stop_group_on_failure=False)  # on loopback
    with bed.bed["proxy"].entered():
        p_url, d_url = group.servers["xe-sglang-p"].url, group.servers["xe-sglang-d"].url
        baseline = {"p": used_tokens(p_url), "d": used_tokens(d_url)}  # before any health check
        config = build_config(
            {
                "host": "127.0.0.1",  # the proxy host's own loopback: the client's
                "port": 0,
                "engine": "sglang",
                "prefill": [{"url": p_url, "bootstrap_port": BOOTSTRAP}],
                "decode": [{"url": d_url}],
                "health": health(),
                "timeouts": timeouts(),
            }
        )
        proxy = BackgroundProxy(config).start()
    bed.pairs[SGLANG_KEYS] = proxy
    return SglangBed(bed, group.servers[SINGLE].url, proxy, baseline)


def used_tokens(url: str) -> int:
    """KV tokens in use (SGLang's ``/v1/loads``: not counting the radix cache's evictable)."""
    with urllib.request.urlopen(url + "/v1/loads?include=core", timeout=30) as resp:
        loads = json.loads(resp.read())["loads"]
    return sum(int(load["num_used_tokens"]) for load in loads)


def ids_prompt(length: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 1000 for i in range(length)]


def ids_body(prompt: list[int], stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def sglang_hints(sg: SglangBed, lines: int = 10) -> str:
    out = []
    for key in SGLANG_KEYS:
        found = [
            line[:240]
            for line in sg.bed.log(key).splitlines()
            if ("WARNING" in line or "ERROR" in line)
            and any(w in line for w in ("splitserve", "transfer", "side channel", "bootstrap"))
        ]
        out.append(f"--- {key}: " + ("\n".join(found[-lines:]) or "(nothing)"))
    return "\n".join(out)


def references(sg: SglangBed, prompts: list[list[int]]) -> list[str]:
    """The single server's greedy answers (asked from the tests' own namespace)."""
    out = []
    for prompt in prompts:
        answer = send(sg.single, ids_body(prompt))
        assert answer.text is not None, answer
        out.append(answer.text)
    return out


def sglang_kv_free(sg: SglangBed) -> None:
    """KV tokens in use on P and D back to their values before any request."""
    for host, baseline in sg.baseline.items():
        url = sg.url(host)
        wait_for(
            lambda url=url, baseline=baseline: used_tokens(url) <= baseline,
            f"{host}: KV tokens in use back to {baseline}\n{sglang_hints(sg)}",
            bound=KV_BOUND_S,
            step=0.5,
        )


def test_sglang_backend_across_hosts_matches_single_server(sglang):
    """Through our proxy (``--engine sglang``): prompts shorter than, equal to and longer than
    the chunk (P chunks the prefill), streamed and not, then four at once; each answer equals
    the single server's; KV freed on both."""
    single = [ids_prompt(n, seed) for seed, n in enumerate((20, CHUNK, 3 * CHUNK + 5, 700))]
    together = [ids_prompt(CHUNK + 10 * i, 100 + i) for i in range(4)]
    refs, together_refs = references(sglang, single), references(sglang, together)
    url = sglang.proxy.url
    with sglang.bed.bed["proxy"].entered():
        for prompt, ref in zip(single, refs, strict=True):
            for stream in (False, True):
                answer = send(url, ids_body(prompt, stream))
                assert answer.text == ref, (
                    f"{len(prompt)} tokens, stream={stream}: {answer}\n{sglang_hints(sglang)}"
                )
        with ThreadPoolExecutor(len(together)) as pool:  # started here: on the proxy's host
            answers = list(pool.map(lambda p: send(url, ids_body(p, stream=True)), together))
        assert [a.text for a in answers] == together_refs, f"{answers}\n{sglang_hints(sglang)}"
        sglang_kv_free(sglang)


SIDE_CHANNEL = re.compile(r"splitserve SGLang backend \(prefill\).*side channel (\S+):(\d+)")


def test_sglang_backend_binds_and_moves_kv_over_the_test_bed(sglang):
    """P's bootstrap server and our backend's side channel listen on P's test-bed address
    only; D's side-channel connection comes from D's address; UCX's connections join the two
    hosts' addresses, and UCX carried the KV over tcp/eth0."""
    p, d = sglang.bed.bed["p"], sglang.bed.bed["d"]
    prompt = ids_prompt(200, 7)
    (ref,) = references(sglang, [prompt])
    with sglang.bed.bed["proxy"].entered():
        answer = send(sglang.proxy.url, ids_body(prompt))
        assert answer.text == ref, f"{answer}\n{sglang_hints(sglang)}"
        sglang_kv_free(sglang)
    found = SIDE_CHANNEL.findall(sglang.bed.log("xe-sglang-p"))
    assert found, "P's backend did not log its side channel"
    host, port = found[-1][0], int(found[-1][1])
    assert host == p.address, found
    assert listening(p, port) == {f"{p.address}:{port}"}  # not 127.0.0.1, not a wildcard
    assert listening(p, BOOTSTRAP) == {f"{p.address}:{BOOTSTRAP}"}
    to_side = [peer for local, peer in established(p) if local == f"{p.address}:{port}"]
    assert any(peer.startswith(f"{d.address}:") for peer in to_side), established(p)
    ucx = between(p, d, but={f"{p.address}:{port}"})
    assert ucx, f"no UCX tcp connection between D and P: {established(d)} / {established(p)}"
    assert_kv_over_tcp(sglang.bed, SGLANG_KEYS)


# -- stock vLLM NixlConnector --------------------------------------------------------------------


@pytest.fixture(scope="module")
def nixl(bed: Bed, tiny_model) -> Bed:
    """The stock pair on hosts p and d, our proxy (sequential flow) on the proxy host. Another
    pair on the bed is stopped first."""
    bed.stop_pairs()
    group = bed.group
    bed.pairs[NIXL_KEYS] = None
    for key, host, core in (("xe-nixl-p", "p", 0), ("xe-nixl-d", "d", 1)):
        h = bed.bed[host]
        cmd = engines.vllm_server(
            str(tiny_model),
            VLLM_HTTP,
            host=h.address,
            served_model_name="tiny",
            kv_transfer_config=NIXL,
            extra_args=["--max-model-len", "2048"],
            cpu_core=core,
            in_process_worker=True,  # as the test pool's servers (tests/server_pool.py)
            env={
                **h.ucx_env(),
                "UCX_PROTO_INFO": "y",
                "VLLM_HOST_IP": h.address,  # no default route: vLLM cannot guess it
                "VLLM_NIXL_SIDE_CHANNEL_HOST": h.address,  # bound, and advertised by P
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE),
            },
        )
        group.add(
            key, h.argv(cmd.argv), port=VLLM_HTTP, host=h.address, env=cmd.env,
            nice=NIXL_SPINNER_NICE,
        )  # fmt: skip
    with bed.bed["proxy"].entered():  # probes, the proxy's sockets and threads on its host
        group.wait(START_TIMEOUT, names=list(NIXL_KEYS), stop_group_on_failure=False)
        config = build_config(
            {
                "host": "127.0.0.1",  # the proxy host's own loopback: the client's
                "port": 0,
                "engine": "vllm",
                "flow": "sequential",  # how the proxy serves a stock connector (its default)
                "prefill": [{"url": group.servers["xe-nixl-p"].url}],
                "decode": [{"url": group.servers["xe-nixl-d"].url}],
                "health": health(),
                "timeouts": timeouts(),
            }
        )
        bed.pairs[NIXL_KEYS] = BackgroundProxy(config).start()
    return bed


def vllm_url(bed: Bed, host: str) -> str:
    return f"http://{bed.bed[host].address}:{VLLM_HTTP}"


def nixl_hints(bed: Bed, lines: int = 10) -> str:
    out = []
    for key in NIXL_KEYS:
        found = [
            line[:240]
            for line in bed.log(key).splitlines()
            if ("WARNING" in line or "ERROR" in line)
            and any(w in line.lower() for w in ("nixl", "kv", "transfer", "handshake"))
        ]
        out.append(f"--- {key}: " + ("\n".join(found[-lines:]) or "(nothing)"))
    expired = [m for m in NIXL_EXPIRY_MARKS if m in bed.log("xe-nixl-p")]
    if expired:
        out.append(f"P's KV lease expired before D read it (a loaded machine): {expired}")
    return "\n".join(out)


def nixl_colocated(bed: Bed, prompt: str) -> str:
    """The reference: P serving the prompt alone (no kv_transfer_params)."""
    answer = send(vllm_url(bed, "p"), text_body(prompt))
    assert answer.text is not None, answer
    return answer.text


def nixl_kv_free(bed: Bed) -> None:
    """KV usage back to 0 on P (D read its blocks and told it) and on D."""
    for host in ("p", "d"):
        url = vllm_url(bed, host)
        wait_for(
            lambda url=url: metric_sum(fetch_metrics(url), "vllm:kv_cache_usage_perc") == 0.0,
            f"{host}: vllm:kv_cache_usage_perc back to 0\n{nixl_hints(bed)}",
            bound=KV_BOUND_S,
            step=0.5,
        )


def test_stock_nixl_across_hosts_matches_colocated(nixl):
    """Through our proxy's sequential flow: streamed and not, prompts shorter and longer than
    a 128-token block, three at once; each answer equals P's colocated one; KV freed."""
    url = nixl.pairs[NIXL_KEYS].url
    with nixl.bed["proxy"].entered():
        for seed, words in ((1, 20), (2, 150), (3, 700)):
            prompt = text_prompt(words, seed)
            ref = nixl_colocated(nixl, prompt)
            for stream in (False, True):
                answer = send(url, text_body(prompt, stream))
                assert answer.text == ref, f"stream={stream}: {answer}\n{nixl_hints(nixl)}"
        prompts = [text_prompt(n, 10 + n) for n in (60, 250, 400)]
        refs = [nixl_colocated(nixl, p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:  # started here: on the proxy's host
            answers = list(pool.map(lambda p: send(url, text_body(p, stream=True)), prompts))
        assert [a.text for a in answers] == refs, f"{answers}\n{nixl_hints(nixl)}"
        nixl_kv_free(nixl)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
        return json.loads(response.read())


def test_stock_nixl_advertises_and_moves_kv_over_the_test_bed(nixl):
    """The sequential flow by hand: P's ``kv_transfer_params`` name its side channel at its
    test-bed address (``VLLM_NIXL_SIDE_CHANNEL_HOST``); D, given them unchanged, reads the KV
    from there (the colocated answer); P's side channel listens on that address only, UCX's
    connections join the two hosts' addresses, and UCX carried the KV over tcp/eth0."""
    p, d = nixl.bed["p"], nixl.bed["d"]
    prompt = text_prompt(300, 50)
    body = text_body(prompt)
    with nixl.bed["proxy"].entered():
        first = post(vllm_url(nixl, "p"), dispatch.vllm_sequential_prefill_request(body))
        params = first["kv_transfer_params"]
        assert (params["remote_host"], params["remote_port"]) == (p.address, NIXL_SIDE), params
        second = post(vllm_url(nixl, "d"), dispatch.vllm_sequential_decode_request(body, first))
        assert second["choices"][0]["text"] == nixl_colocated(nixl, prompt), nixl_hints(nixl)
        nixl_kv_free(nixl)
    assert listening(p, NIXL_SIDE) == {f"{p.address}:{NIXL_SIDE}"}  # not 127.0.0.1, not *
    ucx = between(p, d, but={f"{p.address}:{NIXL_SIDE}"})
    assert ucx, f"no tcp connection between D and P: {established(d)} / {established(p)}"
    assert_kv_over_tcp(nixl, NIXL_KEYS)
