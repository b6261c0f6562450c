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

Tensor parallel: one scheduler half for all ranks (vLLM has one engine core). Each rank's
worker gets the same metadata and acts for its rank (``ranks.py``); vLLM reports a request
finished only when every rank did, failed when any did. P's answer carries its size
(``remote_tp_size``; else D's ``prefill_tp_size`` setting, else D's own size); a D that cannot
load from that size (``transfer.tp.tp_mismatch``: D's size must be a multiple of P's) fails
such a request at once, naming both sizes. The workers pass P's size on (``ReceiveStart``):
each D rank dials the P rank holding its heads.
FIRST_TOKEN goes to every rank's side channel (each rank's D waits for it).

P (``do_remote_decode``): the request is announced to the worker with ``ProduceStart``; each
step it is scheduled in adds a ``ProduceStep`` (block table, tokens complete after the step);
``request_finished`` keeps the blocks (``delay_free``), answers ``kv_transfer_params`` naming
this server's side channel, and ends with ``ProduceEnd``. The worker reports the request in
``finished_sending`` when its transfer settled; only then does vLLM free the blocks.

State: one ``_Tracked`` record per request, keyed by vLLM's request id (every hook here gets
the ``Request``), with a ``Phase``; a request's end is the deletion of its record.

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
from dataclasses import dataclass
from enum import Enum
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
from splitserve.connectors.vllm.ranks import Ranks
from splitserve.transfer.messages import FirstToken
from splitserve.transfer.side_channel import PeerRef, SideChannel
from splitserve.transfer.tp import tp_mismatch

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class Phase(Enum):
    """Where a tracked request stands (one ``_Tracked`` record per request id)."""

    REJECTED = "rejected"  # malformed kv_transfer_params, served locally (error logged once)
    # P side
    PRODUCING = "producing"  # its KV streams to D under transfer_id while it runs
    DROPPED = "dropped"  # preempted while producing: transfer cancelled, no new one
    HELD = "held"  # finished; vLLM holds its blocks until the worker reports it sent
    # D side
    LOADING = "loading"  # registered with P; the load is pending
    LOADED = "loaded"  # past allocation, nothing pending (loaded, failed, or nothing to load)
    ABORTING = "aborting"  # finished (aborted) while loading; blocks held until P acknowledged


# Phases in which vLLM holds the request's blocks for us after it finished.
_HOLDING = (Phase.HELD, Phase.ABORTING)


@dataclass
class _Tracked:
    """One request's connector state; ``request_finished`` (or the worker's report for a
    request whose blocks vLLM holds) deletes it."""

    phase: Phase
    request: Request | None = None  # P: its computed tokens; D: to continue from P's token
    transfer_id: str | None = None
    params: ReceiveParams | None = None  # D: P's side channel, what it asked for
    first_token: int | None = None  # D: P's first output token, once the worker reported it


