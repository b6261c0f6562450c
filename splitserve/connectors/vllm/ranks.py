"""Tensor parallel ranks: which side channel each rank binds and dials, and what we refuse.

Pure functions (no vLLM import), used by both halves of the connector. The rule
(docs/connector-protocol.md, "Ranks"): a server with tensor parallel size ``t`` runs ``t``
worker processes, and rank ``r`` owns its own NIXL agent and binds its own side channel on
``side_channel_port + r``; rank ``j`` of D dials the P rank(s) holding its KV heads
(``source_ranks``) at ``remote_port`` plus that rank and exchanges those heads only.
``side_channel_port`` / ``remote_port`` (what the proxy and ``kv_transfer_params`` carry) stay
the server's base port.

Supported (``transfer.tp.tp_mismatch``): sizes where one is a multiple ``k`` of the other and
the KV heads divide. Equal sizes: rank ``r`` with rank ``r``, the plain transfer id. D wider: D
rank ``j`` dials P rank ``j // k``, which holds its heads; P rank ``i`` feeds the ``k`` D ranks
``fed_ranks`` names, one share each (``share_id``: ``<id>@d<j>``), and frees the request's
blocks once every share settled. P wider: D rank ``j`` dials the ``k`` P ranks from ``j * k``
(each holds part of its heads, a sub-run of its blocks), one share each (``<id>@p<i>``), and
its load completes when every share arrived, fails when any failed. Replicated KV heads (fewer
than the TP size) included: a P rank that only repeats a head another rank sends feeds nobody.
Refused, with both sizes named: sizes neither a multiple of the other, heads that do not
divide; at start-up where both sizes are known (``splitserve.config``; the settings
``prefill_tp_size`` / ``decode_tp_size``, ``check_parallel``), at D's scheduler half, else at
HELLO (the layouts name their shard and heads, ``transfer.tp.exchange_slices``). Refused at
start-up: pipeline, context and data parallelism (their ranks would share our ports).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from splitserve.connectors.vllm.config import ConnectorConfigError
from splitserve.transfer.messages import MAX_ID_CHARS
from splitserve.transfer.tp import heads_of_rank, tp_mismatch

MAX_PORT = 65535


@dataclass(frozen=True)
class Ranks:
    """This engine's tensor parallel size, and the rank of this process (0 in the engine core)."""

    size: int = 1
    rank: int = 0
    total_kv_heads: int = 0  # the model's KV heads (0: unknown), for the layout's heads

    def port(self, base_port: int, rank: int | None = None) -> int:
        """The side channel of ``rank`` (default: ours) of a server whose base port is
        ``base_port``."""
        return base_port + (self.rank if rank is None else rank)

    def all_ports(self, base_port: int) -> list[int]:
        return [base_port + r for r in range(self.size)]


def source_ranks(
    prefill_tp: int, decode_tp: int, decode_rank: int, total_kv_heads: int = 0
) -> list[int]:
    """The prefill ranks whose side channels decode rank ``decode_rank`` dials, each for its
    own share of the request. Equal sizes: the same rank; D wider (``decode_tp = k *
    prefill_tp``): rank ``decode_rank // k``, which holds all its heads (also with replicated
    heads: ``transfer.tp``); P wider (``prefill_tp = k * decode_tp``): the ``k`` ranks from
    ``decode_rank * k``, whose heads make up its own, less those that only repeat a head an
    earlier one holds (replicated heads on P: ``total_kv_heads`` says so). ``ValueError`` for
    a combination ``tp_mismatch`` refuses on size alone."""
    problem = tp_mismatch(prefill_tp, decode_tp)
    if problem is not None:
        raise ValueError(problem)
    if not 0 <= decode_rank < decode_tp:
        raise ValueError(f"decode rank {decode_rank} outside tensor parallel size {decode_tp}")
    if decode_tp >= prefill_tp:
        return [decode_rank // (decode_tp // prefill_tp)]
    k = prefill_tp // decode_tp
    candidates = range(decode_rank * k, (decode_rank + 1) * k)
    if not total_kv_heads or total_kv_heads >= prefill_tp:
        return list(candidates)
    chosen, seen = [], set()
    for rank in candidates:
        first = heads_of_rank(total_kv_heads, prefill_tp, rank).start
        if first not in seen:
            seen.add(first)
            chosen.append(rank)
    return chosen


def fed_ranks(
    prefill_tp: int, decode_tp: int, prefill_rank: int, total_kv_heads: int = 0
) -> list[int]:
    """The decode ranks prefill rank ``prefill_rank`` feeds (the inverse of ``source_ranks``):
    one at equal sizes and when P is wider (none for a rank that only repeats replicated
    heads), ``decode_tp // prefill_tp`` when D is wider."""
    if not 0 <= prefill_rank < prefill_tp:
        raise ValueError(f"prefill rank {prefill_rank} outside tensor parallel size {prefill_tp}")
    return [
        j
        for j in range(decode_tp)
        if prefill_rank in source_ranks(prefill_tp, decode_tp, j, total_kv_heads)
    ]


def share_id(
    transfer_id: str, prefill_tp: int, decode_tp: int, decode_rank: int, prefill_rank: int
) -> str:
    """The transfer id decode rank ``decode_rank`` registers with prefill rank
    ``prefill_rank``: its own share of the request, so each sender and receiver keeps one
    transfer per share (D wider: a prefill rank feeds several decode ranks, named by the
    decode rank; P wider: a decode rank loads from several prefill ranks, named by the
    prefill rank); at equal sizes the id itself (what a peer without TP expects)."""
    if decode_tp == prefill_tp:
        return transfer_id
    suffix = f"@d{decode_rank}" if decode_tp > prefill_tp else f"@p{prefill_rank}"
    if len(transfer_id) + len(suffix) <= MAX_ID_CHARS:
        return transfer_id + suffix
    # An id near the limit: both sides derive the same shorter one from it.
    return hashlib.sha256(transfer_id.encode()).hexdigest() + suffix


def check_parallel(
    *,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
    data_parallel: int = 1,
    decode_context_parallel: int = 1,
    prefill_context_parallel: int = 1,
    side_channel_port: int,
    total_kv_heads: int = 0,
    prefill_tp_size: int | None = None,
    decode_tp_size: int | None = None,
) -> Ranks:
    """The engine's ``Ranks`` template (rank 0), or ``ConnectorConfigError`` naming what we
    cannot serve: also the peers' sizes the settings name (``prefill_tp_size``: the Ps this
    server loads from as D, ``decode_tp_size``: the Ds it feeds as P)."""
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
    heads = total_kv_heads or None
    pairs = [(prefill_tp_size or tensor_parallel, tensor_parallel, "prefill_tp_size")]
    pairs.append((tensor_parallel, decode_tp_size or tensor_parallel, "decode_tp_size"))
    for prefill, decode, setting in pairs:
        problem = tp_mismatch(prefill, decode, heads)
        if problem is not None:
            raise ConnectorConfigError(f"SplitserveConnector ({setting}): {problem}")
    return Ranks(size=tensor_parallel, total_kv_heads=total_kv_heads)
