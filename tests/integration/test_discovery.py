"""Dynamic pools against real servers: the proxy (its own process, ``splitserve proxy``) finds
its decode servers through a real DNS server (dnsmasq, on loopback; installed by
scripts/bootstrap.sh), or in a pool file it reads again on SIGHUP.

One scenario, run for each source: one D listed; a second D listed (its first passing check
admits it within 2 TTLs plus one check; requests then reach both); the D that carries a long
stream is unlisted (the stream completes, no new request goes to it, it leaves the pool). Greedy
text through the proxy equals a colocated server's throughout.

Servers: the connector tests' pair (``ss_pair``: ``ss-a`` prefills, ``ss-b`` decodes) and a
third server of the pair, ``ss-c``, the second D (deployed as ``splitserve up`` deploys D, with
the adaptive budget, the prefill allowlist and the request guard; test_proxy_decide's and
test_prefill_allowlist's D). The servers all listen on 127.0.0.1, so the DNS names are SRV
records (each server's own port), as a headless Service publishes for a named port; the
A-record path is checked against the same dnsmasq without engines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from metrics_text import fetch_metrics, metric_sum

from splitserve.netutil import free_port, http_ok
from splitserve.proxy.discovery import DnsResolver, ResolveError
from splitserve.proxy.discovery_config import DiscoverySettings, DnsPool

pytestmark = pytest.mark.integration

TTL_S = 2.0
ZONE = "test"
SRV_NAME = f"_http._tcp.decode.{ZONE}"
PROMPTS = [f"the {w} fox jumps over the lazy dog number {i}" for i, w in
           enumerate(["quick", "slow", "red", "tired", "small", "old"])]  # fmt: skip
# The drained stream (ignore_eos: it runs to its length). Its client stops reading after the
# first chunk until the drain has been checked, so the proxy holds it in flight however fast the
# engine is: its bytes (top-20 logprobs in every chunk, ~550 KB: bytes without many tokens to
# generate) are many times what the socket buffers between proxy and client hold (the client's
# receive buffer is pinned small until the drain has been checked).
LONG_TOKENS = 700
LONG_LOGPROBS = 20


def _dnsmasq() -> str:
    path = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    assert os.access(path, os.X_OK), "dnsmasq is missing: run `make env` (scripts/bootstrap.sh)"
    return path


class Dnsmasq:
    """A real DNS server for the zone ``test.`` on 127.0.0.1:``port``. Records are its config;
    a change restarts it (dnsmasq re-reads host files on SIGHUP, not SRV records): a query in
    between fails, and the proxy must keep its pool through that."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(workdir / "dnsmasq.log", "ab")  # noqa: SIM115 - closed in stop()

    def serve(self, srv: list[tuple[str, int]] = (), a: dict[str, list[str]] | None = None) -> None:
        """Answer ``SRV_NAME`` with ``srv`` ((target name, port), each target at 127.0.0.1)
        and every name of ``a`` with its addresses."""
        lines = [f"port={self.port}", "listen-address=127.0.0.1", "bind-interfaces", "no-resolv",
                 "no-hosts", f"local=/{ZONE}/", "local-ttl=1", "log-facility=-"]  # fmt: skip
        for target, port in srv:
            lines += [f"host-record={target},127.0.0.1", f"srv-host={SRV_NAME},{target},{port}"]
        for name, addresses in (a or {}).items():
            lines += [f"host-record={name},{address}" for address in addresses]
        conf = self.workdir / "dnsmasq.conf"
        conf.write_text("\n".join(lines) + "\n")
        self.stop_server()
        self.proc = subprocess.Popen(
            [_dnsmasq(), "-k", "-C", str(conf), "--pid-file"], stdout=self.log, stderr=self.log
        )
        resolver = DnsResolver(DiscoverySettings(nameservers=[f"127.0.0.1:{self.port}"]))
        end = time.monotonic() + 20
        while True:  # answering: a name it does not know is NXDOMAIN (an empty list)
            try:
                asyncio.run(resolver.resolve(DnsPool(name=f"probe.{ZONE}", port=1)))
                return
            except ResolveError:
                assert self.proc.poll() is None, "dnsmasq exited: see dnsmasq.log"
                assert time.monotonic() < end, "dnsmasq did not answer within 20 s"
                time.sleep(0.1)

    def stop_server(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        self.stop_server()
        self.log.close()


@pytest.fixture(scope="module")
def dns(tmp_path_factory) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path_factory.mktemp("dns"))
    try:
        yield server
    finally:
        server.stop()