class SplitserveScheduler:
    """The scheduler-side state of one engine (see module docstring)."""

    def __init__(
        self, config: SplitserveConnectorConfig, block_size: int, ranks: Ranks | None = None
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.ranks = ranks or Ranks()
        self.kv_cache_manager: KVCacheManager | None = None
        self._meta = SplitserveConnectorMetadata()
        self._requests: dict[str, _Tracked] = {}  # by vLLM request id
        self._relay: SideChannel | None = None  # P: FIRST_TOKEN to our own side channel
        self._relay_peers: list[PeerRef] = []  # every rank's side channel

    def _phase(self, req_id: str) -> Phase | None:
        tracked = self._requests.get(req_id)
        return None if tracked is None else tracked.phase

    # -- D side --------------------------------------------------------------------------------

    def _receive_params(self, request: Request) -> ReceiveParams | None:
        try:
            return receive_params(request.kv_transfer_params, self.config.allowlist)
        except KVParamsError as exc:
            if request.request_id not in self._requests:
                self._requests[request.request_id] = _Tracked(Phase.REJECTED)
                logger.error(
                    "request %s: malformed kv_transfer_params, serving it locally: %s",
                    request.request_id,
                    exc,
                )
            return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._phase(request.request_id) in (Phase.LOADING, Phase.LOADED):
            return 0, False
        params = self._receive_params(request)
        if params is None:
            return 0, False
        wanted = tokens_to_receive(request.num_prompt_tokens, params.first_token_from_prefill)
        needed = wanted - num_computed_tokens
        return (needed, True) if needed > 0 else (0, False)

    def _prefill_tp(self, params: ReceiveParams) -> int:
        """P's tensor parallel size: its params' word (sequential flow), else the configured
        ``prefill_tp_size`` (concurrent flow: the proxy does not know it), else ours."""
        return params.remote_tp_size or self.config.prefill_tp_size or self.ranks.size

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if self._produce_start(request):
            return
        if self._phase(req_id) in (Phase.LOADING, Phase.LOADED):
            return
        params = self._receive_params(request)
        if params is None:
            return
        tracked = _Tracked(Phase.LOADED, request, params.transfer_id, params)
        self._requests[req_id] = tracked
        first = params.first_token_from_prefill
        mismatch = tp_mismatch(self._prefill_tp(params), self.ranks.size)
        if mismatch is not None:
            logger.error("request %s: failing it: %s", req_id, mismatch)
            self._meta.receive_release.append(_release(params, self._prefill_tp(params)))
            self._meta.receive_fail.append(req_id)
            return
        if first and (request.prompt_token_ids is None or request.max_tokens < 2):
            # No room for a token of D's own after P's (or a prompt of embeddings): fail the
            # load rather than emit a token the client must not get.
            logger.error(
                "request %s: first_token_from_prefill needs a token-id prompt and max_tokens "
                ">= 2 (has %s); failing it",
                req_id,
                request.max_tokens,
            )
            self._meta.receive_release.append(_release(params, self._prefill_tp(params)))
            self._meta.receive_fail.append(req_id)
            return
        if num_external_tokens <= 0:
            # Nothing to load (full local hit, or a 1-token prompt): let P free now.
            self._meta.receive_release.append(_release(params, self._prefill_tp(params)))
            return
        local_tokens = tokens_to_receive(request.num_prompt_tokens, first) - num_external_tokens
        logical = blocks_to_receive(request.num_prompt_tokens, local_tokens, self.block_size, first)
        block_ids = list(blocks.get_block_ids()[0])
        if local_tokens % self.block_size or len(block_ids) < logical.stop:
            raise RuntimeError(
                f"request {req_id}: cannot map {num_external_tokens} external tokens onto "
                f"{len(block_ids)} blocks from token {local_tokens}"
            )
        tracked.phase = Phase.LOADING
        self._meta.receive_start.append(
            ReceiveStart(
                req_id=req_id,
                transfer_id=params.transfer_id,
                side_channel_host=params.remote_host,
                side_channel_port=params.remote_port,
                block_ids=block_ids[logical.start : logical.stop],
                token_offset=local_tokens,
                first_token=first,
                remote_tp_size=self._prefill_tp(params),
            )
        )

    # -- P side --------------------------------------------------------------------------------

    def _produce_start(self, request: Request) -> bool:
        """Track a P-side request on its first allocation; True if it is one."""
        req_id = request.request_id
        phase = self._phase(req_id)
        if phase is Phase.PRODUCING:
            return True
        if phase is Phase.DROPPED:
            return False
        try:
            params = produce_params(request.kv_transfer_params)
        except KVParamsError as exc:
            logger.error("request %s: malformed kv_transfer_params, no transfer: %s", req_id, exc)
            return False
        if params is None:
            return False
        self._requests[req_id] = _Tracked(Phase.PRODUCING, request, params.transfer_id)
        self._meta.produce_start.append(
            ProduceStart(
                req_id, params.transfer_id, request.num_prompt_tokens, params.decode_tp_size
            )
        )
        return True

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> SplitserveConnectorMetadata:
        meta, self._meta = self._meta, SplitserveConnectorMetadata()
        for req_id in scheduler_output.preempted_req_ids or ():
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.phase is Phase.PRODUCING:
                # Its blocks are gone: the transfer cannot be completed from them.
                tracked.phase = Phase.DROPPED
                assert tracked.transfer_id is not None
                meta.produce_end.append(
                    ProduceEnd(req_id, tracked.transfer_id, False, "preempted on prefill")
                )
        if self.kv_cache_manager is not None:
            for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                tracked = self._requests.get(req_id)
                if tracked is None or tracked.phase is not Phase.PRODUCING:
                    continue
                assert tracked.request is not None and tracked.transfer_id is not None
                meta.produce_steps.append(
                    ProduceStep(
                        req_id=req_id,
                        transfer_id=tracked.transfer_id,
                        block_ids=list(self.kv_cache_manager.get_block_ids(req_id)[0]),
                        computed_after_step=tracked.request.num_computed_tokens + num_tokens,
                    )
                )
        return meta

    # -- both ----------------------------------------------------------------------------------

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        tracked = self._requests.get(req_id)
        phase = None if tracked is None else tracked.phase
        if phase in (Phase.LOADING, Phase.LOADED):  # D side
            assert tracked is not None and tracked.transfer_id is not None
            if phase is Phase.LOADING and request.status == RequestStatus.FINISHED_ABORTED:
                # Still waiting for P: the worker aborts and reports it finished receiving
                # once P acknowledged; vLLM holds the blocks until then.
                self._meta.receive_abort.append(ReceiveAbort(req_id, tracked.transfer_id))
                self._requests[req_id] = _Tracked(Phase.ABORTING)
            else:
                del self._requests[req_id]
            return False, None
        if phase is not Phase.PRODUCING:
            params = self._receive_params(request)
            self._requests.pop(req_id, None)
            if params is not None:
                # A D request that ended before it was ever allocated: let P free its blocks.
                self._meta.receive_release.append(_release(params, self._prefill_tp(params)))
            return False, None
        assert tracked is not None and tracked.transfer_id is not None
        transfer_id = tracked.transfer_id
        self._requests[req_id] = _Tracked(Phase.HELD)
        if request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            outputs = request.output_token_ids
            first_token = int(outputs[0]) if outputs else None
            self._meta.produce_end.append(
                ProduceEnd(req_id, transfer_id, True, first_token=first_token)
            )
            if first_token is not None:
                self._send_first_token(transfer_id, first_token)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": transfer_id,
                "remote_host": self.config.side_channel_host,
                "remote_port": self.config.side_channel_port,
                "remote_tp_size": self.ranks.size,
            }
        reason = f"prefill request ended with status {request.status.name}"
        self._meta.produce_end.append(ProduceEnd(req_id, transfer_id, True, reason))
        return True, None

    def _send_first_token(self, transfer_id: str, token: int) -> None:
        """To our own workers' side channels (one per rank), which relay it to D if D asked."""
        if self._relay is None:
            host = self.config.side_channel_host
            connect = "127.0.0.1" if host in ("0.0.0.0", "*", "") else host
            ports = self.ranks.all_ports(self.config.side_channel_port)
            self._relay_peers = [PeerRef(host=connect, port=port) for port in ports]
            self._relay = SideChannel(
                None,
                None,
                self.config.load_auth_key(),
                name="splitserve-first-token",
                connect_timeout_s=self.config.peer_liveness_s,
                liveness_timeout_s=self.config.peer_liveness_s,
            )
        self._relay.receive_connected()  # nothing answers; drop a PeerLost at shutdown
        message = FirstToken(transfer_id=transfer_id, token=token, sampled_wall=time.time())
        for peer in self._relay_peers:
            self._relay.send(peer, message)

    def shutdown(self) -> None:
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, SplitserveWorkerMetadata):
            for req_id, token in worker_meta.first_tokens.items():
                tracked = self._requests.get(req_id)
                if tracked is not None and tracked.phase is Phase.LOADING:
                    tracked.first_token = token
        failed = connector_output.failed_recving or set()
        for req_id in connector_output.finished_sending or ():
            if self._phase(req_id) is Phase.HELD:
                del self._requests[req_id]
        for req_id in connector_output.finished_recving or ():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            if tracked.phase is Phase.ABORTING:
                del self._requests[req_id]
            elif tracked.phase is Phase.LOADING:
                tracked.phase = Phase.LOADED
                assert tracked.params is not None and tracked.request is not None
                continuing = tracked.params.first_token_from_prefill
                token, tracked.first_token = tracked.first_token, None
                if continuing and req_id not in failed:
                    self._continue_from_first_token(tracked.request, token)

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
        return any(tracked.phase in _HOLDING for tracked in self._requests.values())


def _release(params: ReceiveParams, prefill_tp: int) -> ReceiveRelease:
    return ReceiveRelease(params.transfer_id, params.remote_host, params.remote_port, prefill_tp)
