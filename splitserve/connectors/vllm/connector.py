"""SplitserveConnector: the class vLLM instantiates; a thin facade over two role objects.

vLLM builds this class twice: in the engine-core process with role SCHEDULER (every hook
forwards to ``scheduler.SplitserveScheduler``: bookkeeping, no I/O) and in each worker process
with role WORKER (every hook forwards to ``worker.SplitserveWorker``: NIXL, the side channel,
per-layer posting); with tensor parallelism, once per rank, each rank with its own agent and
side channel port (``ranks.py``; vLLM's ``KVOutputAggregator`` reports a request finished only
when every rank did, and failed when any rank did). ``metadata.py`` is what crosses between
them each step, ``stats.py`` what goes to metrics, ``config.py`` the validated
``kv_connector_extra_config``. The protocol itself (messages, states, failure rules) is in
``splitserve.transfer`` and docs/connector-protocol.md.

Select it with ``--kv-transfer-config '{"kv_connector": "SplitserveConnector", "kv_role":
"kv_both", "kv_connector_extra_config": {"side_channel_port": 5701}}'`` once the
``vllm.general_plugins`` entry point registered the name (``splitserve.plugins``), or with
``"kv_connector_module_path": "splitserve.connectors.vllm.connector"``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from splitserve.connectors.vllm.config import parse_connector_config
from splitserve.connectors.vllm.logs import route_logs_to_vllm
from splitserve.connectors.vllm.metadata import SplitserveConnectorMetadata
from splitserve.connectors.vllm.ranks import check_parallel
from splitserve.connectors.vllm.scheduler import SplitserveScheduler
from splitserve.connectors.vllm.stats import SplitserveKVConnectorStats, SplitservePromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads over all ranks (0 when vLLM cannot say, e.g. no model config): the
    layouts describe each rank's share, so a peer of another TP size can address it."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):  # no model config, or a model without heads
        return 0


class SplitserveConnector(KVConnectorBase_V1, SupportsHMA):
    """Layer-wise KV push over NIXL between a prefill and a decode vLLM server."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_logs_to_vllm()
        transfer_config = vllm_config.kv_transfer_config
        self.config = parse_connector_config(transfer_config.kv_connector_extra_config)
        self.config.load_auth_key()  # a missing or unreadable key stops start-up here, clearly
        if kv_cache_config is None:
            raise ValueError("SplitserveConnector needs the KV cache config (vLLM >= 0.32)")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"SplitserveConnector supports models with one KV cache group, this one has "
                f"{len(groups)} (hybrid attention / Mamba layers are not supported yet)"
            )
        block_size = groups[0].kv_cache_spec.block_size
        parallel = vllm_config.parallel_config
        ranks = check_parallel(
            tensor_parallel=parallel.tensor_parallel_size,
            pipeline_parallel=parallel.pipeline_parallel_size,
            data_parallel=parallel.data_parallel_size,
            decode_context_parallel=getattr(parallel, "decode_context_parallel_size", 1),
            prefill_context_parallel=getattr(parallel, "prefill_context_parallel_size", 1),
            side_channel_port=self.config.side_channel_port,
            total_kv_heads=_total_kv_heads(vllm_config),
            prefill_tp_size=self.config.prefill_tp_size,
            decode_tp_size=self.config.decode_tp_size,
        )
        self._scheduler: SplitserveScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SplitserveScheduler(self.config, block_size, ranks)
        else:
            from splitserve.connectors.vllm.worker import SplitserveWorker

            if ranks.size > 1:  # each worker process is one rank (its own agent and port)
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                ranks = dataclasses.replace(ranks, rank=get_tensor_model_parallel_rank())
            self._worker = SplitserveWorker(
                self.config,
                str(transfer_config.engine_id),
                kv_cache_config.num_blocks,
                block_size,
                ranks,
            )

    # -- class-level answers ------------------------------------------------------------------

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between layers; full CUDA graphs would skip it

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # any block-major layout: the transfer layer derives runs from strides

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return SplitserveKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return SplitservePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None
        assert isinstance(connector_metadata, SplitserveConnectorMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # push: P writes into our blocks; nothing to start here

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the request is scheduled (asynchronous load)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failures are reported per request, through failed_recving

    def build_connector_worker_meta(self):
        return self._worker.take_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self):
        return self._worker.stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()
