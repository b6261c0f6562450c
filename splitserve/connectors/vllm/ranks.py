"""Tensor parallel ranks: which side channel each rank binds and dials, and what we refuse.

Pure functions (no vLLM import), used by both halves of the connector. The rule
(docs/connector-protocol.md, "Ranks"): a server with tensor parallel size ``t`` runs ``t``
worker processes, and rank ``r`` owns its own NIXL agent and binds its own side channel on
``side_channel_port + r``; rank ``r`` of D dials rank ``r`` of P at ``remote_port + r`` and
exchanges rank ``r``'s KV heads only. ``side_channel_port`` / ``remote_port`` (what the proxy
and ``kv_transfer_params`` carry) stay the server's base port.

Supported: P and D of the same tensor parallel size (any size vLLM itself accepts, replicated
KV heads included: rank ``r`` holds the same heads on both sides). Refused, with both sizes
named: P and D of different sizes (heterogeneous TP is not built), at start-up where the
deployment knows both sizes (``splitserve.config``), at D's scheduler half when
``kv_transfer_params`` say P's size (``remote_tp_size``, which P's answer carries), else at
HELLO (the layouts name their shard, ``transfer.layout.KVLayout.tp_size``). Refused at start-up:
pipeline, context and data parallelism (their ranks would share our ports).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.connectors.vllm.config import ConnectorConfigError

MAX_PORT = 65535


@dataclass(frozen=True)
class Ranks:
    """This engine's tensor parallel size, and the rank of this process (0 in the engine core)."""

    size: int = 1
    rank: int = 0

    def port(self, base_port: int, rank: int | None = None) -> int:
        """The side channel of ``rank`` (default: ours) of a server whose base port is
        ``base_port``."""
        return base_port + (self.rank if rank is None else rank)

    def all_ports(self, base_port: int) -> list[int]:
        return [base_port + r for r in range(self.size)]


def check_parallel(
    *,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
    data_parallel: int = 1,
    decode_context_parallel: int = 1,
    prefill_context_parallel: int = 1,
    side_channel_port: int,
) -> Ranks:
    """The engine's ``Ranks`` template (rank 0), or ``ConnectorConfigError`` naming what we
    cannot serve."""
    others = {
        "pipeline parallel": pipeline_parallel,
        "data parallel": data_parallel,
        "decode context parallel": decode_context_parallel,
        "prefill context parallel": prefill_context_parallel,
    }
    for what, size in others.items():
        if size != 1:
            raise ConnectorConfigError(
                f"SplitserveConnector: {what} size {size} is not supported (tensor parallel "
                "only: one side channel port per tensor parallel rank)"
            )
    last = side_channel_port + tensor_parallel - 1
    if last > MAX_PORT:
        raise ConnectorConfigError(
            f"SplitserveConnector: side_channel_port {side_channel_port} with tensor parallel "
            f"size {tensor_parallel} needs ports up to {last} (one per rank), past {MAX_PORT}"
        )
    return Ranks(size=tensor_parallel)
