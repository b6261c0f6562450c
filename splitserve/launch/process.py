"""Child processes that are started, waited for, and always stopped.

Used by the test harness and by ``splitserve up``. Each process runs in its own session (process
group), writes stdout and stderr to one log file, and is stopped as a whole tree: SIGTERM to the
group and every descendant, a grace period, then SIGKILL. Engines spawn helpers (vLLM's
EngineCore, SGLang's scheduler and detokenizer), so killing only the top pid would leak them.

Each process also gets a temporary directory of its own (``TMPDIR``), removed once its tree is
stopped: the engines put their IPC sockets there (vLLM's ZMQ ``ipc://`` paths and its
``file://`` rendezvous for TP ranks, SGLang's ``NamedTemporaryFile`` names), and a tree stopped
with SIGKILL never removes them: about ten files in ``/tmp`` per server start, thousands over a
test suite (not where the temp directory's path is so long that the engines' socket paths would
pass the 107-byte limit: the tree then keeps it). Torch inductor's cache, which defaults to a
folder of the temp directory, is kept where it was (``TORCHINDUCTOR_CACHE_DIR``), so that
compiled kernels outlive a restart.

Readiness is a bounded wait on a probe; a process that exits or misses its deadline raises
``ProcessStartError`` carrying the tail of its log, so a failing start explains itself. Ports and
HTTP probes: ``splitserve.netutil``.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

# How much of the end of a log ``tail`` reads: enough for a traceback, bounded for a huge log.
TAIL_BYTES = 65536


def tail_lines(data: bytes, lines: int, cut: bool = False) -> str:
    """The last ``lines`` lines of ``data`` as text (bad UTF-8 replaced, not fatal).

    ``cut``: ``data`` starts mid-file (a bounded read), so its first line may be partial: it is
    dropped when whole lines follow it.
    """
    if lines <= 0:
        return ""
    split = data.decode("utf-8", "replace").splitlines()
    if cut and len(split) > 1:
        split = split[1:]
    return "\n".join(split[-lines:])


# A process tree's own temp directory: ``ss-`` and mkdtemp's 8 characters. Short, because a Unix
# socket's path has at most 107 bytes and vLLM names its sockets with a 36-character uuid.
SCRATCH_PREFIX = "ss-"
_SUN_PATH_MAX = 107
_ENGINE_SOCKET_NAME = 36


def scratch_fits(base: str) -> bool:
    """Whether a scratch directory under ``base`` leaves room for the engines' socket names
    (else the tree keeps ``base``, as it would without us)."""
    scratch = len(os.path.join(base, SCRATCH_PREFIX + "x" * 8))
    return scratch + 1 + _ENGINE_SOCKET_NAME <= _SUN_PATH_MAX


def inductor_cache_dir() -> str:
    """Where torch inductor caches compiled kernels when ``TORCHINDUCTOR_CACHE_DIR`` is unset
    (its ``default_cache_dir``: a folder of the temp directory named after the user). Written
    out rather than imported: the launcher does not import torch to start a process."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def set_session_nice(pid: int, nice: int) -> None:
    """Give the session of ``pid`` (its autogroup) the priority ``nice``; nothing to do where the
    kernel has no autogroups (the process's own niceness then applies as usual).

    Why: with ``sched_autogroup_enabled`` (the default on desktop and many server kernels), every
    session is one scheduling group, and groups share the CPU as equals whatever their threads'
    niceness. Our processes each start a session (to be stopped as a tree), so ``nice -n 10``
    alone left a server that spins a core exactly as heavy as its neighbours (measured: a nice-0
    busy loop beside a niced spinner in another session got 0.5 of the core, 0.9 once the
    spinner's autogroup was niced too). Raising a group's niceness needs no privilege.
    """
    path = Path(f"/proc/{pid}/autogroup")
    try:
        path.write_text(str(nice))
    except OSError as exc:
        logger.debug("no autogroup priority for pid %d (%s): its own niceness applies", pid, exc)


class ProcessStartError(RuntimeError):
    """A managed process died or did not become ready in time."""

    def __init__(self, name: str, reason: str, log_tail: str) -> None:
        super().__init__(f"{name}: {reason}\n--- last log lines of {name} ---\n{log_tail}")
        self.name = name
        self.reason = reason
        self.log_tail = log_tail


class ManagedProcess:
    """One child process with a log file, a readiness wait and a tree-wide stop."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        nice: int = 0,
    ) -> None:
        """``nice`` > 0 lowers the priority of the whole session the process starts
        (``set_session_nice``); the caller also starts it under ``nice`` for kernels without
        autogroups."""
        self.name = name
        self.argv = list(argv)
        self.nice = nice
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        # Where this run's lines begin in the log file (set by ``start``).
        self.log_offset = 0
        # The process tree's own TMPDIR (set by ``start`` unless ``env`` names one; removed by
        # ``stop``).
        self.scratch_dir: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ManagedProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        if "TMPDIR" not in (self.env or {}) and scratch_fits(tempfile.gettempdir()):
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
            self.scratch_dir = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
            env["TMPDIR"] = str(self.scratch_dir)
        try:
            with open(self.log_path, "ab") as log:
                self.log_offset = log.seek(0, os.SEEK_END)
                self.proc = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
        except BaseException:
            self._remove_scratch_dir()
            raise
        if self.nice:
            set_session_nice(self.proc.pid, self.nice)
        logger.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines this run wrote (a restarted process appends to the log of
        the runs before it; their lines are not this run's)."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                start = max(self.log_offset, size - TAIL_BYTES)
                f.seek(start)
                data = f.read()
        except OSError:
            return "(no log)"
        return tail_lines(data, lines, cut=start > self.log_offset)

    def wait_ready(
        self,
        probe: Callable[[], bool],
        timeout: float,
        interval: float = 0.5,
        on_wait: Callable[[float], None] | None = None,
    ) -> float:
        """Poll ``probe`` until it returns True; return the seconds waited.

        Raises ``ProcessStartError`` if the process exits first or ``timeout`` passes.
        """
        t0 = time.monotonic()
        while True:
            if not self.alive():
                raise ProcessStartError(
                    self.name, f"exited with code {self.returncode()} during start-up", self.tail()
                )
            if probe():
                return time.monotonic() - t0
            waited = time.monotonic() - t0
            if waited > timeout:
                raise ProcessStartError(self.name, f"not ready after {timeout:.0f} s", self.tail())
            if on_wait is not None:
                on_wait(waited)
            time.sleep(interval)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the process and every descendant: SIGTERM, then SIGKILL after ``grace``."""
        if self.proc is None:
            return
        procs = _tree(self.proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=grace)
        # Children may have forked after we listed them: list again before killing.
        leftovers = {p.pid: p for p in alive}
        leftovers.update({p.pid: p for p in _tree(self.proc.pid)})
        for p in leftovers.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        psutil.wait_procs(list(leftovers.values()), timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._remove_scratch_dir()
        logger.info("stopped %s (pid %d)", self.name, self.proc.pid)

    def _remove_scratch_dir(self) -> None:
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)
            self.scratch_dir = None

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants that still exist."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
