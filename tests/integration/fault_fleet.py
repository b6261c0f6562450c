"""How test_fault_matrix.py's servers start (its docstring says what each is for), in a module
of their own so that the pool's start-ahead (tests/integration/starters.py) starts them the
same way while the module before it runs. ``start`` adds them to the session's group without
waiting and returns their keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cpu_placement import UNPINNED
from session_keys import test_key_file as key_file

from splitserve.models import build_model, resolve_spec
from splitserve.netutil import free_ports
from splitserve.transfer.auth import write_key_file

# The tiny preset, wider: 4 layers of hidden 512 and MLP 2048 (about 4x the tiny model's
# compute per token), KV 4 KiB per token as the tiny model's.
FAULT_MODEL = dict(hidden_size=512, intermediate_size=2048, num_heads=8, num_kv_heads=2)
LEASE_S = 8.0
KEYS = ("fm-p1", "fm-p2", "fm-d", "fm-dx")
BAD_D = "fm-dx"  # a D whose deployment key no P accepts: every KV load fails, so every
# disaggregated request to it ends in HTTP 500 (vLLM's kv_load_failure_policy "fail")
EXTRA_ARGS = ["--max-model-len", "4096", "--max-num-batched-tokens", "512"]
# (direction, core). One core each for p1 and D; p2 (the other pair's P, idle most of the
# time) is not pinned: pinned beside D, the two engines' OpenMP threads shared one core and
# p2's side channel missed its 5 s handshake and heartbeat bounds (docs/connector-protocol.md).
# The bad D (idle but for its failed loads) is not pinned either.
LAYOUT: dict[str, tuple[str, int | None]] = {
    "fm-p1": ("pull", 0),
    "fm-p2": ("push", None),
    "fm-d": ("auto", 1),
    BAD_D: ("auto", None),
}


def kv_config(side_port: int, direction: str, auth_key_file: str) -> dict[str, Any]:
    return {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "side_channel_port": side_port,
            "auth_key_file": auth_key_file,
            "direction": direction,
            "lease_s": LEASE_S,
            "done_timeout_s": 60,
        },
    }


def model(tmp_path_factory: Any) -> Path:
    """``FAULT_MODEL``, built once per session (in the session's base temp directory)."""
    path = Path(tmp_path_factory.getbasetemp()) / "fault-model"
    if not (path / "splitserve-model.json").exists():  # written last
        build_model(resolve_spec("tiny", **FAULT_MODEL), path)
    return path


def start(servers: Any, tiny_model: Path, tmp_path_factory: Any) -> list[str]:
    """The four servers, those not running yet (``fm-dx`` with a key of its own)."""
    fault_model = model(tmp_path_factory)
    other_key = Path(tmp_path_factory.getbasetemp()) / "fm-dx-auth.key"
    if not other_key.exists():
        write_key_file(other_key, "not-this-fleets-key")
    missing = [key for key in KEYS if key not in servers.group.servers]
    for key, side in zip(missing, free_ports(len(missing)), strict=True):
        direction, core = LAYOUT[key]
        auth = str(other_key) if key == BAD_D else key_file()
        servers.group.add_vllm(
            key,
            str(fault_model),
            served_model_name="tiny",
            kv_transfer_config=kv_config(side, direction, auth),
            extra_args=EXTRA_ARGS,
            cpu_core=core,
            env=UNPINNED if core is None else None,
            in_process_worker=True,  # as the test pool's servers (tests/server_pool.py)
        )
    return list(KEYS)
