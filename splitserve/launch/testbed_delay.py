"""The test bed's delay and jitter where the kernel has no ``sch_netem``: one NFQUEUE delayer
(``splitserve.launch.netdelay``) per shaped host, and the iptables rules that feed it.

Why here and how (``splitserve.launch.testbed``'s docstring says more): the delayers run in the
test bed's switch namespace, where iptables ``mangle`` rules on bridged frames
(``br_netfilter``) send what enters the bridge from a host's port (``PREROUTING``, what the host
sends) and what leaves it to that port (``POSTROUTING``, what it receives) to the host's queue,
number ``index``. A packet held past the veth belongs to the wire, not to its socket's TCP
small-queue budget, which a queue on the host's own ``OUTPUT`` would throttle. The rules carry
``--queue-bypass``: a dead delayer lets frames pass, and ``stop`` reports that it had died, so
the bypass is never silent.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from splitserve.launch import netdelay
from splitserve.launch.process import ManagedProcess, ProcessStartError
from splitserve.launch.testbed_cmd import TestbedError, run

logger = logging.getLogger(__name__)

BRIDGE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"


def iptables() -> str:
    """The iptables binary for the delay rules: the nf_tables one first (``iptables-legacy``
    needs ``CONFIG_NETFILTER_XTABLES_LEGACY``, on its way out of kernels), else legacy."""
    for name in ("iptables-nft", "iptables-legacy", "iptables"):
        found = shutil.which(name) or (Path(f"/usr/sbin/{name}").exists() and f"/usr/sbin/{name}")
        if found:
            return found
    raise TestbedError(
        "delay and jitter without sch_netem need iptables' NFQUEUE target: as root, "
        "apt-get install iptables (scripts/bootstrap.sh does)"
    )


def require() -> None:
    """``TestbedError`` naming what to install when a delayer cannot run here."""
    if importlib.util.find_spec("netfilterqueue") is None:
        raise TestbedError(
            "delay and jitter without sch_netem need the NetfilterQueue package in "
            f"{sys.executable}'s environment: as root, apt-get install libnetfilter-queue-dev, "
            "then pip install NetfilterQueue (the dev extra; make env does both)"
        )
    iptables()


def log_paths(netns: str) -> list[Path]:
    """The delayer logs of the switch namespace ``netns`` (removed with the bed)."""
    return list(Path(tempfile.gettempdir()).glob(f"{netns}-netdelay-*.log"))


def remove_leftovers(netns: str) -> None:
    """Kill every delayer still running in ``netns`` and remove their logs (a crashed or
    earlier process's; ours stop with ``QueueDelayers.stop``)."""
    netdelay.kill_all_in(netns)
    for log in log_paths(netns):
        log.unlink(missing_ok=True)


@dataclass(frozen=True)
class Port:
    """A host's side of the switch: its name (for logs), queue number and switch port."""

    host: str
    index: int
    switch_port: str


class QueueDelayers:
    """The delayers of one test bed's switch namespace ``switch``, one per shaped host."""

    def __init__(self, switch: str, owner: str) -> None:
        self.switch = switch
        self.owner = owner
        self._running: dict[str, ManagedProcess] = {}  # host -> its delayer

    def __contains__(self, host: str) -> bool:
        return host in self._running

    def hosts(self) -> list[str]:
        return list(self._running)

    def _rules(self, port: Port, verb: str) -> list[list[str]]:
        """iptables commands (in the switch) that add (``-A``) or delete (``-D``) the rules
        sending the host's frames both ways to its queue, bypassed while no delayer listens."""
        target = ["-j", "NFQUEUE", "--queue-num", str(port.index), "--queue-bypass"]
        return [
            ["ip", "netns", "exec", self.switch, iptables(), "-w", "-t", "mangle", verb,
             chain, "-m", "physdev", f"--physdev-{side}", port.switch_port, *target]
            for chain, side in (("PREROUTING", "in"), ("POSTROUTING", "out"))
        ]  # fmt: skip

    def start(self, port: Port, delay_ms: float, jitter_ms: float) -> None:
        """Start ``port``'s delayer, then (once its queue is bound) the rules that feed it."""
        binary = iptables()
        proc = run(["ip", "netns", "exec", self.switch, "sh", "-c", f"echo 1 > {BRIDGE_NF}"],
                   check=False)  # fmt: skip
        if proc.returncode != 0:
            raise TestbedError(
                f"delay without sch_netem needs br_netfilter ({BRIDGE_NF}): as root, "
                f"modprobe br_netfilter ({proc.stderr.strip()})"
            )
        argv = [sys.executable, "-m", netdelay.MODULE, "--queue", str(port.index),
                "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms)]  # fmt: skip
        if self.owner.isdigit():  # a pid's bed: the delayer leaves with it (crashes included)
            argv += ["--owner-pid", self.owner]
        log = Path(tempfile.gettempdir()) / f"{self.switch}-netdelay-{port.host}.log"
        log.unlink(missing_ok=True)
        delayer = ManagedProcess(f"netdelay-{port.host}",
                                 ["ip", "netns", "exec", self.switch, *argv], log)  # fmt: skip
        self._running[port.host] = delayer.start()
        try:
            delayer.wait_ready(
                lambda: netdelay.READY in delayer.tail().splitlines(), timeout=60, interval=0.05
            )
            for rule in self._rules(port, "-A"):
                run(rule)
        except (ProcessStartError, TestbedError) as exc:
            with contextlib.suppress(TestbedError):
                self.stop(port)
            raise TestbedError(f"delay on {port.host}'s link ({binary}): {exc}") from exc
        logger.info(
            "test bed: %s's link delayed %g ms +- %g ms (NFQUEUE %d, delayer pid %d)",
            port.host, delay_ms, jitter_ms, port.index, delayer.pid,
        )  # fmt: skip

    def stop(self, port: Port, rules: bool = True) -> None:
        """Remove ``port``'s queue rules (``rules``), then stop its delayer (which accepts what
        it holds). Raises ``TestbedError`` if the delayer had died meanwhile."""
        delayer = self._running.pop(port.host)
        if rules:
            for rule in self._rules(port, "-D"):
                run(rule, check=False)  # absent if the start failed before adding it
        code = delayer.returncode()
        tail = delayer.tail(10)
        delayer.stop(grace=5)
        delayer.log_path.unlink(missing_ok=True)
        if code is not None:
            message = (
                f"the delayer of {port.host}'s link had exited (code {code}) before it was "
                "stopped: since then the link was not delayed (the rules bypass a dead queue); "
                f"its last lines:\n{tail}"
            )
            logger.error("test bed: %s", message)
            raise TestbedError(message)
