"""SGLang rows of the handoff benchmark (``benchmarks/handoff.py`` runs them with its own rows).

Same model preset (``bench``), prompt lengths, fresh random prompts and greedy decoding as the
vLLM rows, on one machine; SGLang servers on the CPU (``splitserve.launch.engines``):

- ``sglang-colocated``: one unified SGLang server (no transfer), the reference;
- ``sglang-splitserve``: a PD pair with ``--disaggregation-transfer-backend splitserve`` (our
  backend: KV pushed per layer while P computes, aux rows and DONE with the last WRITE);
- ``sglang-splitserve-spin``: the same pair with ``SPLITSERVE_SGLANG_IDLE_NAP_MS=0``: P's and
  D's schedulers busy-poll while a request waits on a transfer, as SGLang's loop does (our
  backend's nap between polls, ``splitserve.connectors.sglang.idle``, off);
- ``sglang-splitserve-nap``: the same pair with ``SPLITSERVE_SGLANG_IDLE_CHECK_MS=0``: the
  nap is one 1 ms wait on the scheduler's sockets, which our DONE and REGISTER do not wake
  (the nap before it learned to wake on arrival);
- ``sglang-nixl``: SGLang's own ``nixl`` backend (per chunk, after the forward; on a CPU it
  needs the test environment's shim ``SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM=1``, and its NIXL
  progress thread spins a core, so its servers run niced);
- ``sglang-mooncake-tcp``: SGLang's ``mooncake`` backend over TCP (``MOONCAKE_PROTOCOL=tcp``,
  ``MC_FORCE_TCP=1``; per chunk, after the forward). Needs Mooncake's transfer engine, which the
  optional ``scripts/install_mooncake_cpu.sh VENV`` installs (with ``libibverbs`` unpacked into
  ``VENV/opt/mooncake-deps/lib``, added here to the servers' ``LD_LIBRARY_PATH``); skipped with
  a message otherwise. On a CPU it needs the shim's ``SGLANG_CPU_SHIM_MOONCAKE_HOST_INDICES_OFF=1``.

A PD request goes the way SGLang's router sends it: to P and D at the same time with the same
``bootstrap_room``; D's stream is what the client sees. Per request:

- ``ttft_s``: client send -> first streamed token (D's first token is P's sampled token, which
  D receives in the aux buffers with the KV);
- ``gap_s``: first -> second streamed token (a colocated server: one decode forward; D: two,
  as SGLang's PD decode loop emits P's token before D's first forward and, overlapping, each
  forward's token after the next one ran); ``gap2_s`` (when a third chunk came): second ->
  third (D: one forward; colocated: about 2 ms, its last result needs no further forward);
- ``exposed_s`` (``sglang-splitserve`` only): P's last forward returned -> DONE seen at D, from
  D's log (``splitserve: transfer R received, exposed handoff X s``, R the request's
  ``bootstrap_room``; server timestamps). SGLang's own backends report no such figure: compare
  them by TTFT against ``sglang-colocated``;
- ``room``, ``send_wall``, ``first_wall`` (PD rows): the request's ``bootstrap_room`` and the
  client's wall clock at send and at the first streamed token, for
  ``benchmarks/sglang_timeline.py --rows`` (client points beside the servers' timeline).

Placement (``SPLITSERVE_SGLANG_BENCH_PLACEMENT``, recorded in every row as ``placement``):

- ``cores`` (the default): each server on one core of its own, one compute thread, as the vLLM
  rows run: the colocated server and P on core 0 (they never compute at once: requests
  alternate), D on core 1 (``taskset``, ``OMP_NUM_THREADS=1``). SGLang's PD scheduler loop
  never sleeps while a request is in its queues (``time.sleep(0)`` between polls), so SGLang's
  own backends' D spins its core during P's prefill (ours naps between polls,
  ``SPLITSERVE_SGLANG_IDLE_NAP_MS``); on a core of its own that costs P nothing;
- ``shared``: no pinning, every server with torch's default threads on the whole machine (how
  these rows ran before issue #25): the colocated server computes alone on both cores, while
  P's threads share them with D's spinning scheduler.

Every server's log (with the timeline lines) is copied next to ``--out``, into
``<out stem>-sglang-logs/``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

# One request (handoffbench/sglang_client.py) and the rows' summary and targets
# (handoffbench/sglang_targets.py); the aliased names are re-exported: handoff.py and the tests
# read them here.
from handoffbench.sglang_client import _body, _colocated, _pd
from handoffbench.sglang_client import _gaps as _gaps
from handoffbench.sglang_targets import TTFT_TARGET as TTFT_TARGET
from handoffbench.sglang_targets import relative_to_colocated as relative_to_colocated
from handoffbench.sglang_targets import targets as targets
from handoffbench.sglang_targets import targets_markdown as targets_markdown

from splitserve.launch.group import ServerGroup
from splitserve.netutil import free_ports
from splitserve.transfer.auth import write_key_file

START_TIMEOUT = 900.0
CHUNK = 2048  # as the vLLM rows' --max-num-batched-tokens
NIXL_SPINNER_NICE = 10
PLACEMENTS = ("cores", "shared")
# (colocated, P, D) cores per placement; None: not pinned
CORES: dict[str, tuple[list[int] | None, ...]] = {
    "cores": ([0], [0], [1]),
    "shared": (None, None, None),
}
# where scripts/install_mooncake_cpu.sh unpacks libibverbs & co. (Mooncake links them even for TCP)
MOONCAKE_DEPS = Path(sys.prefix) / "opt" / "mooncake-deps" / "lib"

CONTENDERS = [
    "sglang-colocated",
    "sglang-splitserve",
    "sglang-splitserve-spin",
    "sglang-splitserve-nap",
    "sglang-nixl",
    "sglang-mooncake-tcp",
]
BACKENDS = {
    "sglang-splitserve": ("splitserve", {"SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "900"}, 0),
    # the same without the nap between polls (SGLang's busy poll, as before issue #25)
    "sglang-splitserve-spin": (
        "splitserve",
        {"SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "900", "SPLITSERVE_SGLANG_IDLE_NAP_MS": "0"},
        0,
    ),
    # the 1 ms nap without its checks: DONE and REGISTER seen at the nap's end (before wake-up)
    "sglang-splitserve-nap": (
        "splitserve",
        {"SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "900", "SPLITSERVE_SGLANG_IDLE_CHECK_MS": "0"},
        0,
    ),
    "sglang-nixl": ("nixl", {"SGLANG_CPU_SHIM_NIXL_VRAM_AS_DRAM": "1"}, NIXL_SPINNER_NICE),
    "sglang-mooncake-tcp": (
        "mooncake",
        {
            "SGLANG_CPU_SHIM_MOONCAKE_HOST_INDICES_OFF": "1",
            "MOONCAKE_PROTOCOL": "tcp",
            "MC_FORCE_TCP": "1",
        },
        0,  # an idle mooncake-TCP pair used no CPU (30 s measured): not niced
    ),
}


def available(contenders: list[str]) -> list[str]:
    """The SGLang contenders this environment can run (a message for each one it cannot)."""
    wanted = [c for c in contenders if c in CONTENDERS]
    if not wanted:
        return []
    if importlib.util.find_spec("sglang") is None:
        print("SGLang is not installed: SGLang rows skipped", file=sys.stderr)
        return []
    if "sglang-mooncake-tcp" in wanted and not _mooncake_works():
        wanted.remove("sglang-mooncake-tcp")
    return wanted


def _with_mooncake_deps(env: dict) -> dict:
    """``env`` with the installer's library directory first on ``LD_LIBRARY_PATH`` (if any)."""
    if not MOONCAKE_DEPS.is_dir():
        return env
    rest = env.get("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))
    return env | {"LD_LIBRARY_PATH": f"{MOONCAKE_DEPS}:{rest}" if rest else str(MOONCAKE_DEPS)}


def _mooncake_works() -> bool:
    """Whether SGLang's servers will load Mooncake's transfer engine (says why not)."""
    if importlib.util.find_spec("mooncake") is None:
        print(
            "mooncake-transfer-engine is not installed (optional: "
            "scripts/install_mooncake_cpu.sh VENV): sglang-mooncake-tcp skipped",
            file=sys.stderr,
        )
        return False
    check = subprocess.run(
        [sys.executable, "-c", "from mooncake.engine import TransferEngine"],
        env=_with_mooncake_deps(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check.returncode != 0:
        error = (check.stderr.strip().splitlines() or ["no output"])[-1]
        print(
            f"mooncake.engine does not load ({error}); rerun scripts/install_mooncake_cpu.sh "
            f"{sys.prefix}: sglang-mooncake-tcp skipped",
            file=sys.stderr,
        )
        return False
    return True


def placement() -> str:
    """``SPLITSERVE_SGLANG_BENCH_PLACEMENT`` (``cores`` unless set; see the module docstring)."""
    value = os.environ.get("SPLITSERVE_SGLANG_BENCH_PLACEMENT", "cores").strip() or "cores"
    if value not in PLACEMENTS:
        raise SystemExit(
            f"SPLITSERVE_SGLANG_BENCH_PLACEMENT={value!r}: expected one of {', '.join(PLACEMENTS)}"
        )
    return value


def pinned_env(env: dict, cpus: list[int] | None) -> dict:
    """``env`` for a server on ``cpus``: one OpenMP thread per core (torch's compute threads)."""
    return env if cpus is None else env | {"OMP_NUM_THREADS": str(len(cpus))}


def _server(model: Path, port: int, max_tokens: int, env: dict, **kw):
    from splitserve.launch.engines import sglang_server

    return sglang_server(
        str(model),
        port,
        served_model_name="bench",
        chunked_prefill_size=CHUNK,
        max_total_tokens=max_tokens,
        env=env,
        **kw,
    )


def run(
    *,
    work: Path,
    model: Path,
    transport: str,
    env: dict,
    lengths: list[int],
    repeats: int,
    contenders: list[str],
    rng: random.Random,
    logs_to: Path | None = None,
) -> list[dict]:
    """Every selected SGLang contender on one transport; one row per request. ``logs_to``: where
    the servers' logs are copied when the run ends."""
    rows: list[dict] = []
    max_tokens = max(lengths) + 1024  # one request at a time; 3 servers share the machine
    where = placement()
    colocated_cpus, p_cpus, d_cpus = CORES[where]
    group = ServerGroup(work / f"logs-{transport}-sglang")
    try:
        runs: dict[str, tuple] = {}
        if "sglang-colocated" in contenders:
            (port,) = free_ports(1)
            cmd = _server(model, port, max_tokens, pinned_env(dict(env), colocated_cpus))
            group.add("sglang-colocated", cmd.argv, port=port, env=cmd.env, cpus=colocated_cpus)
            group.wait(START_TIMEOUT, names=["sglang-colocated"])
            url = group.servers["sglang-colocated"].url
            runs["sglang-colocated"] = (lambda b, u=url: _colocated(u, b),)
        for name in [c for c in contenders if c in BACKENDS]:
            backend, backend_env, nice = BACKENDS[name]
            p_port, d_port, bootstrap = free_ports(3)
            server_env = dict(env) | backend_env
            if backend == "mooncake":
                server_env = _with_mooncake_deps(server_env)
            if backend == "splitserve":  # the side channel binds the host's address: keyed
                key = write_key_file(group.log_dir / "secrets" / "auth.key")
                server_env["SPLITSERVE_AUTH_KEY_FILE"] = str(key)
                # the per-request timeline (connectors/sglang/timeline.py) in both logs, for
                # benchmarks/sglang_timeline.py: a few lines per request, none per layer
                server_env["SPLITSERVE_SGLANG_TIMELINE"] = "1"
            common = dict(transfer_backend=backend)
            p = _server(
                model,
                p_port,
                max_tokens,
                pinned_env(server_env, p_cpus),
                mode="prefill",
                bootstrap_port=bootstrap,
                **common,
            )
            d_env = pinned_env(server_env, d_cpus)
            d = _server(model, d_port, max_tokens, d_env, mode="decode", **common)
            group.add(f"{name}-p", p.argv, port=p_port, env=p.env, nice=nice, cpus=p_cpus)
            group.add(f"{name}-d", d.argv, port=d_port, env=d.env, nice=nice, cpus=d_cpus)
            group.wait(START_TIMEOUT, names=[f"{name}-p", f"{name}-d"])
            pair = {
                "p": group.servers[f"{name}-p"].url,
                "d": group.servers[f"{name}-d"].url,
                "bootstrap": bootstrap,
            }
            log = group.log_dir / f"{name}-d.log" if backend == "splitserve" else None
            _pd(pair, _body(64, rng), log)  # warm-up
            for length in lengths:
                for _ in range(repeats):
                    row = {
                        "transport": transport,
                        "contender": name,
                        "length": length,
                        "placement": where,
                    }
                    rows.append(row | _pd(pair, _body(length, rng), log))
                    print(json.dumps(rows[-1]), flush=True)
                    if "sglang-colocated" in runs:  # the reference, interleaved
                        row = row | {"contender": "sglang-colocated", "round": name}
                        rows.append(row | runs["sglang-colocated"][0](_body(length, rng)))
                        print(json.dumps(rows[-1]), flush=True)
            for role in ("p", "d"):  # at most three servers at once
                group.servers.pop(f"{name}-{role}").process.stop()
    finally:
        group.stop()
        if logs_to is not None:
            keep_logs(group.log_dir, logs_to)
    return rows


def keep_logs(log_dir: Path, dest: Path) -> None:
    """The servers' logs (not the key) copied to ``dest``, for ``benchmarks/sglang_timeline.py``."""
    dest.mkdir(parents=True, exist_ok=True)
    for log in sorted(log_dir.glob("*.log")):
        shutil.copy2(log, dest / log.name)
    print(f"SGLang server logs: {dest}", file=sys.stderr)


def rows_for(args, work: Path, model: Path, rng: random.Random) -> list[dict]:
    """The SGLang rows of a ``benchmarks/handoff.py`` run (its parsed arguments)."""
    contenders = available(list(args.contenders))
    rows: list[dict] = []
    for transport in args.transports if contenders else []:
        env = {"UCX_TLS": "tcp"} if transport == "tcp" else {}
        rows += run(
            work=work,
            model=model,
            transport=transport,
            env=env,
            lengths=args.lengths,
            repeats=args.repeats,
            contenders=contenders,
            rng=rng,
            logs_to=Path(args.out).with_name(f"{Path(args.out).stem}-sglang-logs") / transport,
        )
    return rows
