"""KV across hosts and NIXL backends: two real processes moving real bytes, no engine.

P (the ``stream`` scenario of test_transfer_two_process.py) and D (its ``receive-check`` mode,
which checks every byte) run as children: on two test-bed hosts (separate network namespaces,
UCX over tcp), or side by side with the NIXL backends the connector setting ``nixl_backends``
names. UCX prints the protocol it picked for every endpoint (``UCX_PROTO_INFO=y``); the
cross-host tests read it to show that the KV went over ``tcp/eth0`` and never ``cma``, which
UCX would otherwise pick between namespaces of one kernel ("intra-node").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.launch import testbed as tbmod
from splitserve.netutil import free_port

pytestmark = pytest.mark.integration

SCRIPT = str(Path(__file__).with_name("test_transfer_two_process.py"))
KEY = "cross-host-key"


def events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("EVENT ")]


def transfer(
    p_prefix: list[str],
    d_prefix: list[str],
    p_addr: str,
    port: int,
    env: dict,
    p_env: dict | None = None,
):
    """Run P and D to the end; answer (P's end event, D's report, P's log, D's log)."""
    env = {**os.environ, **env}
    sender = subprocess.Popen(
        [*p_prefix, sys.executable, SCRIPT, "stream", str(port), KEY],
        env={**env, **(p_env or {}), "SENDER_HOST": p_addr},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        receiver = subprocess.run(
            [*d_prefix, sys.executable, SCRIPT, "receive-check", f"{p_addr}:{port}", KEY],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        p_log = sender.communicate(timeout=60)[0]
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    d_log = receiver.stdout + receiver.stderr
    p_end = [e for e in events(p_log) if e["event"] == "end"]
    d_report = [e for e in events(receiver.stdout) if e["event"] == "received"]
    assert p_end, f"P did not finish:\n{p_log[-4000:]}"
    assert d_report, f"D did not report:\n{d_log[-4000:]}"
    return p_end[0], d_report[0], p_log, d_log


def kv_protocols(log: str) -> list[str]:
    """The transports UCX picked for remote memory access (the KV bytes), from its proto info."""
    out, in_rma = [], False
    for line in log.splitlines():
        if "remote memory" in line:
            in_rma = True
        elif in_rma and "|" in line and "/" in line.split("|")[-2]:
            out.append(line.split("|")[-2].strip())
        elif in_rma and "+-" in line and out:
            in_rma = False
    return out


@pytest.fixture(scope="module")
def bed():
    try:
        tbmod.check()
    except tbmod.TestbedError as exc:
        pytest.fail(f"the test bed cannot run here: {exc}")
    with tbmod.Testbed(["p", "d"]) as bed:
        yield bed


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_kv_crosses_hosts_over_tcp_never_cma(bed, direction):
    env = {"DIRECTION": direction, "UCX_PROTO_INFO": "y", **bed["p"].ucx_env()}
    p_end, d_report, p_log, d_log = transfer(
        bed["p"].argv([]), bed["d"].argv([]), bed["p"].address, 7800, env
    )
    assert d_report["ok"], d_report["reason"]
    assert d_report["bytes_ok"], d_report["problem"]
    assert p_end["released"] == ["tid-1"]
    if direction == "pull":
        assert d_report["reads_posted"] > 0 and p_end["stats"]["writes_posted"] == 0
    else:
        assert p_end["stats"]["writes_posted"] > 0 and d_report["reads_posted"] == 0
    # Who moved the bytes: P's WRITEs (push) or D's READs (pull), over the network only.
    mover = kv_protocols(p_log if direction == "push" else d_log)
    assert mover, "UCX printed no protocol for remote memory access"
    assert all(p.startswith("tcp/eth0") for p in mover), mover
    assert "cma/" not in p_log + d_log  # no UCX protocol over cma on any endpoint
    # D's HELLO carried its host identity: a pulling P says it was chosen for same-host cma.
    assert ("is on another host (reached over tcp)" in p_log) == (direction == "pull")


def test_default_ucx_env_would_use_cma_between_namespaces(bed):
    """Why the test bed sets UCX_TLS: left to itself UCX sees one kernel and copies by cma."""
    env = {"DIRECTION": "push", "UCX_PROTO_INFO": "y"}
    _, d_report, p_log, _ = transfer(
        bed["p"].argv(["env", "-u", "UCX_TLS"]),
        bed["d"].argv(["env", "-u", "UCX_TLS"]),
        bed["p"].address,
        7801,
        env,
    )
    assert d_report["bytes_ok"], d_report
    assert any(p.startswith("cma") for p in kv_protocols(p_log)), kv_protocols(p_log)


def test_ucx_named_in_the_setting_with_params_moves_bytes():
    backends = [{"name": "UCX", "params": {"num_workers": "2"}}]
    _, d_report, _, d_log = transfer(
        [], [], "127.0.0.1", free_port(), {"NIXL_BACKENDS": json.dumps(backends)}
    )
    assert d_report["bytes_ok"], (d_report, d_log[-2000:])


def test_libfabric_moves_bytes_or_is_refused_at_start():
    """LIBFABRIC (tcp provider) where its plugin loads; else refused with the reason."""
    import torch

    from splitserve.transfer.agent import BackendUnavailableError, KVAgent, NixlBackend
    from splitserve.transfer.layout import kv_layout_from_tensors

    cache = [torch.zeros(2, 4, 2, 16, 8)]
    spec = NixlBackend(name="LIBFABRIC", params={"provider": "tcp"})
    try:
        KVAgent("lf-probe", kv_layout_from_tensors(cache, 4, 16), backends=[spec]).close()
    except BackendUnavailableError as exc:
        assert "LIBFABRIC" in str(exc) and ("did not load" in str(exc) or "unknown" in str(exc))
        return
    env = {"NIXL_BACKENDS": json.dumps([spec.model_dump()]), "FI_PROVIDER": "tcp"}
    _, d_report, _, d_log = transfer([], [], "127.0.0.1", free_port(), env)
    assert d_report["bytes_ok"], (d_report, d_log[-2000:])


def test_unknown_backend_is_refused_with_the_plugins_found():
    import torch

    from splitserve.transfer.agent import BackendUnavailableError, KVAgent, NixlBackend
    from splitserve.transfer.layout import kv_layout_from_tensors

    cache = [torch.zeros(2, 4, 2, 16, 8)]
    with pytest.raises(BackendUnavailableError, match=r"'NOPE' is unknown here.*UCX"):
        KVAgent(
            "nope-probe", kv_layout_from_tensors(cache, 4, 16), backends=[NixlBackend(name="NOPE")]
        )


def test_auto_direction_pushes_to_another_host_and_pulls_on_the_same_one(bed):
    """``direction: auto`` per receiver, from the host identity in its HELLO: P's own UCX_TLS
    allows cma (its default is pull, the same-host choice), yet it pushes to D on another host;
    beside it on one host (UCX_TLS unset: cma), P pulls."""
    env = {
        "DIRECTION": "auto",
        "SPLITSERVE_LOG": "INFO",
        "UCX_PROTO_INFO": "y",
        **bed["d"].ucx_env(),
    }
    p_end, d_report, p_log, _ = transfer(
        bed["p"].argv([]),
        bed["d"].argv([]),
        bed["p"].address,
        7802,
        env,
        p_env={"UCX_TLS": "tcp,cma"},
    )
    assert d_report["bytes_ok"], d_report
    assert p_end["stats"]["writes_posted"] > 0 and d_report["reads_posted"] == 0
    assert ": push over tcp" in p_log
    # (Which UCX transport carried it is UCX's choice from P's UCX_TLS: with cma allowed on P
    # alone, UCX still writes into D's namespace by cma; hence Host.ucx_env on every host.)

    p_end, d_report, p_log, _ = transfer(
        ["env", "-u", "UCX_TLS"],
        ["env", "-u", "UCX_TLS"],
        "127.0.0.1",
        free_port(),
        {"DIRECTION": "auto", "SPLITSERVE_LOG": "INFO"},
    )
    assert d_report["bytes_ok"], d_report
    assert d_report["reads_posted"] > 0 and p_end["stats"]["writes_posted"] == 0
    assert ": pull over cma" in p_log
