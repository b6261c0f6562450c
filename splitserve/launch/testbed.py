"""Emulated hosts on one machine: Linux network namespaces joined through a bridge.

Why: P, D and the proxy run on different machines in production, where UCX must use a network
transport and links have a rate, a delay and faults. The test bed gives each "host" its own
network namespace (own interfaces, own address, own routing table, own loopback), so servers
started inside it reach each other only over the emulated network.

Layout (all names start with ``ss-tb-``, so stale ones are ours to remove):

- one namespace per host, ``ss-tb-<owner>-<host>``, with ``lo`` and ``eth0``, an address
  ``10.213.0.<n>/24`` and no default route (nothing leaves the test bed);
- one switch namespace, ``ss-tb-<owner>-sw``, holding the bridge ``br0`` and the switch side
  of each host's veth pair (``p<n>``); it has no address at all;
- the machine's own namespace gets nothing: no address, route, bridge or interface (every link
  is created inside the namespaces with ``ip -n``).

``<owner>`` is the pid of the creating process (or a name given by the caller, e.g. ``cli``).
At start, namespaces of owners whose pid is gone are removed (a crashed run leaves no trace
beyond its next start); a named owner's are removed only by ``down`` with that name.

Link shaping (``LinkShape``) is applied on both directions of a host's link: on ``eth0`` in
the host (what it sends) and on ``p<n>`` in the switch (what it receives). A rate alone uses
``tbf``. Delay, jitter and loss use ``netem`` (``sch_netem``) where the kernel has it. Where it
does not (ours: no ``sch_netem``, ``sch_fq`` or ``act_bpf``):

- loss is nftables' (``nft``): a ``numgen random`` drop on the *ingress* hook of both ends of
  the link (``eth0`` in the host: what it receives; ``p<n>`` in the switch: what it sends), so
  a lost frame vanishes on the wire as a real one does (a drop on a host's output hook would
  instead return EPERM to its own TCP stack, which then never counts it as sent);
- delay and jitter are a userspace delayer's (``splitserve.launch.netdelay``, one process per
  shaped host, in the *switch* namespace): iptables rules there (``mangle``, bridged frames
  seen through ``br_netfilter``) send the frames that enter the bridge from ``p<n>`` (what the
  host sends, ``PREROUTING``) and those that leave it to ``p<n>`` (what it receives,
  ``POSTROUTING``) to NFQUEUE number ``n``, whose verdicts the delayer holds back. Two hooks,
  because an accepted packet resumes at the next hook: a frame between two shaped hosts is
  delayed by both, as under netem. In the switch and not on the host's own ``OUTPUT``: a
  packet held there still counts against its socket's TCP small-queue budget (netem orphans
  it), which throttled a 5 ms link to about 1 MB/s; past the veth it is the wire's. The rules
  carry ``--queue-bypass``: if the delayer dies, frames pass undelayed instead of vanishing
  (a dead delayer would otherwise look like a cut); ``shape`` and ``down`` report a delayer
  that died while shaping, so the bypass is never silent. A delayer exits with its bed's
  owning process (a crashed run leaves none); ``down`` and the next ``up`` kill any left in
  a namespace of ours. Limits and measured throughput: docs/environment.md.

A silent cut (``cut``) sets the switch side of the host's veth down: frames from and to the
host are dropped in the kernel, no FIN and no RST reach either end, and ``heal`` brings it
back. ``cut(host, peer)`` cuts only the path between two hosts (an nftables drop of the
frames between their addresses on the switch's ingress of both), each keeping its link to
the others.

A process of the caller's own (a test's HTTP client, an in-process proxy) joins a host with
``Host.entered()``: the calling thread moves into the host's network namespace for the
block (``setns``); threads it starts meanwhile stay there for their life.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``), ``nft``
(Debian's ``nftables``) for loss without netem and for cuts between two hosts, and for delay
without netem ``iptables`` (Debian's, ``iptables-nft`` or ``iptables-legacy``) and the
``NetfilterQueue`` package (the ``dev`` extra; it builds against Debian's
``libnetfilter-queue-dev``); scripts/bootstrap.sh installs them all. ``check`` raises
``TestbedError`` with the reason when namespaces cannot be made, ``shape`` when a tool it
needs is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.launch import netdelay, testbed_delay
from splitserve.launch.process import ManagedProcess
from splitserve.launch.testbed_cmd import TestbedError
from splitserve.launch.testbed_cmd import run as _run
from splitserve.launch.testbed_delay import Port, QueueDelayers

logger = logging.getLogger(__name__)

PREFIX = "ss-tb-"
SUBNET = "10.213.0"  # /24; host n gets SUBNET.(n + 1); exists only inside the namespaces
PREFIX_LEN = 24
_OWNER_RE = re.compile(r"^[a-z0-9]{1,16}$")
_HOST_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class LinkShape:
    """How one host's link behaves, per direction. ``None`` / 0: not limited."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def needs_netem(self) -> bool:
        """Delay or jitter: netem's, else the NFQUEUE delayer's (loss: netem's, else nft's)."""
        return bool(self.delay_ms or self.jitter_ms)


