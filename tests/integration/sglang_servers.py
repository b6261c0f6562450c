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


def start_pair(servers: Any, model: Path, tmp_path_factory: Any = None) -> list[str]:
    """P and D with ``--disaggregation-transfer-backend splitserve`` (registered by
    splitserve's SGLang plugin), ``--enable-metrics`` (our backend's ``sglang:splitserve_*``
    metrics on their ``/metrics``) and ``SGLANG_PD_ENV`` (D also ``SGLANG_D_ENV``), on ports
    picked together. Whatever is left of an earlier pair is stopped first."""
    group = servers.group
    for name in SGLANG_PD_KEYS:
        stale = group.servers.pop(name, None)
        if stale is not None:
            stale.process.stop()
    p_port, d_port, bootstrap = free_ports(3)
    common: dict[str, Any] = dict(
        served_model_name="tiny",
        transfer_backend="splitserve",
        chunked_prefill_size=CHUNK,
        extra_args=["--enable-metrics"],
    )
    p = sglang_server(
        str(model),
        p_port,
        mode="prefill",
        bootstrap_port=bootstrap,
        env={**SGLANG_PD_ENV, **key_env()},
        **common,
    )
    d_env = {**SGLANG_PD_ENV, **SGLANG_D_ENV, **key_env()}
    d = sglang_server(str(model), d_port, mode="decode", env=d_env, **common)
    group.add(SGLANG_PD_KEYS[0], p.argv, port=p_port, env=p.env)
    group.add(SGLANG_PD_KEYS[1], d.argv, port=d_port, env=d.env)
    return list(SGLANG_PD_KEYS)


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
