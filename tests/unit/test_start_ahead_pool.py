"""The test pool's start-ahead (``ServerPool`` in tests/server_pool.py) on real processes
(sleepers in sessions of their own, no engine): a server started ahead runs at the lowest
priority of the kernel's scheduler for its session until its module claims it, and a module
that began drops what was still queued for it. Our harness logic."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from splitserve.launch.group import ServerGroup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server_pool  # noqa: E402

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
BOUND_S = 30.0

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/autogroup").exists(),
    reason="this kernel has no autogroups (CONFIG_SCHED_AUTOGROUP): sessions have no priority",
)


def session_nice(pid: int) -> int:
    """The priority of ``pid``'s session (``/autogroup-N nice K``)."""
    return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])


def started(group: ServerGroup, key: str) -> bool:
    """``key`` is in the group and its process runs (the group lists it just before)."""
    server = group.servers.get(key)
    return server is not None and server.process.pid is not None


def eventually(predicate, what: str) -> None:
    end = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < end, f"not within {BOUND_S} s: {what}"
        time.sleep(0.05)


def sleeper_starter(group: ServerGroup, key: str, port: int):
    """A starter as tests/integration/starters.py writes them: add without waiting, return
    the keys. The sleeper never listens on ``port``, so it is never ready."""

    def start() -> list[str]:
        if key not in group.servers:
            group.add(key, SLEEPER, port=port, ready_path=None)
        return [key]

    return start


def test_a_server_started_ahead_has_the_lowest_priority_until_its_module_claims_it(tmp_path):
    group = ServerGroup(tmp_path)
    pool = server_pool.ServerPool(group)
    try:
        group.add("running", SLEEPER, port=1, ready_path=None)  # started by its own module
        pool.start_ahead(
            "test_later.py",
            [sleeper_starter(group, "ahead", 2), sleeper_starter(group, "running", 1)],
        )
        eventually(lambda: started(group, "ahead"), "the starter ran")
        ahead = group.servers["ahead"].process.pid
        eventually(lambda: session_nice(ahead) == server_pool.AHEAD_NICE, "ahead's session niced")
        assert session_nice(group.servers["running"].process.pid) == 0

        pool.claim("test_later.py")
        assert session_nice(ahead) == 0
        assert session_nice(group.servers["running"].process.pid) == 0
    finally:
        pool.stop()
    assert not any(s.process.alive() for s in group.servers.values())


def test_a_module_that_began_drops_its_starters_still_queued(tmp_path):
    group = ServerGroup(tmp_path)
    pool = server_pool.ServerPool(group)
    try:
        # The thread waits for "first" (never ready), so "second" is still queued...
        pool.start_ahead(
            "test_later.py",
            [sleeper_starter(group, "first", 3), sleeper_starter(group, "second", 4)],
        )
        pool.start_ahead("test_last.py", [sleeper_starter(group, "third", 5)])
        eventually(lambda: started(group, "first"), "the first starter ran")
        # ...when its module begins: the module starts "second" itself, the thread goes on
        # with the next module's.
        pool.claim("test_later.py")
        eventually(lambda: started(group, "third"), "the next module's starter ran")
        assert "second" not in group.servers
        assert session_nice(group.servers["first"].process.pid) == 0
        third = group.servers["third"].process.pid
        eventually(lambda: session_nice(third) == server_pool.AHEAD_NICE, "third's session niced")
    finally:
        pool.stop()


def test_a_failing_starter_leaves_the_module_to_start_it_itself(tmp_path):
    group = ServerGroup(tmp_path)
    pool = server_pool.ServerPool(group)

    def broken() -> list[str]:
        raise RuntimeError("no such model")

    try:
        pool.start_ahead("test_later.py", [broken, sleeper_starter(group, "next", 6)])
        eventually(lambda: started(group, "next"), "the starter after the failed one ran")
    finally:
        pool.stop()


def test_a_server_started_ahead_is_not_stopped_to_make_room_before_its_module_claims_it(
    tmp_path,
):
    group = ServerGroup(tmp_path, max_running=1)
    pool = server_pool.ServerPool(group)
    try:
        pool.start_ahead("test_later.py", [sleeper_starter(group, "ahead", 7)])
        eventually(lambda: started(group, "ahead"), "the starter ran")
        pid = group.servers["ahead"].process.pid
        eventually(lambda: session_nice(pid) == server_pool.AHEAD_NICE, "started ahead")
        group.protect_since = time.monotonic()  # a module in between begins
        group.add("between", SLEEPER, port=8, ready_path=None)  # over the bound
        assert group.servers["ahead"].process.alive()

        pool.claim("test_later.py")
        group.protect_since = time.monotonic()  # a later module: both may make room now
        time.sleep(0.01)
        group.add("later", SLEEPER, port=9, ready_path=None)
        assert set(group.servers) == {"later"}
    finally:
        pool.stop()


def test_a_server_that_died_starting_ahead_is_left_for_its_module_to_start_again(tmp_path):
    group = ServerGroup(tmp_path)
    pool = server_pool.ServerPool(group)

    def dies() -> list[str]:
        group.add("dead", [sys.executable, "-c", "raise SystemExit(3)"], port=10)
        return ["dead"]

    try:
        pool.start_ahead("test_later.py", [dies])
        eventually(lambda: started(group, "dead"), "the starter ran")
        eventually(lambda: not group.servers["dead"].process.alive(), "the start failed")
        pool.claim("test_later.py")
        assert "dead" not in group.servers  # the module's fixture starts it afresh
    finally:
        pool.stop()
