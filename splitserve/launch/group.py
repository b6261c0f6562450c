"""A set of servers started together, waited for together, and stopped together.

Engine servers take about a minute to become ready on our CPU machines, so they are started
first and waited for after (start-up overlaps). Shared by the pytest harness, the benchmarks and
``splitserve up``; stopping the group stops every process tree it started, in reverse order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.launch import engines
from splitserve.launch.process import ManagedProcess, ProcessStartError
from splitserve.netutil import free_port, http_ok, port_in_use

logger = logging.getLogger(__name__)


@dataclass
class Server:
    """A started process with an HTTP endpoint and the probe that says it is ready
    (``ready_path`` None: a plain TCP server, ready once its port is taken)."""

    name: str
    host: str
    port: int
    process: ManagedProcess
    ready_path: str | None = "/health"
    ready: bool = False
    last_used: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def probe(self) -> bool:
        if self.ready_path is None:
            return port_in_use(self.port, self.host)
        return http_ok(self.url + self.ready_path)


class ServerGroup:
    """Start servers, wait for all of them with a bound, stop them all."""

    def __init__(self, log_dir: str | Path, max_running: int | None = None) -> None:
        """``max_running``: when set, adding a server first stops the least recently used ones
        (among those not used since ``protect_since``) so that at most this many run, as far as
        that allows (a long test session on a 24 GiB machine cannot keep every engine it ever
        started)."""
        self.log_dir = Path(log_dir)
        self.servers: dict[str, Server] = {}
        self.max_running = max_running
        # Servers used at or after this moment are never evicted (a test module sets it when it
        # starts, so that only servers of earlier modules make room).
        self.protect_since = 0.0
        self._lock = threading.Lock()

    def touch(self, name: str) -> Server:
        """Mark a server as just used (it is the last to be evicted) and return it."""
        server = self.servers[name]
        server.last_used = time.monotonic()
        return server

    def _evict_for_one_more(self) -> None:
        if self.max_running is None:
            return
        with self._lock:
            excess = len(self.servers) - self.max_running + 1
            evictable = sorted(
                (s for s in self.servers.values() if s.last_used < self.protect_since),
                key=lambda s: s.last_used,
            )
            victims = evictable[: max(0, excess)]
            for v in victims:
                del self.servers[v.name]
        for v in victims:
            logger.info("stopping %s to make room (max_running=%d)", v.name, self.max_running)
            v.process.stop()

    def add(
        self,
        name: str,
        argv: Sequence[str],
        *,
        port: int,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        ready_path: str | None = "/health",
        nice: int = 0,
        cpus: Sequence[int] | None = None,
    ) -> Server:
        """Start a process now; it is waited for by ``wait``.

        ``nice`` > 0 lowers the process's CPU priority: for servers that spin a core while idle
        (stock NIXL agents poll with no delay), so that they do not starve their neighbours.
        ``cpus`` pins the process and every child it starts to those cores (``taskset``): a
        benchmark gives each server of a pair its own cores, as separate hosts would have, so
        that one server's polling loops cannot slow the other's compute.
        """
        if nice:
            argv = ["nice", "-n", str(nice), *argv]
        if cpus:
            argv = ["taskset", "-c", ",".join(str(cpu) for cpu in cpus), *argv]
        if name in self.servers:
            raise ValueError(f"a server named {name!r} is already in this group")
        self._evict_for_one_more()
        with self._lock:
            if name in self.servers:
                raise ValueError(f"a server named {name!r} is already in this group")
            proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log", env=env, nice=nice)
            server = Server(name, host, port, proc, ready_path, last_used=time.monotonic())
            self.servers[name] = server
        proc.start()
        return server

    def add_vllm(
        self,
        name: str,
        model: str,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        served_model_name: str | None = None,
        kv_transfer_config: Mapping[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        cpu_core: int | None = None,
        env: Mapping[str, str] | None = None,
        nice: int = 0,
        cpus: Sequence[int] | None = None,
        in_process_worker: bool = False,
    ) -> Server:
        """Start a stock vLLM OpenAI server (see ``engines.vllm_server``)."""
        port = port or free_port(host)
        cmd = engines.vllm_server(
            model,
            port,
            host=host,
            served_model_name=served_model_name,
            kv_transfer_config=kv_transfer_config,
            extra_args=extra_args,
            cpu_core=cpu_core,
            env=env,
            in_process_worker=in_process_worker,
        )
        return self.add(name, cmd.argv, port=port, host=host, env=cmd.env, nice=nice, cpus=cpus)

    def wait(
        self,
        timeout: float = 300.0,
        names: Sequence[str] | None = None,
        on_wait: Callable[[str, float], None] | None = None,
        stop_group_on_failure: bool = True,
    ) -> None:
        """Wait until every (named) server answers its probe.

        On failure raise ``ProcessStartError`` with the failing server's log tail, after
        stopping the whole group (a deployment) or only the failed server
        (``stop_group_on_failure=False``: a test pool whose other servers stay useful).
        """
        targets = [self.servers[n] for n in (names or list(self.servers))]
        deadline = time.monotonic() + timeout
        for s in targets:
            s.last_used = time.monotonic()
        try:
            for s in targets:
                if s.ready:
                    continue
                waited = s.process.wait_ready(
                    s.probe,
                    max(1.0, deadline - time.monotonic()),
                    on_wait=(lambda t, s=s: on_wait(s.name, t)) if on_wait else None,
                )
                s.ready = True
                logger.info("%s ready at %s after %.1f s", s.name, s.url, waited)
        except ProcessStartError as e:
            if stop_group_on_failure:
                self.stop()
            else:
                with self._lock:
                    failed = self.servers.pop(e.name, None)
                if failed is not None:
                    failed.process.stop()
            raise

    def restart(self, name: str, note: str = "") -> Server:
        """Start a server again with its same command line, environment and log file (appended
        to, after a ``note`` line that marks where the new run begins); it keeps its place in
        the stop order and is not ready until a probe says so.

        What is left of the old process tree (helpers of a server whose top process died) is
        stopped first, so that nothing of the old run holds its ports or memory.
        """
        with self._lock:
            server = self.servers[name]
        old = server.process
        old.stop(grace=5.0)
        if note:
            old.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(old.log_path, "a", encoding="utf-8") as log:
                log.write(f"\n===== splitserve: {note} =====\n")
        proc = ManagedProcess(
            old.name, old.argv, old.log_path, env=old.env, cwd=old.cwd, nice=old.nice
        )
        server.process = proc
        server.ready = False
        server.last_used = time.monotonic()
        proc.start()
        return server

    def stop(self) -> None:
        """Stop every server, last started first."""
        with self._lock:
            servers = list(self.servers.values())[::-1]
        for s in servers:
            s.process.stop()

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
