"""What SplitserveConnector's scheduler half tells its worker half, once per engine step.

Built in the engine-core process by ``scheduler.py`` (``build_connector_meta``), consumed in the
worker process by ``worker.py`` (``bind_connector_metadata``). Plain dataclasses: vLLM pickles the
object across the process boundary. ``SplitserveWorkerMetadata`` goes the other way (worker ->
scheduler half, through ``KVConnectorOutput.kv_connector_worker_meta``).

Invariants:
- Every list is in the order the scheduler decided it; the worker applies starts before steps.
- A request appears in ``produce_start`` in the same metadata as its first ``produce_steps``
  entry (allocation and first scheduling happen in the same ``schedule()`` call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ProduceStart:
    """P: a request whose KV goes to a D under ``transfer_id``."""

    req_id: str
    transfer_id: str
    num_prompt_tokens: int
    decode_tp_size: int | None = None  # D's size when the params say it (else the setting)


@dataclass
class ProduceStep:
    """P: this step computes the request's tokens up to ``computed_after_step``."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    computed_after_step: int


@dataclass
class ProduceEnd:
    """P: the engine finished the request (``finished``) or dropped it (``cancel_reason``).

    ``holds_blocks``: the engine kept the request's blocks for us (``request_finished`` returned
    True); the worker must report the request in ``finished_sending`` once the transfer settles.
    """

    req_id: str
    transfer_id: str
    holds_blocks: bool
    cancel_reason: str | None = None
    first_token: int | None = None  # the output token P sampled (sent to a D that asks)


@dataclass
class ReceiveStart:
    """D: register ``block_ids`` (D's, for logical blocks from ``token_offset // B``) with P,
    at P's side channel (``kv_transfer_params``' ``remote_host`` / ``remote_port``)."""

    req_id: str
    transfer_id: str
    side_channel_host: str
    side_channel_port: int
    block_ids: list[int]
    token_offset: int
    first_token: bool = False  # ask P for its first output token with DONE
    remote_tp_size: int | None = None  # P's tensor parallel size (None: the same as ours)


@dataclass
class ReceiveRelease:
    """D: we need none of P's blocks for this transfer (full local hit, or aborted early)."""

    transfer_id: str
    side_channel_host: str
    side_channel_port: int
    remote_tp_size: int | None = None  # P's tensor parallel size (None: the same as ours)


@dataclass
class ReceiveAbort:
    """D: the request waiting for this transfer was aborted."""

    req_id: str
    transfer_id: str


@dataclass
class SplitserveConnectorMetadata(KVConnectorMetadata):
    produce_start: list[ProduceStart] = field(default_factory=list)
    produce_steps: list[ProduceStep] = field(default_factory=list)
    produce_end: list[ProduceEnd] = field(default_factory=list)
    receive_start: list[ReceiveStart] = field(default_factory=list)
    receive_release: list[ReceiveRelease] = field(default_factory=list)
    receive_abort: list[ReceiveAbort] = field(default_factory=list)
    receive_fail: list[str] = field(default_factory=list)  # D req_ids to report failed at once


@dataclass
class SplitserveWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker half tells the scheduler half, per step (worker -> engine core).

    ``first_tokens``: req_id -> P's first output token, for D requests whose load completed
    in this step (reported in the same step as ``finished_recving``). With several workers
    (tensor parallel), vLLM merges the workers' objects with ``aggregate``; every worker of a
    request receives the same token.
    """

    first_tokens: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SplitserveWorkerMetadata)
        return SplitserveWorkerMetadata({**self.first_tokens, **other.first_tokens})
