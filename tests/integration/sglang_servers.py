"""How the session's shared SGLang servers are started, in one place: the PD pair (the
``sglang_pair`` fixture, tests/integration/conftest.py; test_sglang_failures.py runs its faults
on it, so its environment is that module's too) and the single server that is the reference of
every SGLang module. Used by those fixtures and by the pool's start-ahead
(tests/integration/starters.py), which must start a key the same way.

A starter adds its servers to the session's group without waiting and returns their keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from session_keys import key_env

from splitserve.launch.engines import sglang_server
from splitserve.netutil import free_port, free_ports

CHUNK = 64  # every SGLang server of the session chunks prefill by this many tokens
# A lease short enough for a freeze to outlast it (test_sglang_failures; docs/sglang.md,
# "Failures").
SGLANG_LEASE_S = 10.0
SGLANG_PD_ENV = {
    "SPLITSERVE_SGLANG_TIMELINE": "1",  # the per-request timeline in the logs (test_sglang_pd)
    "SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "120",
    "SPLITSERVE_SGLANG_LEASE_S": str(SGLANG_LEASE_S),
}
# D's own heartbeats to P's bootstrap server (SGLang's, 5 s by default) are stretched past any
# test: a D must recover from a P restarted on its ports through our backend alone (a fast
# restart answers those heartbeats again before they count P lost).
SGLANG_D_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "3600"}
SGLANG_PD_KEYS = ("sglang-pd-prefill", "sglang-pd-decode")
SINGLE = "sglang-single"
_PD_COMMON: dict[str, Any] = dict(
    served_model_name="tiny",
    transfer_backend="splitserve",
    chunked_prefill_size=CHUNK,
    extra_args=["--enable-metrics"],
)


def start_pair(servers: Any, model: Path, tmp_path_factory: Any = None) -> list[str]:
    """P and D (``start_prefill``, ``start_decode``), started together on ports picked
    together (each picked alone could be the other's before it binds)."""
    p_port, bootstrap, d_port = free_ports(3)
    return start_prefill(servers, model, ports=(p_port, bootstrap)) + start_decode(
        servers, model, port=d_port
    )


def bootstrap_port(servers: Any, key: str) -> int:
    """The bootstrap port a running P was started with (read from its command line)."""
    argv = servers.group.servers[key].process.argv
    return int(argv[argv.index("--disaggregation-bootstrap-port") + 1])


def _stop_stale(servers: Any, key: str) -> None:
    stale = servers.group.servers.pop(key, None)
    if stale is not None:
        stale.process.stop()


def start_prefill(
    servers: Any,
    model: Path,
    tmp_path_factory: Any = None,
    ports: tuple[int, int] | None = None,
    key: str = SGLANG_PD_KEYS[0],
) -> list[str]:
    """P: ``--disaggregation-transfer-backend splitserve`` (registered by splitserve's SGLang
    plugin), ``--enable-metrics`` (our backend's ``sglang:splitserve_*`` metrics on its
    ``/metrics``) and ``SGLANG_PD_ENV``, as ``key`` (another key: a P beside the pair's, as
    test_sglang_failures' victims). Whatever is left of an earlier one is stopped first."""
    _stop_stale(servers, key)
    port, bootstrap = ports or free_ports(2)
    cmd = sglang_server(
        str(model),
        port,
        mode="prefill",
        bootstrap_port=bootstrap,
        env={**SGLANG_PD_ENV, **key_env()},
        **_PD_COMMON,
    )
    servers.group.add(key, cmd.argv, port=port, env=cmd.env)
    return [key]


def start_decode(
    servers: Any,
    model: Path,
    tmp_path_factory: Any = None,
    port: int | None = None,
    key: str = SGLANG_PD_KEYS[1],
) -> list[str]:
    """D, as P (``start_prefill``) and with ``SGLANG_D_ENV``. D learns P's bootstrap port per
    request, so it needs nothing of P's to start."""
    _stop_stale(servers, key)
    port = port or free_port()
    env = {**SGLANG_PD_ENV, **SGLANG_D_ENV, **key_env()}
    cmd = sglang_server(str(model), port, mode="decode", env=env, **_PD_COMMON)
    servers.group.add(key, cmd.argv, port=port, env=cmd.env)
    return [key]


def start_single(servers: Any, model: Path, tmp_path_factory: Any = None) -> list[str]:
    """The single (colocated) SGLang server, chunking by ``CHUNK`` as the pairs do: the
    reference. Marked as just used when it already runs, so that a start beside it does not
    evict it."""
    group = servers.group
    if SINGLE in group.servers:
        group.touch(SINGLE)
    else:
        port = free_port()
        cmd = sglang_server(str(model), port, served_model_name="tiny", chunked_prefill_size=CHUNK)
        group.add(SINGLE, cmd.argv, port=port, env=cmd.env)
    return [SINGLE]


ADAPTIVE = "sglang-unified-adaptive"  # test_sglang_server's single server with our budget
ADAPTIVE_BUDGET = "target_itl_ms: 40\nmin_chunk: 16\nalignment: 16\nlog_interval_s: 1\n"


def start_adaptive(servers: Any, model: Path, tmp_path_factory: Any) -> list[str]:
    """A single server with splitserve's adaptive chunk budget (``ADAPTIVE_BUDGET``: 16 to
    ``CHUNK`` tokens in steps of 16), as test_sglang_server checks it."""
    group = servers.group
    if ADAPTIVE in group.servers:
        group.touch(ADAPTIVE)
        return [ADAPTIVE]
    settings = tmp_path_factory.mktemp("sglang-budget") / "budget.yaml"
    settings.write_text(ADAPTIVE_BUDGET)
    port = free_port()
    cmd = adaptive_command(model, port, settings)
    group.add(ADAPTIVE, cmd.argv, port=port, env=cmd.env)
    return [ADAPTIVE]


def adaptive_command(model: Path, port: int, settings: Path) -> Any:
    """A single server's command (``splitserve.launch.engines.sglang_server``) with
    splitserve's adaptive chunk budget on, its settings read from the YAML file ``settings``."""
    return sglang_server(
        str(model),
        port,
        chunked_prefill_size=CHUNK,
        env={"SPLITSERVE_ADAPTIVE_BUDGET": "1", "SPLITSERVE_SCHEDULER_CONFIG": str(settings)},
    )
