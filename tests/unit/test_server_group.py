"""ServerGroup's bound on running processes: least recently used first, whole trees stopped."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

from splitserve.launch.group import ServerGroup
from splitserve.launch.process import SCRATCH_PREFIX, inductor_cache_dir, scratch_fits

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_least_recently_used_server_is_stopped_to_make_room(tmp_path) -> None:
    group = ServerGroup(tmp_path, max_running=2)
    try:
        a = group.add("a", SLEEPER, port=1)
        b = group.add("b", SLEEPER, port=2)
        group.touch("a")  # a is now more recent than b
        group.protect_since = time.monotonic()  # a new test module: a and b may make room
        c = group.add("c", SLEEPER, port=3)
        assert set(group.servers) == {"a", "c"}
        assert b.process.proc.wait(timeout=30) is not None  # stopped, not just forgotten
        assert a.process.alive() and c.process.alive()
    finally:
        group.stop()
    assert not a.process.alive() and not c.process.alive()


def test_servers_of_the_running_module_are_never_stopped(tmp_path) -> None:
    group = ServerGroup(tmp_path, max_running=1)
    try:
        group.protect_since = time.monotonic()
        a = group.add("a", SLEEPER, port=1)
        b = group.add("b", SLEEPER, port=2)  # over the bound, but a belongs to this module
        assert set(group.servers) == {"a", "b"}
        assert a.process.alive() and b.process.alive()
    finally:
        group.stop()


def test_unbounded_group_keeps_everything(tmp_path) -> None:
    group = ServerGroup(tmp_path)
    try:
        procs = [group.add(n, SLEEPER, port=i) for i, n in enumerate("xyz")]
        assert all(p.process.alive() for p in procs)
    finally:
        group.stop()


def test_cpus_and_nice_apply_to_the_process_and_its_children(tmp_path) -> None:
    """A benchmark pins each server's whole tree (a vLLM server's engine and worker are its
    children): the child of the started process has the same affinity and priority."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    parent = [
        sys.executable,
        "-c",
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(120)']); time.sleep(120)",
    ]
    group = ServerGroup(tmp_path)
    try:
        server = group.add("pinned", parent, port=1, cpus=[cpu], nice=5)
        root = psutil.Process(server.process.proc.pid)
        deadline = time.monotonic() + 30
        while not (children := root.children(recursive=True)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children, "the started process did not start its child"
        tree = [root, *children]
        for proc in tree:
            assert proc.cpu_affinity() == [cpu], proc
            assert proc.nice() == 5, proc
        # The process starts a session of its own: where sessions are scheduling groups
        # (autogroups), the group is niced too, or the niceness would not count against others.
        autogroup = Path(f"/proc/{root.pid}/autogroup")
        if autogroup.exists():
            assert autogroup.read_text().split()[-1] == "5", autogroup.read_text()
    finally:
        group.stop()


def test_each_process_tree_gets_a_temp_dir_removed_when_it_stops(tmp_path) -> None:
    """Engines leave IPC sockets in the temp directory when their tree is killed: each managed
    process gets a TMPDIR of its own (its children inherit it), removed by ``stop``; torch
    inductor's cache stays where the parent's temp directory would put it."""
    report = tmp_path / "report.json"
    child = (
        "import json, os, socket, subprocess, sys, tempfile, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(tempfile.gettempdir(), 'ipc'))\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"json.dump({{'tmp': tempfile.gettempdir(), 'inductor': os.environ.get("
        f"'TORCHINDUCTOR_CACHE_DIR')}}, open({str(report)!r}, 'w'))\n"
        "time.sleep(120)\n"
    )
    group = ServerGroup(tmp_path / "logs")
    try:
        server = group.add("scratch", [sys.executable, "-c", child], port=1)
        deadline = time.monotonic() + 30
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        seen = json.loads(report.read_text())
        scratch = Path(seen["tmp"])
        assert scratch == server.process.scratch_dir
        assert scratch.parent == Path(tempfile.gettempdir())
        assert scratch.name.startswith(SCRATCH_PREFIX)
        assert (scratch / "ipc").is_socket()
        # The parent's own setting if it has one (importing SGLang sets it), else inductor's
        # default under the parent's temp directory, not under the child's.
        assert seen["inductor"] == os.environ.get("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        assert not seen["inductor"].startswith(str(scratch))
    finally:
        group.stop()
    assert not scratch.exists()


def environ_once_exec(pid: int, timeout: float = 30.0) -> dict[str, str]:
    """The process's environment once it runs ``SLEEPER``: between the fork and the exec it
    still shows the parent's (a loaded machine can hold a child there for a while)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    while proc.cmdline() != SLEEPER and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.cmdline() == SLEEPER, proc.cmdline()
    return proc.environ()


def test_a_caller_tmpdir_is_kept(tmp_path) -> None:
    """A TMPDIR the caller names is the process's, not ours to remove."""
    mine = tmp_path / "mine"
    mine.mkdir()
    group = ServerGroup(tmp_path / "logs")
    try:
        server = group.add("named", SLEEPER, port=1, env={"TMPDIR": str(mine)})
        assert server.process.scratch_dir is None
        assert environ_once_exec(server.process.pid).get("TMPDIR") == str(mine)
    finally:
        group.stop()
    assert mine.is_dir()


def test_no_scratch_dir_where_socket_paths_would_be_too_long() -> None:
    """A Unix socket path has at most 107 bytes; vLLM's are its temp directory and a uuid."""
    assert scratch_fits("/tmp")
    assert scratch_fits("/" + "d" * 57)
    assert not scratch_fits("/" + "d" * 58)
