"""The discrete-event loop: arrivals, the proxy's routing, P->D handoffs, engine steps.

Pure Python, one core; runs in the simulating process. One ``heapq`` of ``(time, seq, kind,
object)`` events: the next arrival (one at a time, read from the request columns), each busy
server's step end, each handoff's landing on D. What the proxy decides is decided by the
proxy's own code:

- routing: ``splitserve.proxy.routing`` pools of ``Backend`` objects (one per simulated
  server, ``outstanding`` kept as the proxy keeps it: from dispatch to the end of that server's
  part), each pool's policy (``least_outstanding``, ``power_of_two``, ``round_robin``) choosing
  among them, and the consistent-hash ring for prefix affinity. Health checks and ejections
  are left out (no server fails here), so the policy and the ring are called directly rather
  than through ``Pool.pick``, whose health bookkeeping costs O(servers) per request;
- the per-request rule: ``splitserve.proxy.decide`` through ``decider.ProxyDecider``;
- the budget: ``splitserve.schedulers.policy.BudgetPolicy`` inside each adaptive server.

The handoff uses the planner's formulas (``handoff.transfer_seconds``,
``handoff.exposed_streaming_seconds``): bulk exposes the whole transfer; layer-wise exposes the
last chunk's streaming tail, or, if the link is slower than the whole prefill, the rest of the
whole transfer. Each P->D pair has its own link (no contention); P keeps the KV until it lands.

Invariants: every request ends, finished or rejected (``Recorder``); events leave in time
order; the same inputs and seed give the same result.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from splitserve.planner.catalog import Accelerator, Link, ModelShape, PlannerInputError
from splitserve.planner.handoff import exposed_streaming_seconds, transfer_seconds
from splitserve.planner.pools import MEMORY_UTILISATION
from splitserve.planner.roofline import weight_bytes_total
from splitserve.planner.sim.decider import ProxyDecider
from splitserve.planner.sim.fleet import COLOCATED, DECODE, PREFILL, Fleet, PoolSpec
from splitserve.planner.sim.metrics import Recorder, RunResult, summarize_class
from splitserve.planner.sim.request import Req
from splitserve.planner.sim.server import Server
from splitserve.planner.sim.steptime import EngineStepModel, MeasuredStepTimer, StepTimer
from splitserve.planner.sim.workload import Requests, Workload
from splitserve.proxy.decide import DecisionSettings
from splitserve.proxy.routing import Backend, Pool, PowerOfTwo
from splitserve.schedulers.policy import BudgetPolicy, BudgetPolicySettings

logger = logging.getLogger(__name__)

_STEP, _ARRIVE, _HANDOFF = 0, 1, 2


class Simulation:
    """One configuration serving one request list (build, then ``run()``)."""

    def __init__(
        self,
        model: ModelShape,
        fleet: Fleet,
        workload: Workload,
        requests: Requests,
        accelerators: Mapping[str, Accelerator],
        link: Link,
        seed: int = 0,
        step_models: Mapping[str, EngineStepModel] | None = None,
    ) -> None:
        self.seed = seed
        self.step_models = dict(step_models or {})
        self.model = model
        self.fleet = fleet
        self.workload = workload
        self.requests = requests
        self.link = link
        self.recorder = Recorder(
            [(c.name, c.ttft_ms / 1e3, c.itl_ms / 1e3) for c in workload.classes],
            workload.itl_metric,
        )
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.servers: list[Server] = []
        self.pools: dict[str, Pool] = {}
        self._rates: dict[str, float] = {}
        itl_ms = min(c.itl_ms for c in workload.classes)
        for spec in fleet.pools:
            if spec.count:
                self._build_pool(spec, accelerators, itl_ms)
        routing = fleet.routing
        self.decider = self._decider() if routing.per_request and fleet.disaggregated else None
        self.layerwise = fleet.link.mode == "layerwise"
        self.ftp = routing.first_token_from_prefill
        self.in_system = 0
        self.area = 0.0
        self.finished = 0
        self.t_end = 0.0
        self.events = 0

    # --- building -----------------------------------------------------------------------

    def _build_pool(
        self, spec: PoolSpec, accelerators: Mapping[str, Accelerator], itl_ms: float
    ) -> None:
        acc = accelerators.get(spec.gpu)
        if acc is None:
            raise PlannerInputError(f"no accelerator figures for pool GPU {spec.gpu!r}")
        st = self.fleet.server
        timer_args: dict[str, Any] = {
            "gpus": spec.gpus,
            "efficiency": st.efficiency,
            "kv_dtype": st.kv_dtype,
            "weight_bytes": st.weight_bytes,
            "overhead_s": st.step_overhead_ms / 1e3,
        }
        measured = self.step_models.get(spec.gpu)
        if measured is not None:
            timer: StepTimer = MeasuredStepTimer(self.model, acc, measured, **timer_args)
        else:
            timer = StepTimer(self.model, acc, **timer_args)
        weights = weight_bytes_total(self.model, st.weight_bytes)
        kv_bytes = timer.mem_bytes * MEMORY_UTILISATION - weights
        kv_cap = int(kv_bytes // timer.kv_bytes_per_token)
        if kv_cap < 1:
            raise PlannerInputError(
                f"{self.model.name} does not fit on {spec.gpus} x {spec.gpu} with room for KV "
                f"({spec.role} pool): give more GPUs per server (--{spec.role}-gpus-per-server)"
            )
        backends = []
        for i in range(spec.count):
            policy = None
            if spec.budget == "adaptive" and spec.role != PREFILL:
                target = st.adaptive_target_itl_ms or itl_ms
                settings = BudgetPolicySettings(
                    target_itl_ms=target,
                    alignment=st.block_size,
                    min_chunk=st.adaptive_min_chunk,
                    share_prefill=st.adaptive_share_prefill,
                )
                policy = BudgetPolicy.create(
                    settings,
                    engine_block_size=st.block_size,
                    engine_max_tokens=st.max_num_batched_tokens,
                )
            srv = Server(
                len(self.servers),
                spec.role,
                timer,
                kv_cap,
                st.max_num_batched_tokens,
                st.max_num_seqs,
                st.prefix_cache_entries,
                policy,
                self,
                chunked=st.chunked_prefill,
                long_prefill_tokens=st.long_prefill_token_threshold,
            )
            backend = Backend(pool=spec.role, url=f"sim://{spec.role}/{i}", settings=srv)
            srv.backend = backend
            srv.gpus = spec.gpus  # KV moves over one link per GPU, each with its share
            self.servers.append(srv)
            backends.append(backend)
        routing = self.fleet.routing
        policy_name = getattr(routing, spec.role)
        affinity = routing.prefix_affinity and spec.role in (PREFILL, COLOCATED)
        pool = Pool(spec.role, backends, policy_name, prefix_affinity=affinity)
        if isinstance(pool.policy, PowerOfTwo):  # seeded: the same run twice is the same run
            pool.policy = PowerOfTwo(rng=random.Random(self.seed + len(self.pools)))
        self.pools[spec.role] = pool
        chunk = st.max_num_batched_tokens
        full = timer.seconds(chunk, chunk * (chunk + 1) // 2, 0, 1)
        self._rates[spec.role] = chunk / full  # prefill tokens per second, alone

    def _decider(self) -> ProxyDecider:
        """The proxy's rule with the fleet's settings; D's prefill cost relative to P's from
        the pools' own step times when the hardware differs and the settings do not say."""
        routing = self.fleet.routing
        update: dict[str, object] = {"block_tokens": self.fleet.server.block_size}
        if routing.decide_threshold_tokens is not None:
            update["threshold_tokens"] = routing.decide_threshold_tokens
        if routing.decide_busy_max_tokens is not None:
            update["busy_max_tokens"] = routing.decide_busy_max_tokens
        if routing.decode_prefill_cost_ratio is not None:
            update["decode_prefill_cost_ratio"] = routing.decode_prefill_cost_ratio
        else:
            update["decode_prefill_cost_ratio"] = self._rates[PREFILL] / self._rates[DECODE]
        return ProxyDecider(DecisionSettings(**update))  # type: ignore[arg-type]

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> RunResult:
        reqs = self.requests
        if not len(reqs):
            raise PlannerInputError("no requests to simulate")
        wall = time.perf_counter()
        heap = self.heap
        heappop = heapq.heappop
        heapq.heappush(heap, (reqs.t[0], next(self.seq), _ARRIVE, 0))
        last = 0.0
        n = len(reqs)
        events = 0
        while heap:
            t, _, kind, obj = heappop(heap)
            self.area += self.in_system * (t - last)
            last = t
            events += 1
            if kind == _STEP:
                obj.end_step(t)  # type: ignore[attr-defined]
            elif kind == _ARRIVE:
                i = obj
                self._arrive(i, t)  # type: ignore[arg-type]
                if i + 1 < n:  # type: ignore[operator]
                    heapq.heappush(heap, (reqs.t[i + 1], next(self.seq), _ARRIVE, i + 1))  # type: ignore[operator]
            else:
                self._handoff_landed(obj, t)  # type: ignore[arg-type]
        self.t_end = last
        self.events = events
        return self._result(time.perf_counter() - wall)

    # --- routing ------------------------------------------------------------------------

    def _pick(self, role: str, key: int) -> Backend:
        pool = self.pools[role]
        if pool.ring is not None and key >= 0:
            return next(iter(pool.ring.walk(str(key))))
        return pool.policy.choose(pool.backends)

    def _reject(self, r: Req) -> None:
        self.recorder.rejected(r.cls)
        self.in_system -= 1
        self.finished += 1

    def _arrive(self, i: int, now: float) -> None:
        q = self.requests
        r = Req(i, q.cls[i], now, q.prompt[i], q.output[i], q.prefix[i], q.prefix_len[i])
        self.in_system += 1
        need = r.prompt + r.output
        if COLOCATED in self.pools:
            b = self._pick(COLOCATED, r.prefix)
            srv: Server = b.settings
            if need > srv.kv_cap:
                self._reject(r)
                return
            b.outstanding += 1
            srv.enqueue(r, now)
            return
        bd = self._pick(DECODE, -1)
        d: Server = bd.settings
        bp = self._pick(PREFILL, r.prefix)
        p: Server = bp.settings
        if need > d.kv_cap or r.prompt > p.kv_cap:
            self._reject(r)
            return
        bd.outstanding += 1
        r.dserver = d
        if self.decider is not None:
            held = r.prefix_len if d.holds_prefix(r.prefix) else 0
            local, reason = self.decider.decide(r.prompt, held, bp.outstanding)
            self.recorder.decided(reason)
            if local:
                self.recorder.local_prefills += 1
                d.enqueue(r, now)
                return
        self.recorder.remote_prefills += 1
        bp.outstanding += 1
        r.pserver = p
        p.enqueue(r, now)

    # --- the handoff --------------------------------------------------------------------

    def prefill_done(self, p: Server, r: Req, now: float, last_chunk: int) -> None:
        """P computed ``r``'s prompt: it keeps the KV until the transfer lands on D."""
        r.held = r.computed
        p.held_tokens += r.held
        if self.ftp and r.first_t < 0:
            r.first_t = r.last_t = now
            r.generated = 1
        timer = p.timer
        links = p.gpus
        whole = transfer_seconds(r.computed * timer.kv_bytes_per_token / links, self.link)
        if self.layerwise:
            layer_x = transfer_seconds(
                last_chunk * timer.kv_bytes_per_token_per_layer / links, self.link
            )
            layer_c = (now - p.step_start) / timer.num_layers
            tail = exposed_streaming_seconds(timer.num_layers, layer_x, layer_c)
            exposed = max(tail, whole - (now - r.prefill_start))
        else:
            exposed = whole
        heapq.heappush(self.heap, (now + exposed, next(self.seq), _HANDOFF, r))

    def _handoff_landed(self, r: Req, now: float) -> None:
        p = r.pserver
        assert p is not None
        p.kv_used -= r.held
        p.held_tokens -= r.held
        r.held = 0
        p.backend.outstanding -= 1
        p.kick(now)
        d = r.dserver
        assert d is not None
        if r.generated >= r.output:  # the one token came from P
            d.backend.outstanding -= 1
            self.request_done(r, now)
            return
        r.ready = True
        r.computed = 0
        r.ctx0 = r.prompt
        r.gen0 = r.generated
        if r.generated:
            r.gap_from = -1  # D's first token: its gap from P's token is recorded
        d.enqueue(r, now)

    # --- the end ------------------------------------------------------------------------

    def request_done(self, r: Req, now: float) -> None:
        self.in_system -= 1
        self.finished += 1
        self.recorder.finished(
            r.cls, r.arrival, r.first_t, r.last_t, r.prompt, r.output, r.max_gap, r.slow
        )

    def _result(self, wall_s: float) -> RunResult:
        rec = self.recorder
        reqs = self.requests
        n = len(reqs)
        window = reqs.t[-1] - reqs.t[0] if n > 1 else 1.0
        per_class = [summarize_class(c) for c in rec.classes]
        attained = sum(c.attained for c in rec.classes)
        peak = max((s.peak_kv / s.kv_cap for s in self.servers), default=0.0)
        latencies = [x for c in rec.classes for x in c.latency]
        return RunResult(
            label=self.fleet.label(),
            rate=(n - 1) / window if n > 1 else 0.0,
            requests=n,
            duration_s=window,
            gpus=self.fleet.gpu_count(),
            cost_per_hour=self.fleet.cost_per_hour(),
            attainment=attained / n,
            per_class=per_class,
            gap_ms={f"p{q}": rec.gaps.percentile(q) * 1e3 for q in (50, 90, 99)},
            preemptions=rec.preemptions,
            decisions=dict(rec.decisions),
            peak_kv_share=peak,
            events=self.events,
            wall_s=wall_s,
            output_tokens=sum(c.output_tokens for c in rec.classes),
            prompt_tokens=sum(c.prompt_tokens for c in rec.classes),
            mean_in_system=self.area / self.t_end if self.t_end else 0.0,
            mean_latency_s=sum(latencies) / len(latencies) if latencies else 0.0,
        )
