"""The multi-host test bed (splitserve.launch.testbed): hosts as network namespaces on a bridge.

Real namespaces, real veth links, real TCP between processes started inside the hosts; no
engine. Needs root: where namespaces cannot be made, the fixture fails with the reason.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

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


def test_delay_needs_netem_or_applies(bed):
    """Delay is netem's: applied where the kernel has it, refused with the reason where not."""
    if not tbmod.netem_available():
        with pytest.raises(TestbedError, match="sch_netem"):
            bed.shape("a", LinkShape(delay_ms=50))
        return
    bed.shape("a", LinkShape(delay_ms=50))
    try:
        srv, cli = connect(bed, "b", "a")
        try:
            t0 = time.monotonic()
            assert cli.ask("send 10") == "sent"
            assert srv.ask("recv 10") == "data 10"
            assert srv.ask("send 10") == "sent"
            assert cli.ask("recv 10") == "data 10"
            assert time.monotonic() - t0 > 0.1  # two one-way trips, each 50 ms both ways
        finally:
            srv.close()
            cli.close()
    finally:
        bed.shape("a", None)


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
    code = (
        "import os; from splitserve.launch.testbed import Testbed; "
        "bed = Testbed(['x']); bed.up(); print(bed.switch, bed['x'].netns, flush=True); "
        "os._exit(1)"  # dies without tearing down, as a crash would
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    left = out.stdout.split()
    assert len(left) == 2, out.stderr
    assert set(left) <= set(tbmod.namespaces())
    with Testbed(["y"], owner="stalecheck") as bed:  # not the module bed's owner (its switch)
        assert not set(left) & set(tbmod.namespaces())
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
