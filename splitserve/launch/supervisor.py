"""Keep a running deployment serving: restart a child that dies, under the restart policy.

Runs in the ``splitserve up`` process, once every child of its ``ServerGroup`` (engine servers
and the proxy) is ready. One loop, one tick a second, never blocking on a child for long:

1. a child found dead has what is left of its process tree stopped (an engine's helpers may
   outlive its top process and hold its ports), its exit code and last log lines are shown, and
   the policy (``splitserve.launch.restart``) decides: restart after a backoff, or give up;
2. once the backoff has passed, the restart waits for the child's ports to be free (a killed
   server's port may linger briefly), at most ``port_wait_s``;
3. the child is started again with the same command line, ports and environment (the
   deployment's keys included), appending to its log; its readiness is reported when its probe
   answers, and one that is not ready within ``startup_timeout_s`` is stopped (its exit then
   counts against the policy).

The other children keep serving meanwhile; the proxy's own health checks eject a dead server
and readmit the restarted one. Giving up stops the whole deployment: ``run`` returns 1, and the
caller stops every child. A signal (``KeyboardInterrupt``) returns 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from splitserve.config import RestartSettings
from splitserve.launch.group import ServerGroup
from splitserve.launch.restart import RestartTracker, describe_exit
from splitserve.netutil import port_in_use


@dataclass
class _Pending:
    """A dead child waiting for its restart."""

    due: float
    attempt: int
    exit: str
    port_deadline: float | None = None


class Supervisor:
    """Watch a group's children and restart the dead ones; see the module docstring."""

    def __init__(
        self,
        group: ServerGroup,
        settings: RestartSettings,
        ports: Mapping[str, Sequence[int]],
        echo: Callable[[str], None],
        host: str = "127.0.0.1",
        startup_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 1.0,
    ) -> None:
        self.group = group
        self.settings = settings
        self.ports = ports
        self.echo = echo
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.clock = clock
        self.interval_s = interval_s
        self.trackers: dict[str, RestartTracker] = {}
        self.pending: dict[str, _Pending] = {}
        self.starting: dict[str, float] = {}  # restarted, not ready yet: name -> restart time

    def run(self) -> int:
        """Block until a signal (0) or the policy gives up (1)."""
        try:
            while True:
                rc = self.step()
                if rc is not None:
                    return rc
                time.sleep(self.interval_s)
        except KeyboardInterrupt:
            return 0

    def step(self) -> int | None:
        """One tick: look at every child, start the restarts that are due. ``1`` to give up."""
        for name, server in list(self.group.servers.items()):
            if name in self.pending:
                continue
            if server.process.alive():
                self._check_starting(name)
                continue
            if not self._on_exit(name):
                return 1
        for name in list(self.pending):
            if not self._restart_when_due(name):
                return 1
        return None

    def _on_exit(self, name: str) -> bool:
        server = self.group.servers[name]
        proc = server.process
        exit_text = describe_exit(proc.returncode())
        tail = proc.tail()
        proc.stop(grace=5.0)  # what is left of its tree: helpers that hold its ports
        self.starting.pop(name, None)
        decision = self._tracker(name).on_exit(proc.returncode(), self.clock())
        log = f"\n--- last log lines of {name} ---\n{tail}\n--- end of {name}'s log ---"
        if not decision.restart:
            self.echo(
                f"{name} exited with {exit_text}; {decision.reason}: giving up, stopping the "
                f"deployment{log}"
            )
            return False
        self.echo(
            f"{name} exited with {exit_text}; restarting it in {decision.delay_s:.1f} s "
            f"(restart {decision.attempt} of at most {self.settings.max_restarts} in "
            f"{self.settings.window_s:g} s); the other servers keep serving{log}"
        )
        self.pending[name] = _Pending(self.clock() + decision.delay_s, decision.attempt, exit_text)
        return True

    def _tracker(self, name: str) -> RestartTracker:
        if name not in self.trackers:
            s = self.settings
            self.trackers[name] = RestartTracker(
                s.policy, s.max_restarts, s.window_s, s.backoff_s, s.max_backoff_s
            )
        return self.trackers[name]

    def _restart_when_due(self, name: str) -> bool:
        pending = self.pending[name]
        now = self.clock()
        if now < pending.due:
            return True
        busy = [p for p in self.ports.get(name, ()) if port_in_use(p, self.host)]
        if busy:
            if pending.port_deadline is None:
                pending.port_deadline = now + self.settings.port_wait_s
                self.echo(f"{name}: waiting for port(s) {busy} to be free before restarting it")
            elif now >= pending.port_deadline:
                self.echo(
                    f"{name}: port(s) {busy} still in use {self.settings.port_wait_s:g} s after "
                    f"it died (restart.port_wait_s): giving up, stopping the deployment"
                )
                return False
            return True
        del self.pending[name]
        server = self.group.restart(
            name, note=f"restart {pending.attempt} after the last run exited with {pending.exit}"
        )
        self.starting[name] = self.clock()
        self.echo(
            f"restarted {name} (pid {server.process.pid}) on :{server.port}, restart "
            f"{pending.attempt}"
        )
        return True

    def _check_starting(self, name: str) -> None:
        since = self.starting.get(name)
        if since is None:
            return
        server = self.group.servers[name]
        waited = self.clock() - since
        if server.probe():
            server.ready = True
            del self.starting[name]
            self.echo(f"{name} ready again after {waited:.0f} s")
        elif waited > self.startup_timeout_s:
            self.echo(
                f"{name} not ready {self.startup_timeout_s:g} s after its restart "
                f"(startup_timeout_s): stopping it"
            )
            server.process.stop(grace=5.0)
