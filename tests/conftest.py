"""Shared pytest fixtures: test models and real engine servers.

Servers are expensive (about a minute each on our CPU machines), so they are session-scoped and
shared: ask ``servers.vllm(key, ...)`` for a server and every test asking with the same key gets
the same process. Everything the session started is stopped, as whole process trees, when the
session ends (also when it fails).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import server_logs
from module_order import INTEGRATION_ORDER
from server_pool import MAX_RUNNING_SERVERS, ServerPool

from splitserve.launch.group import ServerGroup
from splitserve.models import build_model, resolve_spec

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def restore_process_environment() -> Iterator[None]:
    """Put ``os.environ`` back as it was when the module ends. For modules that load a library
    which changes this process's environment: LMCache's metrics logger sets
    ``PROMETHEUS_MULTIPROC_DIR``, and every in-process proxy started after it then took itself
    for one of several workers and served its metrics from files (read 0 in later tests)."""
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset, built once per test session."""
    return build_model(resolve_spec("tiny"), tmp_path_factory.mktemp("models") / "tiny")


def _module_rank(item: pytest.Item) -> int:
    path = Path(str(item.fspath))
    if path.parent.name != "integration":
        return 0
    if path.name in INTEGRATION_ORDER:
        return 1 + INTEGRATION_ORDER.index(path.name)
    return 1 + len(INTEGRATION_ORDER)


def pytest_collection_modifyitems(session: pytest.Session, config, items: list[pytest.Item]):
    items.sort(key=_module_rank)  # stable: the order within a module is kept


_GROUPS: list[ServerGroup] = server_logs.GROUPS  # the session's groups, for failing tests
_current_module: list[str] = [""]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A new test module protects nothing of the earlier ones: their servers may be stopped to
    make room, its own never are while it runs."""
    module = item.nodeid.split("::")[0]
    if module != _current_module[0]:
        _current_module[0] = module
        for group in _GROUPS:
            group.protect_since = time.monotonic()


# What a session without integration modules starts ahead: nothing (``starters.Plan``'s shape).
NO_AHEAD = SimpleNamespace(triggers={}, targets=set())


@pytest.fixture(scope="session")
def ahead_plan(request: pytest.FixtureRequest) -> Any:
    """Which servers to start ahead when which tests begin (tests/integration/starters.py),
    for this session's modules. ``SPLITSERVE_TEST_START_AHEAD=0`` turns it off."""
    items = request.session.items
    modules = {Path(str(item.fspath)).name for item in items if _module_rank(item) > 0}
    if os.environ.get("SPLITSERVE_TEST_START_AHEAD", "1") == "0" or not modules:
        return NO_AHEAD
    import starters  # tests/integration, on sys.path since its modules were collected

    in_order = [name for name in INTEGRATION_ORDER if name in modules]
    return starters.plan(in_order, unit_first=_module_rank(items[0]) == 0)


@pytest.fixture(scope="module", autouse=True)
def start_servers_ahead(request: pytest.FixtureRequest, ahead_plan) -> None:
    """When a module begins: its servers started ahead are its own now (``ServerPool.claim``),
    and if it is a trigger (the first unit module stands for the unit tests), the servers of
    later modules start on a background thread (``ServerPool.start_ahead``) while its tests
    leave a core idle. The modules that need them then find them running."""
    module = "unit" if request.path.parent.name == "unit" else request.path.name
    if module in ahead_plan.targets:
        request.getfixturevalue("servers").claim(module)
    queued = ahead_plan.triggers.pop(module, None)  # popped: the unit trigger fires once
    if not queued:
        return
    pool: ServerPool = request.getfixturevalue("servers")
    model = request.getfixturevalue("tiny_model")
    factory = request.getfixturevalue("tmp_path_factory")
    for target, starters in queued:
        pool.start_ahead(
            target, [functools.partial(starter, pool, model, factory) for starter in starters]
        )


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    group = ServerGroup(tmp_path_factory.mktemp("server-logs"), max_running=MAX_RUNNING_SERVERS)
    _GROUPS.append(group)
    pool = ServerPool(group)
    try:
        yield pool
    finally:
        pool.stop()


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI time limit, ``kill``) ends the session like Ctrl-C, so the session's
    fixtures still stop every server they started instead of leaving them orphaned."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any process started by the tests outlived them (and reap it)."""
    import psutil

    leftovers = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
    if not leftovers:
        return
    names = ", ".join(f"{p.pid} {_cmdline(p)}" for p in leftovers)
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.kill()
    session.config.get_terminal_writer().line(
        f"ERROR: processes outlived the test session: {names}", red=True
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except Exception:  # noqa: BLE001 - the process may be gone or a zombie
        return "?"
