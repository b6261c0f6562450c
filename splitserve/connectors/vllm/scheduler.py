"""SplitserveConnector, scheduler half: bookkeeping in vLLM's engine-core process.

No NIXL here: this half decides, from each request's ``kv_transfer_params`` and the scheduler's
state, what the worker half must do, and says it through one ``SplitserveConnectorMetadata`` per
step. Its one socket: P's first output tokens, sent as ``FIRST_TOKEN`` to this server's own side
channel the moment the scheduler sees them (``request_finished``), which relays them to the D
that asked; the metadata would bring them to the worker only with the next step.

D (``do_remote_prefill``): ``get_num_new_matched_tokens`` answers "all prompt tokens but the
last, minus my own prefix hit, loaded asynchronously"; ``update_state_after_alloc`` turns the
allocated blocks into a ``ReceiveStart`` (the worker registers them with P). A request aborted
while waiting becomes a ``ReceiveAbort``; the engine frees its blocks once the worker reports
it finished receiving (after P acknowledged).

D with ``first_token_from_prefill``: the answer is "all prompt tokens", and P's first output
token comes back with DONE (worker -> here through ``SplitserveWorkerMetadata``). When the load
completes, ``update_connector_output`` (which vLLM calls before it moves the request out of
WAITING_FOR_REMOTE_KVS) makes the token the last token of the request's prompt, as vLLM's own
streaming-input sessions do, and takes one from ``max_tokens``: the request then has one token
more than is computed, so vLLM computes only that token's position and samples the request's
second token. The client's first token is P's (the proxy streams it); D never recomputes a
prompt token. A load without its token, or a request without room for a second token, fails.

P (``do_remote_decode``): the request is announced to the worker with ``ProduceStart``; each
step it is scheduled in adds a ``ProduceStep`` (block table, tokens complete after the step);
``request_finished`` keeps the blocks (``delay_free``), answers ``kv_transfer_params`` naming
this server's side channel, and ends with ``ProduceEnd``. The worker reports the request in
``finished_sending`` when its transfer settled; only then does vLLM free the blocks.

Invariants:
- ``get_num_new_matched_tokens`` has no side effects (vLLM may call it repeatedly).
- Every request we asked vLLM to hold blocks for is tracked until the worker releases it, and
  ``has_pending_push_work`` stays true until then, so the engine keeps stepping.
- Malformed params never raise into the engine: the request is served locally, with an error
  log line naming the problem.
- A ``first_token_from_prefill`` request either continues from P's token or fails its load; it
  never samples a first token of its own (the client already has P's).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from splitserve.connectors.vllm.config import SplitserveConnectorConfig
from splitserve.connectors.vllm.metadata import (
    ProduceEnd,
    ProduceStart,
    ProduceStep,
    ReceiveAbort,
    ReceiveRelease,
    ReceiveStart,
    SplitserveConnectorMetadata,
    SplitserveWorkerMetadata,
)
from splitserve.connectors.vllm.params import (
    KVParamsError,
    ReceiveParams,
    blocks_to_receive,
    produce_params,
    receive_params,
    tokens_to_receive,
)
from splitserve.transfer.messages import FirstToken, key_bytes
from splitserve.transfer.side_channel import PeerRef, SideChannel

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SplitserveScheduler:
    """The scheduler-side state of one engine (see module docstring)."""

    def __init__(self, config: SplitserveConnectorConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.kv_cache_manager: KVCacheManager | None = None
        self._meta = SplitserveConnectorMetadata()
        # D side
        self._receiving: dict[str, ReceiveParams] = {}  # req_id -> P, while a load is pending
        self._receive_started: set[str] = set()
        self._rejected_params: set[str] = set()
        # first_token_from_prefill: req_id -> request while its load runs; tokens that came
        self._continuing: dict[str, Request] = {}
        self._first_tokens: dict[str, int] = {}
        # P side
        # req_id -> (transfer_id, request), while the request runs
        self._producing: dict[str, tuple[str, Request]] = {}
        self._held: set[str] = set()  # req_ids whose blocks vLLM holds for us
        self._dropped: set[str] = set()  # preempted producers: their transfer was cancelled
        self._aborting: set[str] = set()  # D requests aborted while waiting, not yet released
        self._relay: SideChannel | None = None  # P: FIRST_TOKEN to our own side channel
        self._relay_peer: PeerRef | None = None

    # -- D side --------------------------------------------------------------------------------

    def _receive_params(self, request: Request) -> ReceiveParams | None:
        try:
            return receive_params(request.kv_transfer_params)
        except KVParamsError as exc:
            if request.request_id not in self._rejected_params:
                self._rejected_params.add(request.request_id)
                logger.error(
                    "request %s: malformed kv_transfer_params, serving it locally: %s",
                    request.request_id,
                    exc,
                )
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.request_id in self._receive_started:
            return 0, False
        params = self._receive_params(request)
        if params is None:
            return 0, False
        wanted = tokens_to_receive(request.num_prompt_tokens, params.first_token_from_prefill)
        needed = wanted - num_computed_tokens
        return (needed, True) if needed > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if self._produce_start(request):
            return
        if req_id in self._receive_started:
            return
        params = self._receive_params(request)
        if params is None:
            return
        self._receive_started.add(req_id)
        first = params.first_token_from_prefill
        if first and (request.prompt_token_ids is None or request.max_tokens < 2):
            # No room for a token of D's own after P's (or a prompt of embeddings): fail the
            # load rather than emit a token the client must not get.
            logger.error(
                "request %s: first_token_from_prefill needs a token-id prompt and max_tokens "
                ">= 2 (has %s); failing it",
                req_id,
                request.max_tokens,
            )
            self._meta.receive_release.append(
                ReceiveRelease(params.transfer_id, params.remote_host, params.remote_port)
            )
            self._meta.receive_fail.append(req_id)
            return
        if num_external_tokens <= 0:
            # Nothing to load (full local hit, or a 1-token prompt): let P free now.
            self._meta.receive_release.append(
                ReceiveRelease(params.transfer_id, params.remote_host, params.remote_port)
            )
            return
        local_tokens = tokens_to_receive(request.num_prompt_tokens, first) - num_external_tokens
        logical = blocks_to_receive(request.num_prompt_tokens, local_tokens, self.block_size, first)
        block_ids = list(blocks.get_block_ids()[0])
        if local_tokens % self.block_size or len(block_ids) < logical.stop:
            raise RuntimeError(
                f"request {req_id}: cannot map {num_external_tokens} external tokens onto "
                f"{len(block_ids)} blocks from token {local_tokens}"
            )
        self._receiving[req_id] = params
        if first:
            self._continuing[req_id] = request
        self._meta.receive_start.append(
            ReceiveStart(
                req_id=req_id,
                transfer_id=params.transfer_id,
                remote_host=params.remote_host,
                remote_port=params.remote_port,
                block_ids=block_ids[logical.start : logical.stop],
                token_offset=local_tokens,
                first_token=first,
            )
        )

    # -- P side --------------------------------------------------------------------------------

    def _produce_start(self, request: Request) -> bool:
        """Track a P-side request on its first allocation; True if it is one."""
        req_id = request.request_id
        if req_id in self._producing:
            return True
        if req_id in self._dropped:
            return False
        try:
            params = produce_params(request.kv_transfer_params)
        except KVParamsError as exc:
            logger.error("request %s: malformed kv_transfer_params, no transfer: %s", req_id, exc)
            return False
        if params is None:
            return False
        self._producing[req_id] = (params.transfer_id, request)
        self._meta.produce_start.append(
            ProduceStart(req_id, params.transfer_id, request.num_prompt_tokens)
        )
        return True

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> SplitserveConnectorMetadata:
        meta, self._meta = self._meta, SplitserveConnectorMetadata()
        preempted = scheduler_output.preempted_req_ids or set()
        for req_id in list(self._producing):
            if req_id in preempted:
                # Its blocks are gone: the transfer cannot be completed from them.
                tid, _ = self._producing.pop(req_id)
                self._dropped.add(req_id)
                meta.produce_end.append(ProduceEnd(req_id, tid, False, "preempted on prefill"))
        if self._producing and self.kv_cache_manager is not None:
            for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                entry = self._producing.get(req_id)
                if entry is None:
                    continue
                tid, request = entry
                meta.produce_steps.append(
                    ProduceStep(
                        req_id=req_id,
                        transfer_id=tid,
                        block_ids=list(self.kv_cache_manager.get_block_ids(req_id)[0]),
                        computed_after_step=request.num_computed_tokens + num_tokens,
                    )
                )
        return meta

    # -- both ----------------------------------------------------------------------------------

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        if req_id in self._receive_started:  # D side
            self._receive_started.discard(req_id)
            self._continuing.pop(req_id, None)
            self._first_tokens.pop(req_id, None)
            params = self._receiving.pop(req_id, None)
            if params is not None and request.status == RequestStatus.FINISHED_ABORTED:
                # Still waiting for P: the worker aborts and reports it finished receiving
                # once P acknowledged; vLLM holds the blocks until then.
                self._meta.receive_abort.append(ReceiveAbort(req_id, params.transfer_id))
                self._aborting.add(req_id)
            return False, None
        if req_id not in self._producing:
            self._dropped.discard(req_id)
            params = self._receive_params(request)
            self._rejected_params.discard(req_id)
            if params is not None:
                # A D request that ended before it was ever allocated: let P free its blocks.
                self._meta.receive_release.append(
                    ReceiveRelease(params.transfer_id, params.remote_host, params.remote_port)
                )
            return False, None
        tid, _ = self._producing.pop(req_id)
        self._held.add(req_id)
        if request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            outputs = request.output_token_ids
            first_token = int(outputs[0]) if outputs else None
            self._meta.produce_end.append(ProduceEnd(req_id, tid, True, first_token=first_token))
            if first_token is not None:
                self._send_first_token(tid, first_token)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": tid,
                "remote_host": self.config.side_channel_host,
                "remote_port": self.config.side_channel_port,
            }
        reason = f"prefill request ended with status {request.status.name}"
        self._meta.produce_end.append(ProduceEnd(req_id, tid, True, reason))
        return True, None

    def _send_first_token(self, transfer_id: str, token: int) -> None:
        """To our own worker's side channel, which relays it to D if D asked for it."""
        if self._relay is None:
            host = self.config.side_channel_host
            connect = "127.0.0.1" if host in ("0.0.0.0", "*", "") else host
            self._relay_peer = PeerRef(host=connect, port=self.config.side_channel_port)
            self._relay = SideChannel(
                None, None, key_bytes(self.config.auth_key), name="splitserve-first-token"
            )
        self._relay.receive_connected()  # nothing answers; drop a PeerLost at shutdown
        self._relay.send(
            self._relay_peer,
            FirstToken(transfer_id=transfer_id, token=token, sampled_wall=time.time()),
        )

    def shutdown(self) -> None:
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, SplitserveWorkerMetadata):
            self._first_tokens.update(worker_meta.first_tokens)
        failed = connector_output.failed_recving or set()
        for req_id in connector_output.finished_sending or ():
            self._held.discard(req_id)
        for req_id in connector_output.finished_recving or ():
            self._receiving.pop(req_id, None)
            self._aborting.discard(req_id)
            request = self._continuing.pop(req_id, None)
            token = self._first_tokens.pop(req_id, None)
            if request is not None and req_id not in failed:
                self._continue_from_first_token(request, token)

    def _continue_from_first_token(self, request: Request, token: int | None) -> None:
        """D: the load of every prompt token completed; P's first output token becomes the
        prompt's last token (vLLM then computes only its position and samples token 2)."""
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return  # finished meanwhile (aborted): nothing to continue
        if token is None:
            # The worker reports such a load as failed; reaching here is a bug. Without the
            # token vLLM recomputes the last prompt token and samples token 1 again.
            logger.error("request %s: KV loaded without P's first token", request.request_id)
            return
        assert request.prompt_token_ids is not None
        # A new list: the engine-core request may share the old one with other structures.
        request.prompt_token_ids = [*request.prompt_token_ids, token]
        request._all_token_ids.append(token)  # noqa: SLF001 - what Request.append_* do
        request.num_prompt_tokens += 1
        request.max_tokens -= 1
        request.update_block_hashes()

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while blocks wait for the worker: P's held requests, and
        # D's aborted requests whose blocks vLLM frees only once we report them.
        return bool(self._held or self._aborting)
