"""What every part of the test bed shares: its error and how it runs a network command.

Why a module of its own: the test bed (``splitserve.launch.testbed``) and its delay without
netem (``splitserve.launch.testbed_delay``) both run ``ip``/``tc``/``iptables`` commands and
raise the same error; neither may import the other's internals.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


class TestbedError(RuntimeError):
    """The test bed cannot be built or changed here; the message says why and what to do."""

    __test__ = False  # not a pytest test class


def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command (30 s bound); ``TestbedError`` with its stderr when it fails."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc
