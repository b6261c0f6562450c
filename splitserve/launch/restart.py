"""The restart policy of ``splitserve up``: whether a dead child is restarted, and when.

Pure arithmetic, no processes and no clock of its own (the caller passes ``now``), so the
supervisor (``splitserve.launch.deployment``) stays a thin loop and the policy is unit-tested
with a fake clock. The settings are ``splitserve.config.RestartSettings`` (docs/deployment.md):

- ``policy``: ``always`` restarts any exit, ``on-failure`` only a non-zero exit (a signal
  counts: its return code is negative), ``never`` none (the whole deployment stops, as before);
- at most ``max_restarts`` restarts of one child within any ``window_s`` seconds: one more exit
  inside the window gives up, and the deployment stops with exit 1 (a child that crashes at
  every start is not retried for ever);
- each restart waits ``backoff_s * 2**k`` seconds, capped at ``max_backoff_s``, where ``k`` is
  the number of restarts of that child already inside the window (so a child that ran well for
  a whole window starts again from ``backoff_s``).
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

RestartPolicyName = Literal["always", "on-failure", "never"]


def wants_restart(policy: RestartPolicyName, returncode: int | None) -> bool:
    """Whether ``policy`` restarts a child that exited with ``returncode``."""
    if policy == "never":
        return False
    if policy == "always":
        return True
    return returncode != 0


def backoff_delay(restarts_in_window: int, backoff_s: float, max_backoff_s: float) -> float:
    """Seconds to wait before the next restart, given how many restarts of the same child are
    already inside the window: ``backoff_s``, doubled per earlier restart, capped."""
    if restarts_in_window < 0:
        raise ValueError("restarts_in_window must be >= 0")
    # Cap the exponent: 2**k overflows a float long before any sane window holds k restarts.
    return min(max_backoff_s, backoff_s * 2.0 ** min(restarts_in_window, 60))


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one exit: restart after ``delay_s`` seconds, or give up (``reason``)."""

    restart: bool
    delay_s: float
    attempt: int  # the restart's number inside the window (1 = first); 0 when giving up
    reason: str


@dataclass
class RestartTracker:
    """The restart history of one child, and the decision on its next exit."""

    policy: RestartPolicyName = "on-failure"
    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    _restarts: deque[float] = field(default_factory=deque, repr=False)

    def restarts_in_window(self, now: float) -> int:
        while self._restarts and self._restarts[0] <= now - self.window_s:
            self._restarts.popleft()
        return len(self._restarts)

    def on_exit(self, returncode: int | None, now: float) -> RestartDecision:
        """Decide about an exit seen at ``now``; a decision to restart is recorded as a restart
        at ``now`` (the window counts restarts decided, so a crash loop gives up in bounded
        time whatever the backoff)."""
        if not wants_restart(self.policy, returncode):
            why = (
                "the restart policy is 'never'"
                if self.policy == "never"
                else "the restart policy 'on-failure' does not restart a clean exit (code 0)"
            )
            return RestartDecision(False, 0.0, 0, why)
        done = self.restarts_in_window(now)
        if done >= self.max_restarts:
            return RestartDecision(
                False,
                0.0,
                0,
                f"{done} restart(s) in the last {self.window_s:g} s already, the most "
                f"restart.max_restarts allows",
            )
        delay = backoff_delay(done, self.backoff_s, self.max_backoff_s)
        self._restarts.append(now)
        return RestartDecision(True, delay, done + 1, "")


def describe_exit(returncode: int | None) -> str:
    """``code 1``, or ``code -9 (SIGKILL)`` for a child killed by a signal."""
    if returncode is None:
        return "an unknown code"
    if returncode < 0:
        try:
            return f"code {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"code {returncode}"
    return f"code {returncode}"