def namespaces() -> list[str]:
    """Network namespace names that exist now (``ip netns list``)."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces of test beds whose owning process is gone; returns their names."""
    removed = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            testbed_delay.remove_leftovers(
                ns
            )  # they leave with their owner; this closes the window
            _run(["ip", "netns", "delete", ns], check=False)
            removed.append(ns)
    if removed:
        logger.info("test bed: removed stale namespaces %s", ", ".join(removed))
    return removed


def check() -> None:
    """Raise ``TestbedError`` saying why network namespaces cannot be made here."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise TestbedError(
                f"`{tool}` is missing: install iproute2 (scripts/bootstrap.sh does, as root)"
            )
    if os.geteuid() != 0:
        raise TestbedError("the test bed needs root (network namespaces, veth, tc); run as root")
    probe = f"{PREFIX}{os.getpid()}-probe"
    proc = _run(["ip", "netns", "add", probe], check=False)
    if proc.returncode != 0:
        raise TestbedError(f"cannot create a network namespace: {proc.stderr.strip()}")
    _run(["ip", "netns", "delete", probe], check=False)


def nft_available() -> bool:
    """Whether the ``nft`` binary is here (the kernel side, nf_tables, is built in on ours)."""
    return shutil.which("nft") is not None or Path("/usr/sbin/nft").exists()


def _nft(netns: str, script: str) -> None:
    if not nft_available():
        raise TestbedError(
            "loss without sch_netem and cuts between two hosts need nftables' `nft`: "
            "as root, apt-get install nftables (scripts/bootstrap.sh does)"
        )
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise TestbedError(f"nft in {netns} failed: {proc.stderr.strip()}\n{script}")


def _ingress_table(table: str, device: str, rules: Sequence[str]) -> str:
    """An nft script that replaces netdev table ``table`` by one ingress chain on ``device``
    holding ``rules`` (no rules: the table is only removed)."""
    script = f"table netdev {table} {{}}\ndelete table netdev {table}\n"
    if rules:
        body = "\n".join(f"    {rule}" for rule in rules)
        script += (
            f"table netdev {table} {{\n  chain ingress {{\n"
            f'    type filter hook ingress device "{device}" priority 0; policy accept;\n'
            f"{body}\n  }}\n}}\n"
        )
    return script


def _loss_rule(loss_pct: float) -> str:
    """Drop ``loss_pct`` % of frames, independently, at a resolution of 0.001 %."""
    return f"numgen random mod 100000 < {round(loss_pct * 1000)} counter drop"


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem`` (delay, jitter, loss); probed on a dummy link."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    _run(["ip", "netns", "add", probe])
    try:
        _run(["ip", "-n", probe, "link", "set", "lo", "up"])
        proc = _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                     "netem", "delay", "1ms"], check=False)  # fmt: skip
        return proc.returncode == 0
    finally:
        _run(["ip", "netns", "delete", probe], check=False)


def _setns(fd: int, what: str) -> None:
    """Move the calling thread into the network namespace ``fd`` names (``setns(2)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise TestbedError(f"{what}: {os.strerror(ctypes.get_errno())}")


@dataclass
class Host:
    """One emulated host: a network namespace with one address on the test bed."""

    name: str
    netns: str
    address: str
    index: int
    switch_port: str  # the switch side of its veth pair (in the switch namespace)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: same pid, same group)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    @contextlib.contextmanager
    def entered(self):
        """Move the calling thread into this host's network namespace for the block: sockets
        it opens meanwhile belong to the host, and so do threads it starts (for their life).
        Back to the thread's own namespace on exit."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            try:
                _setns(target, f"cannot enter {self.netns}")
            finally:
                os.close(target)
            try:
                yield self
            finally:
                _setns(own, f"cannot leave {self.netns}")
        finally:
            os.close(own)

    def ucx_env(self) -> dict[str, str]:
        """The UCX settings of a process on this host: tcp only. The hosts share one kernel,
        so UCX would call a peer on another test-bed host "intra-node" and copy by ``cma``;
        a real separate machine cannot, and neither may the test bed."""
        return {"UCX_TLS": "tcp"}

    def run(
        self, argv: Sequence[str], check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the host and wait for it."""
        return subprocess.run(
            self.argv(argv), capture_output=True, text=True, timeout=timeout, check=check
        )

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start a command inside the host (``subprocess.Popen`` keyword arguments apply)."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def process(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> ManagedProcess:
        """A ``ManagedProcess`` (not started) that runs ``argv`` inside the host."""
        return ManagedProcess(name, self.argv(argv), log_path, env=env, cwd=cwd)


class Testbed:
    """Hosts joined through one bridge (see module docstring). A context manager."""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: Sequence[str], owner: str | None = None) -> None:
        if not hosts:
            raise ValueError("a test bed needs at least one host")
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts (one /24)")
        for host in hosts:
            if not _HOST_RE.match(host):
                raise ValueError(f"host name {host!r}: lowercase letters and digits, ≤ 16")
        if len(set(hosts)) != len(hosts):
            raise ValueError("host names must be unique")
        self.owner = owner if owner is not None else str(os.getpid())
        if not _OWNER_RE.match(self.owner):
            raise ValueError(f"owner {self.owner!r}: lowercase letters and digits, ≤ 16")
        self.switch = f"{PREFIX}{self.owner}-sw"
        self.hosts: dict[str, Host] = {
            name: Host(
                name=name,
                netns=f"{PREFIX}{self.owner}-{name}",
                address=f"{SUBNET}.{i + 1}",
                index=i,
                switch_port=f"p{i}",
            )
            for i, name in enumerate(hosts)
        }
        self._netem: bool | None = None
        self._loss: dict[str, float] = {}  # host -> loss % done by nftables
        self._delays = QueueDelayers(self.switch, self.owner)  # delay without netem
        self._blocked: set[frozenset[str]] = set()  # pairs of hosts cut from each other

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def own_namespaces(self) -> list[str]:
        mine = {self.switch, *(h.netns for h in self.hosts.values())}
        return [ns for ns in namespaces() if ns in mine]

    # -- lifecycle ----------------------------------------------------------------------------

    def up(self) -> Testbed:
        """Build the test bed (stale ones first removed); on failure nothing is left behind."""
        check()
        remove_stale()
        self.down()  # a named owner's leftovers
        self._loss.clear()  # a fresh bed: no nftables state of an earlier one
        self._blocked.clear()
        try:
            _run(["ip", "netns", "add", self.switch])
            _run(["ip", "-n", self.switch, "link", "set", "lo", "up"])
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for host in self.hosts.values():
                ns = host.netns
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", self.switch, "link", "add", host.switch_port, "type", "veth",
                      "peer", "name", "eth0", "netns", ns])  # fmt: skip
                _run(["ip", "-n", self.switch, "link", "set", host.switch_port, "master", "br0"])
                _run(["ip", "-n", self.switch, "link", "set", host.switch_port, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{host.address}/{PREFIX_LEN}",
                      "dev", "eth0"])  # fmt: skip
                _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        except BaseException:
            self.down()
            raise
        logger.info(
            "test bed up: %s",
            ", ".join(f"{h.name}={h.address} ({h.netns})" for h in self.hosts.values()),
        )
        return self

    def down(self) -> None:
        """Delete every namespace of this test bed (its links go with them). Idempotent."""
        for host in self._delays.hosts():
            with contextlib.suppress(TestbedError):  # logged there; the rules go with the ns
                self._delays.stop(self._port(host), rules=False)
        testbed_delay.remove_leftovers(self.switch)  # a named owner's from an earlier process
        for ns in self.own_namespaces():
            # Processes still inside keep a namespace alive only through their own handle;
            # the name goes now and the links with the last user.
            _run(["ip", "netns", "delete", ns], check=False)

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- links --------------------------------------------------------------------------------

    def shape(self, host: str, shape: LinkShape | None) -> None:
        """Shape both directions of ``host``'s link (``None``: unshaped again). Raises
        ``TestbedError`` (after applying ``shape``) if the host's previous delayer had died."""
        h = self.hosts[host]
        wants_netem = shape is not None and (shape.needs_netem() or bool(shape.loss_pct))
        use_netem = wants_netem and self._netem_available()
        by_queue = shape is not None and shape.needs_netem() and not use_netem
        if by_queue:  # what it needs, before anything changes
            testbed_delay.require()
        died = None
        if host in self._delays:
            try:
                self._delays.stop(self._port(host))
            except TestbedError as exc:
                died = exc
        for ns, dev in ((h.netns, "eth0"), (self.switch, h.switch_port)):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                 check=False)  # fmt: skip
            if shape is None or (shape.rate_mbit is None and not use_netem):
                continue
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                  *self._qdisc(shape, use_netem)])  # fmt: skip
        loss = shape.loss_pct if shape is not None and not use_netem else 0.0
        if loss or self._loss.get(host):
            self._loss[host] = loss
            self._apply_filters(host)
        if by_queue:
            self._delays.start(self._port(host), shape.delay_ms, shape.jitter_ms)  # type: ignore[union-attr]
        if died is not None:
            raise died

    def _port(self, host: str) -> Port:
        h = self.hosts[host]
        return Port(host=h.name, index=h.index, switch_port=h.switch_port)

    def _netem_available(self) -> bool:
        if self._netem is None:
            self._netem = netem_available()
        return self._netem

    def _qdisc(self, shape: LinkShape, use_netem: bool) -> list[str]:
        if use_netem:
            args = ["netem", "limit", "100000"]
            if shape.delay_ms or shape.jitter_ms:
                args += ["delay", f"{shape.delay_ms}ms"]
                if shape.jitter_ms:
                    args += [f"{shape.jitter_ms}ms", "distribution", "normal"]
            if shape.loss_pct:
                args += ["loss", f"{shape.loss_pct}%"]
            if shape.rate_mbit is not None:
                args += ["rate", f"{shape.rate_mbit}mbit"]
            return args
        rate_bytes = shape.rate_mbit * 1e6 / 8  # type: ignore[operator]
        # Burst: 10 ms worth, at least 64 KiB (a GSO super-packet must fit or tbf drops it).
        burst = max(65536, int(rate_bytes / 100))
        # Queue: 200 ms worth, at least 4 bursts (tbf drops what does not fit; TCP backs off).
        limit = max(4 * burst, int(rate_bytes / 5))
        return ["tbf", "rate", f"{shape.rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]

    def _apply_filters(self, host: str) -> None:
        """Write ``host``'s nftables state: its loss on both ingress ends of its link, and the
        drop of frames it sends to the hosts it is cut from (on the switch's ingress)."""
        h = self.hosts[host]
        loss = self._loss.get(host, 0.0)
        peers = sorted(
            self.hosts[other].address
            for pair in self._blocked
            if host in pair
            for other in pair - {host}
        )
        switch_rules = [f"ip daddr {{ {', '.join(peers)} }} drop"] if peers else []
        if loss:
            switch_rules.append(_loss_rule(loss))
        _nft(self.switch, _ingress_table(f"ss_{h.switch_port}", h.switch_port, switch_rules))
        _nft(h.netns, _ingress_table("ss_loss", "eth0", [_loss_rule(loss)] if loss else []))

    def cut(self, host: str, peer: str | None = None) -> None:
        """Cut ``host``'s link silently: frames are dropped both ways, nothing is signalled.
        With ``peer``, only the frames between the two hosts (each keeps its other paths)."""
        h = self.hosts[host]
        if peer is None:
            _run(["ip", "-n", self.switch, "link", "set", h.switch_port, "down"])
            return
        if peer == host or peer not in self.hosts:
            raise ValueError(f"cut {host!r} from {peer!r}: another host of this bed")
        self._blocked.add(frozenset((host, peer)))
        self._apply_filters(host)
        self._apply_filters(peer)

    def heal(self, host: str, peer: str | None = None) -> None:
        """Undo ``cut`` (with the same ``peer``)."""
        h = self.hosts[host]
        if peer is None:
            _run(["ip", "-n", self.switch, "link", "set", h.switch_port, "up"])
            return
        self._blocked.discard(frozenset((host, peer)))
        self._apply_filters(host)
        self._apply_filters(peer)

    def status(self) -> list[str]:
        """One line per host: namespace, address, link state, qdisc."""
        lines = []
        for h in self.hosts.values():
            if h.netns not in namespaces():
                lines.append(f"{h.name}: absent")
                continue
            state = _run(["ip", "-n", self.switch, "-br", "link", "show", h.switch_port],
                         check=False).stdout.split()  # fmt: skip
            qdisc = _run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "show", "dev", "eth0"],
                         check=False).stdout.strip()  # fmt: skip
            link = state[1] if len(state) > 1 else "?"
            first = qdisc.splitlines()[0] if qdisc else "-"
            line = f"{h.name}: {h.address} netns={h.netns} link={link} qdisc={first}"
            for pid, options in netdelay.running_in(self.switch).items():
                if options.queue == h.index:
                    line += f" delay={options.delay_ms:g}+-{options.jitter_ms:g}ms (pid {pid})"
            lines.append(line)
        return lines


@contextlib.contextmanager
def open_testbed(hosts: Sequence[str], owner: str | None = None):
    """``with open_testbed(["p", "d"]) as tb: tb["p"].popen([...])``; torn down on exit."""
    bed = Testbed(hosts, owner=owner)
    with bed:
        yield bed
