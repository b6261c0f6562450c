"""The multi-host test bed (splitserve.launch.testbed): hosts as network namespaces on a bridge.

Real namespaces, real veth links, real TCP between processes started inside the hosts; no
engine. Needs root: where namespaces cannot be made, the fixture fails with the reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import psutil
import pytest

from splitserve.launch import netdelay, testbed_delay
from splitserve.launch import testbed as tbmod
from splitserve.launch.testbed import LinkShape, Testbed, TestbedError

PORT = 7700

# A TCP end driven line by line on stdin: "send N" writes N bytes, "recv T" waits up to T s for
# data and answers what came ("data N" / "eof" / "reset" / "timeout"), "drain N T" reads N bytes
# and answers the seconds it took. Each command answers one line on stdout.
PEER = r"""
import socket, sys, time
mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "server":
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, port)); ls.listen(1); print("listening", flush=True)
    s, _ = ls.accept()
else:
    s = socket.create_connection((addr, port), timeout=10)
print("connected", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "send":
        s.settimeout(None); s.sendall(b"x" * int(args[0])); print("sent", flush=True)
    elif cmd == "recv":
        s.settimeout(float(args[0]))
        try:
            data = s.recv(1 << 20)
            print(f"data {len(data)}" if data else "eof", flush=True)
        except socket.timeout:
            print("timeout", flush=True)
        except ConnectionResetError:
            print("reset", flush=True)
    elif cmd == "drain":
        s.settimeout(float(args[1])); want = int(args[0]); got = 0; t0 = time.monotonic()
        try:
            while got < want:
                data = s.recv(1 << 20)
                if not data:
                    break
                got += len(data)
        except socket.timeout:
            pass
        print(f"drained {got} {time.monotonic() - t0:.3f}", flush=True)
"""


class Peer:
    """One end of a TCP connection, running inside a test-bed host."""

    def __init__(self, host: tbmod.Host, mode: str, addr: str) -> None:
        self.proc = host.popen(
            [sys.executable, "-c", PEER, mode, addr, str(PORT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self) -> str:
        out = self.proc.stdout.readline().strip()
        if not out:
            raise AssertionError(f"peer ended: {self.proc.stderr.read()}")
        return out

    def tell(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str) -> str:
        self.tell(command)
        return self.line()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def connect(bed: Testbed, server: str, client: str) -> tuple[Peer, Peer]:
    srv = Peer(bed[server], "server", bed[server].address)
    assert srv.line() == "listening"
    cli = Peer(bed[client], "client", bed[server].address)
    assert cli.line() == "connected"
    assert srv.line() == "connected"
    return srv, cli


def root_network() -> tuple[str, str, str]:
    """The machine's own namespace: addresses, routes, links (what the test bed must not touch)."""

    def out(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    return (
        out("ip", "-br", "addr"),
        out("ip", "route", "show", "table", "all"),
        out("ip", "-br", "link"),
    )


@pytest.fixture(scope="module")
def bed():
    before = root_network()
    try:
        tbmod.check()
    except TestbedError as exc:
        pytest.fail(f"the test bed cannot run here: {exc}")
    with Testbed(["a", "b", "c"]) as bed:
        bed.root_before = before
        yield bed
    assert not [ns for ns in tbmod.namespaces() if ns in {bed.switch, bed["a"].netns}]
    mine = ["--owner-pid", str(os.getpid())]
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if netdelay.MODULE in (argv := p.info["cmdline"] or []) and " ".join(mine) in " ".join(argv)
    ]
    assert not left, f"delayers left running: {left}"


def test_hosts_talk_tcp_and_root_namespace_untouched(bed):
    srv, cli = connect(bed, "b", "a")
    try:
        assert cli.ask("send 1000") == "sent"
        assert srv.ask("drain 1000 10").startswith("drained 1000 ")
        assert srv.ask("send 10") == "sent"
        assert cli.ask("recv 10") == "data 10"
    finally:
        srv.close()
        cli.close()
    assert root_network() == bed.root_before
    # No route out: a host reaches nothing but the test bed.
    routes = bed["a"].run(["ip", "route"]).stdout
    assert "default" not in routes and "10.213.0.0/24" in routes


def test_rate_limit_takes_effect(bed):
    bed.shape("a", LinkShape(rate_mbit=4))
    try:
        srv, cli = connect(bed, "b", "a")
        try:
            # 1 MB at 4 Mbit/s is about 2 s; unshaped veth moves it in milliseconds.
            srv.tell("drain 1000000 60")  # reading before the client sends: buffers are small
            assert cli.ask("send 1000000") == "sent"
            got, seconds = srv.line().split()[1:]
            assert int(got) == 1000000
            assert float(seconds) > 1.0, f"1 MB over a 4 Mbit/s link took only {seconds} s"
        finally:
            srv.close()
            cli.close()
    finally:
        bed.shape("a", None)
    assert "tbf" not in bed["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout


def round_trips(bed: Testbed, src: str, dst: str, count: int = 200) -> list[float]:
    """``count`` round trips in ms of a 1-byte TCP echo from ``src`` to ``dst`` (the server a
    thread here, its socket the host's: opened inside it with ``Host.entered``)."""
    with bed[dst].entered():
        server = socket.create_server((bed[dst].address, 0))
    server.settimeout(30)

    def echo() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(4096):
                    conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    samples = []
    try:
        with bed[src].entered():
            client = socket.create_connection((bed[dst].address, server.getsockname()[1]), 10)
        with client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(count):
                t0 = time.perf_counter()
                client.sendall(b"p")
                assert client.recv(16) == b"p"
                samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        server.close()
        thread.join(30)
    return samples


def iqr(samples: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return q3 - q1


def transfer(bed: Testbed, src: str, dst: str, payload: bytes) -> bytes:
    """Send ``payload`` over TCP from ``src`` to ``dst``; what arrived."""
    with bed[dst].entered():
        server = socket.create_server((bed[dst].address, 0))
    server.settimeout(30)
    got = bytearray()

    def sink() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(1 << 20):
                    got.extend(data)

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    try:
        with bed[src].entered():
            client = socket.create_connection((bed[dst].address, server.getsockname()[1]), 10)
        client.settimeout(120)  # the whole send (10 s was only for the connect)
        with client:
            client.sendall(payload)
        thread.join(120)
    finally:
        server.close()
    return bytes(got)


def queue_state(bed: Testbed) -> tuple[dict[int, object], str]:
    """The delayers in the switch and its iptables rules (the delay path without netem)."""
    rules = subprocess.run(
        ["ip", "netns", "exec", bed.switch, testbed_delay.iptables(), "-t", "mangle", "-S"],
        capture_output=True,
        text=True,
    ).stdout
    return netdelay.running_in(bed.switch), rules


def test_delay_and_jitter_add_round_trip_time_then_go(bed):
    """A 5 ms delay on a's link (netem, else the NFQUEUE delayer) adds about 10 ms to a round
    trip from a to b (a's link both ways); jitter (+- 2 ms, normal) widens the spread; after
    ``shape(a, None)`` the delay is gone and so are the delayer and its rules. The bounds are
    loose: an emulator's job is to add delay, so only the lower bound is tight-ish."""
    base = round_trips(bed, "a", "b")
    by_queue = not tbmod.netem_available()
    bed.shape("a", LinkShape(delay_ms=5))
    try:
        if by_queue:
            delayers, rules = queue_state(bed)
            assert len(delayers) == 1 and rules.count("NFQUEUE") == 2, (delayers, rules)
        delayed = round_trips(bed, "a", "b")
        bed.shape("a", LinkShape(delay_ms=5, jitter_ms=2))
        jittered = round_trips(bed, "a", "b", count=400)
    finally:
        bed.shape("a", None)
    after = round_trips(bed, "a", "b")
    added = statistics.median(delayed) - statistics.median(base)
    assert 7.5 <= added <= 20, (added, statistics.median(base))
    added = statistics.median(jittered) - statistics.median(base)
    assert 7.5 <= added <= 20, added
    # Two normal(5, 2) delays per round trip: the IQR of their sum is 1.35 * 2.83 = 3.8 ms.
    assert iqr(jittered) > max(1.5, iqr(delayed)), (iqr(jittered), iqr(delayed))
    assert statistics.median(after) < statistics.median(base) + 2.5, statistics.median(after)
    assert queue_state(bed)[0] == {}
    assert "NFQUEUE" not in queue_state(bed)[1]


def test_delay_composes_with_rate_and_loss_and_bytes_arrive_intact(bed):
    """Rate (tbf), loss (nftables where netem is missing) and delay with jitter at once on a's
    link, and a delay on b's too: 4 MB of random bytes from a to b arrive intact, the round
    trip between the two shaped hosts carries both their delays (4 x 5 ms), and unshaping
    leaves nothing."""
    payload = os.urandom(4 << 20)
    bed.shape("a", LinkShape(rate_mbit=200, delay_ms=5, jitter_ms=2, loss_pct=1))
    bed.shape("b", LinkShape(delay_ms=5))
    try:
        qdisc = bed["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert ("netem" if tbmod.netem_available() else "tbf") in qdisc, qdisc
        got = transfer(bed, "a", "b", payload)
        assert len(got) == len(payload) and got == payload
        base_free = statistics.median(round_trips(bed, "c", "b", count=50))  # b's delay only
        both = statistics.median(round_trips(bed, "a", "b", count=100))
        assert both - base_free >= 7.5, (both, base_free)  # a's link on top of b's
        assert 15 <= both <= 60, both
        if not tbmod.netem_available():
            assert len(queue_state(bed)[0]) == 2
    finally:
        bed.shape("a", None)
        bed.shape("b", None)
    assert queue_state(bed)[0] == {} and "NFQUEUE" not in queue_state(bed)[1]
    assert "tbf" not in bed["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_a_dead_delayer_lets_frames_pass_and_is_reported(bed):
    """Without netem: the rules bypass a queue nobody reads, so when the delayer dies the link
    carries on undelayed (not blackholed), and the next ``shape`` of the host says so."""
    if tbmod.netem_available():
        pytest.skip("this kernel has sch_netem: delay is netem's, there is no delayer to lose")
    bed.shape("a", LinkShape(delay_ms=50))
    try:
        (pid,) = queue_state(bed)[0]
        assert statistics.median(round_trips(bed, "a", "b", count=5)) >= 75
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid in queue_state(bed)[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert statistics.median(round_trips(bed, "a", "b", count=20)) < 50  # passes, undelayed
    finally:
        with pytest.raises(TestbedError, match="had exited"):
            bed.shape("a", None)
    assert queue_state(bed)[0] == {} and "NFQUEUE" not in queue_state(bed)[1]


def test_silent_cut_sends_no_fin_or_rst_and_heals(bed):
    srv, cli = connect(bed, "b", "a")
    try:
        bed.cut("a")
        try:
            # The client's bytes are lost, its end closes nothing: the server sees silence.
            assert cli.ask("send 100") == "sent"
            assert srv.ask("recv 2") == "timeout"
            assert srv.ask("send 100") == "sent"
            assert cli.ask("recv 2") == "timeout"
        finally:
            bed.heal("a")
        # TCP retransmits once the link is back: both sides get the bytes sent during the cut.
        assert srv.ask("drain 100 30").startswith("drained 100 ")
        assert cli.ask("drain 100 30").startswith("drained 100 ")
    finally:
        srv.close()
        cli.close()


def test_stale_namespaces_of_a_crashed_run_are_removed():
    """A run that dies without ``down``: its delayer (a delay on its host, without netem)
    exits with it, and the next ``up`` removes its namespaces."""
    code = (
        "import os; from splitserve.launch.testbed import LinkShape, Testbed; "
        "from splitserve.launch import netdelay; "
        "bed = Testbed(['x']); bed.up(); bed.shape('x', LinkShape(delay_ms=5)); "
        "print(bed.switch, bed['x'].netns, *netdelay.running_in(bed.switch), flush=True); "
        "os._exit(1)"  # dies without tearing down, as a crash would
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    left = out.stdout.split()
    assert len(left) == (2 if tbmod.netem_available() else 3), out.stderr
    for pid in map(int, left[2:]):  # the delayer watches its owner's pidfd: gone at once
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(pid), f"the crashed run's delayer {pid} is still running"
    assert set(left[:2]) <= set(tbmod.namespaces())
    with Testbed(["y"], owner="stalecheck") as bed:  # not the module bed's owner (its switch)
        assert not set(left[:2]) & set(tbmod.namespaces())
        assert bed["y"].netns in tbmod.namespaces()
    assert bed["y"].netns not in tbmod.namespaces()


def test_each_host_has_its_own_host_identity(bed):
    """Two test-bed hosts share a kernel but not a network namespace: the identity in the HELLO
    tells them apart, so the transport between them is tcp, never cma."""
    code = "from splitserve.transfer import strategy; print(strategy.host_identity())"
    ids = {name: bed[name].run([sys.executable, "-c", code]).stdout.strip() for name in "ab"}
    from splitserve.transfer import strategy

    assert len({ids["a"], ids["b"], strategy.host_identity()}) == 3
    assert strategy.transport_to(ids["b"], {}) == "tcp"


def udp_share(bed: Testbed, src: str, dst: str, count: int = 4000) -> float:
    """The share of ``count`` datagrams from ``src`` that reach ``dst`` (sockets opened inside
    the hosts with ``Host.entered``; the receiver's buffer holds them all)."""
    with bed[dst].entered():
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.setsockopt(socket.SOL_SOCKET, 33, 1 << 23)  # SO_RCVBUFFORCE (root): drop nothing
        rx.bind((bed[dst].address, 7701))
    try:
        with bed[src].entered():
            tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(count):
                tx.sendto(b"x" * 64, (bed[dst].address, 7701))
            tx.close()
        rx.settimeout(2.0)  # the end of the burst, not a timed assertion
        got = 0
        with contextlib.suppress(TimeoutError):
            while got < count:
                rx.recv(128)
                got += 1
    finally:
        rx.close()
    return got / count


def test_loss_drops_its_share_without_netem_and_tcp_still_delivers(bed):
    """Loss by netem where the kernel has it, else by nftables on the ingress of both ends of
    the link: 20 % of a's datagrams to b vanish (4000 sent: the share is 0.80 +- 0.05, more
    than 7 standard deviations), and a TCP transfer through 5 % loss both ways arrives whole."""
    assert udp_share(bed, "a", "b") > 0.98  # unshaped: nothing lost
    bed.shape("a", LinkShape(loss_pct=20))
    try:
        share = udp_share(bed, "a", "b")
        assert 0.75 < share < 0.85, share
        assert udp_share(bed, "b", "a") < 0.85  # the other direction too
    finally:
        bed.shape("a", None)
    assert udp_share(bed, "a", "b") > 0.98
    bed.shape("a", LinkShape(loss_pct=5))
    try:
        srv, cli = connect(bed, "b", "a")
        try:
            srv.tell("drain 2000000 120")
            assert cli.ask("send 2000000") == "sent"
            assert srv.line().split()[1] == "2000000"
            assert cli.ask("recv 0.2") == "timeout"  # nothing but what was asked came back
        finally:
            srv.close()
            cli.close()
    finally:
        bed.shape("a", None)


def test_cut_between_two_hosts_leaves_their_other_paths(bed):
    """``cut(a, b)``: a and b no longer hear each other (silently: a SYN times out, no RST),
    while each still reaches c; ``heal(a, b)`` restores the path."""

    def dial(src: str, dst: str) -> str:
        with bed[src].entered():
            try:
                socket.create_connection((bed[dst].address, 7702), timeout=2).close()
                return "connected"
            except ConnectionRefusedError:
                return "refused"  # the host answered: nothing listens there
            except TimeoutError:
                return "silence"

    bed.cut("a", "b")
    try:
        assert dial("a", "b") == "silence" and dial("b", "a") == "silence"
        assert dial("a", "c") == "refused" and dial("b", "c") == "refused"
    finally:
        bed.heal("a", "b")
    assert dial("a", "b") == "refused" and dial("b", "a") == "refused"


def test_entered_moves_only_the_calling_thread():
    own = os.readlink("/proc/thread-self/ns/net")
    with Testbed(["e"], owner="entered") as bed:
        with bed["e"].entered():
            inside = os.readlink("/proc/thread-self/ns/net")
            addrs = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
        assert inside != own
        assert (
            bed["e"].address
            not in subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
        )
    assert os.readlink("/proc/thread-self/ns/net") == own
    # A child started from inside inherits the namespace (the thread's, not the process's).
    assert bed["e"].address in addrs