def test_a_records_nxdomain_and_a_dead_server(dns) -> None:
    """The resolver against the real server, no engines: A records with the pool's port, a
    missing name is an empty pool, a server that does not answer is an error (pool kept)."""
    dns.serve(a={f"pool.{ZONE}": ["127.0.0.2", "127.0.0.3"]})
    settings = DiscoverySettings(nameservers=[f"127.0.0.1:{dns.port}"], timeout_s=1)
    resolver = DnsResolver(settings)
    got = asyncio.run(resolver.resolve(DnsPool(name=f"pool.{ZONE}", port=8200)))
    assert sorted(got) == [("127.0.0.2", 8200), ("127.0.0.3", 8200)]
    assert asyncio.run(resolver.resolve(DnsPool(name=f"gone.{ZONE}", port=1))) == []
    dead = DnsResolver(DiscoverySettings(nameservers=[f"127.0.0.1:{free_port()}"], timeout_s=1))
    with pytest.raises(ResolveError):
        asyncio.run(dead.resolve(DnsPool(name=f"pool.{ZONE}", port=1)))


# ---------------------------------------------------------------------- the real fleet


@pytest.fixture(scope="module")
def fleet(ss_pair, ss_third):
    """(P url, P side port), D1 url, D2 url."""
    return ss_pair["ss-a"], ss_pair["ss-b"][0], ss_third.url


class ProxyProcess:
    """``splitserve -v proxy --config FILE`` in its own process (SIGHUP reaches its loop)."""

    def __init__(self, config: dict, workdir: Path, name: str) -> None:
        self.port = config["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "-v", "proxy", "--config", str(path)],
            stdout=self.log,
            stderr=self.log,
        )
        wait_for(lambda: http_ok(self.url + "/health"), 60, f"proxy {name} up")

    def ready(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def decode_servers(self) -> list[str]:
        return sorted(s["url"] for s in self.ready()["decode"]["servers"])

    def in_flight(self) -> dict[str, int]:
        """Requests the proxy has in flight on each listed decode server."""
        return {s["url"]: s["in_flight"] for s in self.ready()["decode"]["servers"]}

    def metrics(self) -> str:
        return fetch_metrics(self.url)

    def stop(self) -> int:
        """Stop it with SIGINT (its exit status: 0 when it stopped on the signal; killed after
        30 s otherwise); its log's last lines go to the test's output (shown when it fails)."""
        print(f"--- {self.log_path.name} (last lines) ---")
        print("\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:]))
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return self.proc.returncode


def wait_for(cond: Callable[[], bool], bound_s: float, what: str) -> float:
    """Poll ``cond`` until true (returns the seconds waited) or fail after ``bound_s``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < bound_s, f"not within {bound_s:g} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)


def complete(url: str, prompt: str, max_tokens: int = 8, **extra) -> str:
    out = client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return out.choices[0].text


def stream(
    url: str, prompt: str, started: concurrent.futures.Future, release: threading.Event
) -> str:
    """A long greedy stream whose reader stops after the first text until ``release`` is set:
    until then the proxy cannot finish relaying it (backpressure), so it stays in flight."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True, "logprobs": LONG_LOGPROBS}  # fmt: skip
    small = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
    parts = []
    with (
        httpx.Client(transport=httpx.HTTPTransport(socket_options=small), timeout=600) as http,
        http.stream("POST", url + "/v1/completions", json=body) as answer,
    ):
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :]).get("choices") or []
            if choices and choices[0].get("text"):
                parts.append(choices[0]["text"])
                if not started.done():
                    started.set_result(True)
                    assert release.wait(600), "the test never released the stream"
                    _read_fast(answer)
    return "".join(parts)


def _read_fast(answer: httpx.Response) -> None:
    """Let the rest of a held stream in at full speed. Through the pinned 4 KB receive buffer
    the window stays a segment or two wide and the rest arrives in pieces 0.2 s apart (the
    sender's persist timer): 14 s for its ~550 KB alone, over a minute in the loaded suite.
    A bigger buffer alone does not widen the window (its clamp was fixed at the handshake, as was
    the window scale: 64 KB at most), so the clamp is raised too: the rest takes 2-4 s."""
    sock = answer.extensions["network_stream"].get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, 65535)


_REFS: dict[tuple[str, int], str] = {}


def reference(p_url: str, prompt: str, max_tokens: int = 8) -> str:
    """A colocated server's greedy text (P serves it alone), once per prompt and length."""
    if (prompt, max_tokens) not in _REFS:
        extra = {"ignore_eos": True} if max_tokens == LONG_TOKENS else {}
        _REFS[(prompt, max_tokens)] = complete(p_url, prompt, max_tokens, **extra)
    return _REFS[(prompt, max_tokens)]


def served(d_url: str, text: str | None = None) -> float:
    """Requests D finished (its own counter: every request through the proxy reaches D)."""
    return metric_sum(text or fetch_metrics(d_url), "vllm:request_success_total")


def draining(proxy: ProxyProcess) -> float:
    """Decode servers the proxy is draining (unlisted, a request still in flight)."""
    return metric_sum(
        proxy.metrics(), "splitserve_proxy_pool_servers", pool="decode", state="draining"
    )


def changes(proxy: ProxyProcess, change: str) -> float:
    return metric_sum(
        proxy.metrics(), "splitserve_proxy_pool_changes_total", pool="decode", change=change
    )


def _scenario(proxy: ProxyProcess, p_url: str, d1: str, d2: str, list_decode) -> None:
    """The scenario shared by both sources; ``list_decode(urls)`` changes what the source lists."""
    refs = {prompt: reference(p_url, prompt) for prompt in PROMPTS}
    assert proxy.decode_servers() == [d1]
    for prompt in PROMPTS[:2]:
        assert complete(proxy.url, prompt) == refs[prompt], "one D: greedy equals colocated"

    # A second D listed: admitted after its first passing check, then both serve.
    list_decode([d1, d2])
    bound = 2 * TTL_S + 5.0 + 1.0  # 2 TTLs, one check (health.timeout_s), one admission round
    waited = wait_for(lambda: proxy.decode_servers() == sorted([d1, d2]), bound, "D2 admitted")
    before = {d: served(d) for d in (d1, d2)}
    for prompt in PROMPTS:
        assert complete(proxy.url, prompt) == refs[prompt], "two Ds: greedy equals colocated"
    # (an engine's counters follow its answers within a step: a bounded wait, not a sleep)
    wait_for(lambda: all(served(d) > before[d] for d in (d1, d2)), 10, "requests reach both")
    print(f"D2 admitted {waited:.1f} s after it was listed (TTL {TTL_S:g} s)")

    # The D carrying a long stream is unlisted: the stream completes there, nothing new goes
    # to it, and it leaves the pool once the stream is done.
    long_prompt = "a long story about the quick brown fox"
    long_ref = reference(p_url, long_prompt, LONG_TOKENS)
    for attempt in (1, 2):
        if _drain_under_a_stream(proxy, d1, d2, list_decode, refs, long_prompt, long_ref):
            return
        # The stream ended before the proxy showed it in flight (it failed or finished at
        # once): the drain under a stream was not exercised; once more, then a failure.
        assert attempt == 1, "the stream was never seen in flight on one D, twice"


