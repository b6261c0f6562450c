"""The test session's server pool (the ``servers`` fixture of tests/conftest.py): real servers
started once and shared by key, a bound on how many run at once, and the start-ahead that
starts the next modules' servers while earlier tests leave CPU idle. In a module of its own so
that unit tests of it import it by a name no other module has (every test folder has a
``conftest``)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from splitserve.launch.engines import tensor_parallel_size
from splitserve.launch.group import Server, ServerGroup
from splitserve.launch.process import ProcessStartError, set_session_nice
from splitserve.netutil import free_port, free_port_run

logger = logging.getLogger(__name__)

# Bound on one server's start-up. Two servers side by side on 2 cores take about 2 minutes.
SERVER_START_TIMEOUT = float(os.environ.get("SPLITSERVE_TEST_SERVER_TIMEOUT", "420"))
# Processes kept running at once; the least recently used are stopped first (and restarted if a
# later test asks for them again). Each CPU vLLM server holds about 2.5 GiB (1 GiB of KV cache),
# so a whole session's servers would not fit in 24 GiB together.
MAX_RUNNING_SERVERS = int(os.environ.get("SPLITSERVE_TEST_MAX_SERVERS", "4"))
# Starts per server before a test errors: a server that dies or hangs at start-up (a port taken
# between choosing and binding it, a transient failure under load) is started once more, on a
# fresh HTTP port, before its tests are reported as errors.
SERVER_START_ATTEMPTS = 2
# The priority of a server's session while it starts ahead of its module: the lowest, so that it
# runs only on CPU the running tests leave idle (docs/environment.md, "Test harness").
AHEAD_NICE = 19


class ServerPool:
    """Session-wide cache of running servers, keyed by what the test asks for."""

    def __init__(self, group: ServerGroup) -> None:
        self._group = group
        self._specs: dict[str, dict[str, Any]] = {}  # how each key was started, for a retry
        # The pool's state is shared by the test thread and the start-ahead thread.
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[tuple[str, Callable[[], Sequence[str]]]] = []  # (module, starter)
        self._claimed: set[str] = set()  # modules that began: their servers are no longer ahead
        self._ahead_keys: dict[str, list[str]] = {}  # module -> its servers started ahead
        self._ahead: threading.Thread | None = None
        self._cancel_ahead = threading.Event()

    @property
    def group(self) -> ServerGroup:
        return self._group

    def start_ahead(self, module: str, starters: Sequence[Callable[[], Sequence[str]]]) -> None:
        """Start the servers of ``module`` (each starter starts some with ``wait=False`` and
        returns their keys) on a background thread, one starter at a time, while the tests of
        an earlier module run. Each waits until the servers of the one before are ready (or
        failed, or ``SERVER_START_TIMEOUT`` passed), so that the first needed is the first
        ready.

        They start at the lowest priority (``AHEAD_NICE``, the priority of their whole
        session): they take only the CPU that the running tests leave idle, and so cannot
        slow a test that measures a timeout or races a lease. ``claim(module)`` gives them
        their own priority back when their module begins. A server that failed to start
        ahead is started again by the module that asks for it, as any failed start is."""
        with self._wake:
            self._pending.extend((module, starter) for starter in starters)
            self._wake.notify()
            if self._ahead is None:
                self._ahead = threading.Thread(target=self._run_ahead, name="start-ahead")
                self._ahead.daemon = True
                self._ahead.start()

    def claim(self, module: str) -> None:
        """``module`` begins: the starters queued for it are dropped (its fixtures start what
        it needs themselves, finding running whatever was started ahead), and its servers
        started ahead get their own priority back. One whose start failed ahead is taken out
        of the group, so that its module starts it again instead of waiting on a dead
        process."""
        with self._lock:
            self._claimed.add(module)
            self._pending = [(m, s) for m, s in self._pending if m != module]
            for key in self._ahead_keys.pop(module, []):
                server = self._group.servers.get(key)
                if server is None:
                    continue
                if not server.process.alive():
                    logger.warning(
                        "%s died starting ahead (its log: %s); started again",
                        key,
                        server.process.log_path,
                    )
                    self._group.servers.pop(key, None)
                    server.process.stop()
                    continue
                server.last_used = time.monotonic()
                if server.process.pid is not None:
                    set_session_nice(server.process.pid, server.process.nice)

    def _run_ahead(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._cancel_ahead.is_set():
                    self._wake.wait()
                if self._cancel_ahead.is_set():
                    return
                module, starter = self._pending.pop(0)
                keys = self._start_one_ahead(module, starter)
            self._wait_quietly(module, keys, time.monotonic() + SERVER_START_TIMEOUT)

    def _start_one_ahead(self, module: str, starter: Callable[[], Sequence[str]]) -> list[str]:
        """Run ``starter`` (under the pool's lock) and lower the priority of the servers it
        added; the keys to wait for."""
        before = set(self._group.servers)
        try:
            keys = list(starter())
        except Exception:
            logger.exception("starting ahead failed; the module starts it itself")
            return []
        added = [key for key in keys if key not in before and key in self._group.servers]
        for key in added:
            server = self._group.servers[key]
            # Not stopped to make room (the group evicts the least recently used of earlier
            # modules) before its module has claimed it.
            server.last_used = math.inf
            if server.process.pid is not None:
                set_session_nice(server.process.pid, AHEAD_NICE)
        self._ahead_keys.setdefault(module, []).extend(added)
        return added

    def _wait_quietly(self, module: str, keys: Sequence[str], deadline: float) -> None:
        """Until each server answers its probe or died, its module began (it waits for them
        itself), or the deadline; raises nothing (whoever asks for the server waits again,
        with the pool's retries)."""
        pending = [self._group.servers[key] for key in keys if key in self._group.servers]
        while pending and time.monotonic() < deadline and not self._cancel_ahead.is_set():
            if module in self._claimed:
                return
            pending = [s for s in pending if s.process.alive() and not s.probe()]
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the start-ahead (between two starts) and every server of the group."""
        with self._wake:
            self._cancel_ahead.set()
            self._wake.notify()
        self._group.stop()

    def vllm(
        self,
        key: str,
        model: str | Path,
        *,
        served_model_name: str = "tiny",
        kv_transfer_config: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        cpu_core: int | None = None,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        nice: int = 0,
        in_process_worker: bool = True,
    ) -> Server:
        """The vLLM server registered under ``key``, started on first request.

        With ``wait=False`` it returns at once (start several, then ``wait_all``). One-rank
        servers run their worker in the engine-core process (``in_process_worker``), the layout
        vLLM picks for one GPU, faster to start here than the separate worker process vLLM's
        CPU platform picks (docs/environment.md, "Suite time"); that layout stays covered by
        the tensor-parallel module and by ``splitserve up`` (test_up), which keep vLLM's CPU
        default.
        """
        with self._lock:  # the start-ahead thread may be starting others
            server = self.group.servers.get(key)
            if server is not None:
                self.group.touch(key)
            else:
                self._specs[key] = {
                    "model": str(model),
                    "served_model_name": served_model_name,
                    "kv_transfer_config": kv_transfer_config,
                    "extra_args": extra_args,
                    "cpu_core": cpu_core,
                    "env": env,
                    "nice": nice,
                    "in_process_worker": in_process_worker,
                }
                server = self.group.add_vllm(key, **self._specs[key])
        if wait:
            self.wait_all(key)
            server = self.group.servers[key]
        return server

    def side_port(self, key: str) -> int:
        """The side-channel port server ``key`` runs with, read from its command line: a start
        that was tried again ran on fresh ports (``with_fresh_side_ports``), so the port a test
        chose before starting it may not be the one it listens on."""
        argv = self.group.servers[key].process.argv
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        extra = config.get("kv_connector_extra_config") or {}
        if "side_channel_port" in extra:
            return int(extra["side_channel_port"])
        for inner in extra.get("connectors") or ():  # MultiConnector: the first that has one
            inner_extra = inner.get("kv_connector_extra_config") or {}
            if "side_channel_port" in inner_extra:
                return int(inner_extra["side_channel_port"])
        raise KeyError(f"server {key} has no side_channel_port in its --kv-transfer-config")

    def release(self, *keys: str) -> None:
        """Stop these servers now (no later module uses them): a server whose NIXL agent spins
        a core would otherwise keep doing so until evicted, slowing the modules after it."""
        for key in keys:
            with self._lock:
                server = self.group.servers.pop(key, None)
            if server is not None:
                server.process.stop()

    def wait_all(self, *keys: str) -> None:
        """Wait for the servers (all when none is named); one that fails to start is started
        again (``SERVER_START_ATTEMPTS``), each wait bounded by ``SERVER_START_TIMEOUT``."""
        failures: dict[str, int] = {}
        while True:
            try:
                self.group.wait(
                    SERVER_START_TIMEOUT, names=list(keys) or None, stop_group_on_failure=False
                )
                return
            except ProcessStartError as e:
                failures[e.name] = failures.get(e.name, 0) + 1
                if failures[e.name] >= SERVER_START_ATTEMPTS or e.name not in self._specs:
                    raise
                logger.warning("server %s failed to start (%s); starting it again", e.name, e)
                with self._lock:
                    self._specs[e.name] = with_fresh_side_ports(self._specs[e.name])
                    self.group.add_vllm(e.name, **self._specs[e.name])


def with_fresh_side_ports(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with new side-channel ports (ours in ``kv_connector_extra_config``, stock
    NixlConnector's in ``VLLM_NIXL_SIDE_CHANNEL_PORT``) for a start that is tried again: the
    first try may have failed because its port was taken, and the port may still be taken.
    Whoever reads a server's side port back reads it from the command line (``ss_pair``)."""
    spec = dict(spec)
    config = spec.get("kv_transfer_config")
    extra = (config or {}).get("kv_connector_extra_config") or {}
    if "side_channel_port" in extra:
        ranks = tensor_parallel_size(list(spec.get("extra_args") or ()))
        extra = {**extra, "side_channel_port": free_port_run(ranks)}
        spec["kv_transfer_config"] = {**config, "kv_connector_extra_config": extra}
    env = spec.get("env")
    if env and "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
        spec["env"] = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    return spec