def _drain_under_a_stream(proxy, d1, d2, list_decode, refs, long_prompt, long_ref) -> bool:
    """Unlist the D carrying ``long_prompt``'s stream and check the drain; False when the
    stream ended before it was seen in flight (nothing was checked)."""
    base = {d: served(d) for d in (d1, d2)}
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started: concurrent.futures.Future = concurrent.futures.Future()
        running = pool.submit(stream, proxy.url, long_prompt, started, release)
        try:
            started.result(timeout=300)
            holding: dict[str, int] = {}

            def one_holds() -> bool:
                holding.update(proxy.in_flight())
                return sorted(holding.values()) == [0, 1] or running.done()

            wait_for(one_holds, 30, "the stream in flight on exactly one D")
            if sorted(holding.values()) != [0, 1]:
                release.set()
                print(f"the stream ended before it was seen in flight: {running.exception()!r}")
                return False
            gone = max(holding, key=holding.get)
            kept = d2 if gone == d1 else d1
            list_decode([kept])
            wait_for(lambda: proxy.decode_servers() == [kept], 3 * TTL_S + 2.0, "unlisted D out")
            assert draining(proxy) == 1, "the unlisted D drains while its stream is in flight"
            assert changes(proxy, "removed") == 0, "dropped while its stream runs"
            for prompt in PROMPTS[:3]:
                assert complete(proxy.url, prompt) == refs[prompt], "while draining"
        finally:
            release.set()
        text = running.result(timeout=600)
    assert text == long_ref, "the drained stream's greedy text equals colocated"
    wait_for(lambda: changes(proxy, "removed") == 1, 10, "the drained D leaves the pool")
    wait_for(lambda: served(kept) >= base[kept] + 3, 10, "the three requests counted on kept")
    wait_for(lambda: served(gone) >= base[gone] + 1, 10, "the stream counted on its D")
    assert served(gone) == base[gone] + 1, "only its stream ran there since it began"
    assert served(kept) == base[kept] + 3, "every request while draining went to the kept D"
    return True


def _proxy_config(p_url: str, p_side: int, discovery: dict) -> dict:
    return {
        "port": free_port(),
        "flow": "concurrent",
        "prefill": [{"url": p_url, "side_channel_port": p_side}],
        "routing": {"decode": "round_robin"},
        "health": {"interval_s": 1.0},
        "discovery": {"ttl_s": TTL_S, **discovery},
    }


def test_dns_pool_grows_and_drains(fleet, dns, tmp_path) -> None:
    (p_url, p_side), d1, d2 = fleet
    port = {d: int(d.rsplit(":", 1)[1]) for d in (d1, d2)}
    target = {d1: f"d1.{ZONE}", d2: f"d2.{ZONE}"}

    def list_decode(urls: list[str]) -> None:
        dns.serve(srv=[(target[u], port[u]) for u in urls])

    list_decode([d1])
    config = _proxy_config(p_url, p_side, {
        "decode": {"name": SRV_NAME, "record": "SRV"},
        "nameservers": [f"127.0.0.1:{dns.port}"],
    })  # fmt: skip
    proxy = ProxyProcess(config, tmp_path, "dns-proxy")
    try:
        _scenario(proxy, p_url, d1, d2, list_decode)
    finally:
        stopped = proxy.stop()
    assert stopped == 0, f"the proxy did not stop on SIGINT (exit status {stopped})"


def test_pool_file_reloaded_on_sighup(fleet, tmp_path) -> None:
    (p_url, p_side), d1, d2 = fleet
    pool_file = tmp_path / "pools.yaml"
    proxy: ProxyProcess | None = None

    def list_decode(urls: list[str]) -> None:
        pool_file.write_text(yaml.safe_dump({"decode": [{"url": u} for u in urls]}))
        if proxy is not None:
            proxy.proc.send_signal(signal.SIGHUP)

    list_decode([d1])
    proxy = ProxyProcess(
        _proxy_config(p_url, p_side, {"pool_file": str(pool_file)}), tmp_path, "file-proxy"
    )
    try:
        _scenario(proxy, p_url, d1, d2, list_decode)
        assert "pool file reloaded" in proxy.log_path.read_text()
    finally:
        stopped = proxy.stop()
    assert stopped == 0, f"the proxy did not stop on SIGINT (exit status {stopped})"
