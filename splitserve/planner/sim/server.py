"""One simulated engine: vLLM-style continuous batching, chunked prefill, KV limits, preemption.

Pure; runs in the simulating process, driven by ``engine.Simulation`` (which owns the clock and
the event queue). A server steps back to back while it has work; each step:

1. **budget**: prefill tokens this step may carry: ``max_num_batched_tokens`` minus one per
   decode (vLLM counts decodes in the budget), or, with the adaptive budget, what
   ``splitserve.schedulers.policy.BudgetPolicy.decide`` answers (the project's own policy, fed
   the step's decodes and pending prompts, and told every executed step through ``observe``);
2. **KV for the decodes**: every running decode writes one token; while they do not fit, the
   most recently admitted running request is preempted (vLLM's FCFS rule): its KV is freed and
   it returns to the head of the queue to recompute its prompt and the tokens it produced;
3. **prefill chunks**: running prompts first (admission order), then waiting requests (FCFS),
   each taking ``min(budget left, tokens left, free KV)`` (and at most vLLM's
   ``long_prefill_token_threshold`` when the fleet sets one); a waiting request is admitted only
   while ``max_num_seqs`` allows and its chunk fits in free KV;
4. the step's time is the roofline (or calibrated) time of what it computes
   (``steptime.StepTimer``), or a step model measured on the served engine
   (``steptime.MeasuredStepTimer``).

Decodes are counted, not iterated: a decode's context and finishing step follow from the step
it joined at, so a step costs O(1 + prompts in it + requests finishing) whatever the batch.
KV is counted in tokens (block rounding left out). A prompt's shared head, when this server
holds it (an LRU of ``prefix_cache_entries`` heads), is not recomputed.

The request record a server schedules (``Req``) is in ``request.py``, shared with the event loop
(``engine.py``); the pool roles (``PREFILL``, ...) are in ``fleet.py``. This module is only the
scheduler of one engine.

Why one module of over 500 lines: it is one class, the scheduler of one engine, whose step
(``start_step``, ``end_step``) is the simulator's hot loop, written inline; its parts (budget,
preemption, admission, steps without chunked prefill, the decode gaps) all read and write the
same per-step state, and what stands apart is already split off (``request.py``, ``fleet.py``,
``steptime.py``, ``metrics.py``).

Invariants (tests/unit/test_sim_engine.py): ``kv_used`` never exceeds ``kv_cap``; between
steps ``kv_used`` equals the decodes' contexts plus the prompts' computed tokens plus the KV
held for handoffs (``held_tokens``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from heapq import heappush
from math import log10
from typing import TYPE_CHECKING, Any

from splitserve.planner.sim.fleet import PREFILL
from splitserve.planner.sim.metrics import BINS_PER_DECADE, MIN_GAP_S, NBINS
from splitserve.planner.sim.request import Req
from splitserve.schedulers.policy import BudgetPolicy, PendingPrefill, StepState
from splitserve.schedulers.step_model import StepFeatures

if TYPE_CHECKING:
    from splitserve.planner.sim.engine import Simulation
    from splitserve.planner.sim.steptime import StepTimer

_PROMPTS_SHOWN_TO_POLICY = 8


class Server:
    """One engine of one pool (see module docstring)."""

    def __init__(
        self,
        sid: int,
        role: str,
        timer: StepTimer,
        kv_cap: int,
        max_tokens: int,
        max_seqs: int,
        prefix_entries: int,
        policy: BudgetPolicy | None,
        sim: Simulation,
        chunked: bool = True,
        long_prefill_tokens: int = 0,
    ) -> None:
        self.sid = sid
        self.chunked = chunked
        # vLLM's long_prefill_token_threshold: no prompt gets more of a step (0: no cap)
        self.prompt_cap = long_prefill_tokens if long_prefill_tokens > 0 else 1 << 62
        self.role = role
        self.timer = timer
        self.kv_cap = kv_cap
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.policy = policy
        self.sim = sim
        self.backend: Any = None  # the proxy's routing.Backend for this server
        self.gpus = 1
        self.busy = False
        self.dstep = 0  # decode steps run so far: decodes' positions count in these
        self.last_dec_end = 0.0
        self.step_start = 0.0
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.decoding: dict[Req, None] = {}
        self.n_dec = 0
        self.sum_ctx = 0
        self.finish: dict[int, list[Req]] = {}
        self.kv_used = 0
        self.held_tokens = 0  # P: KV kept for handoffs in flight
        self.peak_kv = 0
        self.admitted = 0
        self.busy_s = 0.0
        self.steps = 0
        self.prefix_cache: OrderedDict[int, None] = OrderedDict()
        self.prefix_entries = prefix_entries
        self._gap_idx: list[int] = []
        self._gap_val: list[float] = []
        # itl_metric p99: per ITL bound, slow[b][d] = decode steps before step d whose gap
        # exceeded bound b (a request's count over its steps is a difference of two entries)
        rec = sim.recorder
        self._bounds: list[float] = rec.itl_bounds if rec.use_p99 else []
        self._slow: list[list[int]] = [[0] for _ in self._bounds]
        # the step in flight
        self._chunks: list[tuple[Req, int]] = []
        self._fresh: list[Req] = []
        self._dec_in_step = 0
        self._features: StepFeatures | None = None

    # --- queueing -----------------------------------------------------------------------

    def enqueue(self, r: Req, now: float, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)
        if not self.busy:
            self.start_step(now)

    def kick(self, now: float) -> None:
        if not self.busy and (self.waiting or self.prefilling or self.n_dec):
            self.start_step(now)

    def holds_prefix(self, prefix: int) -> bool:
        return prefix >= 0 and prefix in self.prefix_cache

    def _remember_prefix(self, prefix: int) -> None:
        if prefix < 0 or not self.prefix_entries:
            return
        cache = self.prefix_cache
        if prefix in cache:
            cache.move_to_end(prefix)
        else:
            cache[prefix] = None
            if len(cache) > self.prefix_entries:
                cache.popitem(last=False)

    # --- one step -----------------------------------------------------------------------

    def _budget(self) -> tuple[int, int]:
        """(prefill budget, per-prompt cap of the step; 0: none beyond the server's own)."""
        policy = self.policy
        if policy is None:
            return self.max_tokens - self.n_dec, 0
        n, total = self.n_dec, self.sum_ctx
        if n:
            q, rem = divmod(total, n)
            # The decodes' contexts evened out, same count and total: all the policy reads.
            lens = [q + 1] * rem + [q] * (n - rem)
        else:
            lens = []
        shown = [PendingPrefill(r.target - r.computed, r.computed) for r in self.prefilling]
        for r in self.waiting:
            if len(shown) >= _PROMPTS_SHOWN_TO_POLICY:
                break
            if not r.ready:
                shown.append(PendingPrefill(r.target - r.computed, r.computed))
        decision = policy.decide(StepState(lens, shown[:_PROMPTS_SHOWN_TO_POLICY]))
        return decision.prefill_budget, decision.prompt_cap

    def _victim(self) -> Req | None:
        last_dec = next(reversed(self.decoding)) if self.decoding else None
        last_pre = self.prefilling[-1] if self.prefilling else None
        if last_dec is None:
            return last_pre
        if last_pre is None or last_dec.admit > last_pre.admit:
            return last_dec
        return last_pre

    def _preempt(self, r: Req, now: float) -> None:
        """Free ``r``'s KV and queue it first to recompute what it has (vLLM recompute)."""
        self.sim.recorder.preemptions += 1
        if r in self.decoding:
            if 0 <= r.gap_from < self.dstep:
                r.max_gap = max(r.max_gap, self._max_gap_since(r.gap_from))
                if self._bounds:
                    r.slow += self._slow_since(r, r.gap_from, self.dstep)
            r.last_t = now
            ctx = r.ctx0 + (self.dstep - r.step0)
            generated = r.gen0 + (self.dstep - r.step0)
            self._leave_decoding(r)
            self.kv_used -= ctx
            r.generated = generated
            r.target = r.prompt + generated
            r.gap_from = -1  # the next token's gap is the stall, recorded on resume
        else:
            self.prefilling.remove(r)
            self.kv_used -= r.computed
        r.computed = 0
        r.ready = False
        self.waiting.appendleft(r)

    def _leave_decoding(self, r: Req) -> None:
        del self.decoding[r]
        self.n_dec -= 1
        self.sum_ctx -= r.ctx0 + (self.dstep - r.step0)

    def start_step(self, now: float) -> None:
        """Schedule the next step (see module docstring) and queue its end event."""
        n_dec = self.n_dec
        if not self.waiting and not self.prefilling and self.kv_used + n_dec <= self.kv_cap:
            # the common step on a decode server: decodes only, nothing to admit
            if not n_dec:
                self.busy = False
                return
            sum_ctx = self.sum_ctx
            self.kv_used += n_dec
            if self.kv_used > self.peak_kv:
                self.peak_kv = self.kv_used
            self._chunks = []
            self._fresh = []
            self._dec_in_step = n_dec
            self._features = None
            dt = self.timer.seconds(n_dec, sum_ctx + n_dec, sum_ctx, n_dec)
            self.busy = True
            self.step_start = now
            sim = self.sim
            heappush(sim.heap, (now + dt, next(sim.seq), 0, self))
            return
        budget, step_cap = self._budget() if (self.waiting or self.prefilling) else (0, 0)
        preempted = False
        while self.kv_used + self.n_dec > self.kv_cap:
            victim = self._victim()
            if victim is None:
                break
            self._preempt(victim, now)
            preempted = True
        cap = self.kv_cap
        free = cap - self.kv_used - self.n_dec
        if not self.chunked and not preempted and self._whole_prompts(now, free):
            return
        tokens = pairs = kv_read = sampled = 0
        chunks: list[tuple[Req, int]] = []
        fresh: list[Req] = []
        left = budget
        prompt_cap = min(self.prompt_cap, step_cap) if step_cap else self.prompt_cap
        for r in self.prefilling:
            if left <= 0 or free <= 0:
                break
            take = min(left, r.target - r.computed, free, prompt_cap)
            c = r.computed
            chunks.append((r, take))
            tokens += take
            pairs += take * c + take * (take + 1) // 2
            kv_read += c
            if c + take >= r.target:
                sampled += 1
            left -= take
            free -= take
        waiting = self.waiting
        running = self.n_dec + len(self.prefilling)
        # vLLM admits nothing in a step that had to preempt
        while waiting and left > 0 and running < self.max_seqs and free > 0 and not preempted:
            r = waiting[0]
            if r.ready:  # D: the KV arrived; it joins the decodes (one token this step)
                need = r.ctx0 + 1
                if need > free:
                    break
                waiting.popleft()
                self.admitted += 1
                r.admit = self.admitted
                r.step0 = self.dstep
                self.decoding[r] = None
                self.n_dec += 1
                self.sum_ctx += r.ctx0
                self.kv_used += r.ctx0
                self._schedule_finish(r)
                fresh.append(r)
                free -= need
                left -= 1
                running += 1
                continue
            if not self.chunked:
                break  # prompts run in prefill-only steps (_whole_prompts)
            if r.computed == 0 and r.generated == 0 and self.holds_prefix(r.prefix):
                r.computed = min(r.prefix_len, r.target - 1)
                self.kv_used += r.computed
                free -= r.computed
                if free <= 0:
                    self.kv_used -= r.computed
                    r.computed = 0
                    break
            take = min(left, r.target - r.computed, free, prompt_cap)
            waiting.popleft()
            self.admitted += 1
            r.admit = self.admitted
            if r.prefill_start < 0:
                r.prefill_start = now
            self.prefilling.append(r)
            c = r.computed
            chunks.append((r, take))
            tokens += take
            pairs += take * c + take * (take + 1) // 2
            kv_read += c
            if c + take >= r.target:
                sampled += 1
            left -= take
            free -= take
            running += 1
        if not chunks and not self.n_dec:
            if self.prefilling:  # stuck: prompts hold all the KV; free the newest and retry
                victim = self._victim()
                assert victim is not None
                self._preempt(victim, now)
                self.start_step(now)
                return
            self.busy = False
            return
        n_dec = self.n_dec
        tokens += n_dec
        pairs += self.sum_ctx + n_dec
        kv_read += self.sum_ctx
        sampled += n_dec
        self.kv_used += tokens  # the chunks, and one token per decode
        if self.kv_used > self.peak_kv:
            self.peak_kv = self.kv_used
        self._chunks = chunks
        self._fresh = fresh
        self._dec_in_step = n_dec
        if self.policy is not None and budget:
            self._features = StepFeatures(tokens, n_dec + len(chunks), pairs)
        else:
            self._features = None
        dt = self.timer.seconds(tokens, pairs, kv_read, sampled, n_dec + len(chunks))
        self.busy = True
        self.step_start = now
        sim = self.sim
        heappush(sim.heap, (now + dt, next(sim.seq), 0, self))

    def _whole_prompts(self, now: float, free: int) -> bool:
        """Without chunked prefill (vLLM's V0 default), waiting prompts run whole, alone, in a
        step of their own, before any decode step; True if such a step was started."""
        waiting = self.waiting
        left = self.max_tokens
        running = self.n_dec + len(self.prefilling)
        chunks: list[tuple[Req, int]] = []
        tokens = pairs = kv_read = 0
        while waiting and running < self.max_seqs:
            r = waiting[0]
            if r.ready:
                break
            cached = 0
            if r.computed == 0 and r.generated == 0 and self.holds_prefix(r.prefix):
                cached = min(r.prefix_len, r.target - 1)
            take = r.target - r.computed - cached
            if (chunks and take > left) or take + cached > free:
                break
            waiting.popleft()
            r.computed += cached
            self.kv_used += cached
            self.admitted += 1
            r.admit = self.admitted
            if r.prefill_start < 0:
                r.prefill_start = now
            self.prefilling.append(r)
            c = r.computed
            chunks.append((r, take))
            tokens += take
            pairs += take * c + take * (take + 1) // 2
            kv_read += c
            left -= take
            free -= take + cached
            running += 1
        if not chunks:
            return False
        self.kv_used += tokens
        if self.kv_used > self.peak_kv:
            self.peak_kv = self.kv_used
        self._chunks = chunks
        self._fresh = []
        self._dec_in_step = 0
        self._features = None
        dt = self.timer.seconds(tokens, pairs, kv_read, len(chunks))
        self.busy = True
        self.step_start = now
        sim = self.sim
        heappush(sim.heap, (now + dt, next(sim.seq), 0, self))
        return True

    def _schedule_finish(self, r: Req) -> None:
        """File ``r`` under the step that emits its last token."""
        s = r.step0 + (r.output - r.gen0) - 1
        bucket = self.finish.get(s)
        if bucket is None:
            self.finish[s] = [r]
        else:
            bucket.append(r)

    def end_step(self, now: float) -> None:
        """Apply the step that just ended, then start the next one."""
        dt = now - self.step_start
        self.busy_s += dt
        self.steps += 1
        if self._features is not None:
            assert self.policy is not None
            self.policy.observe(self._features, dt)
        n_dec = self._dec_in_step
        d = self.dstep
        if n_dec:
            # the decodes' gap: since the previous decode step (prefill-only steps between
            # count), pushed on the suffix-max stack the requests' largest gaps are read from
            gap = now - self.last_dec_end
            idx, val = self._gap_idx, self._gap_val
            while val and val[-1] <= gap:
                val.pop()
                idx.pop()
            idx.append(d)
            val.append(gap)
            if self._bounds:
                for bound, cum in zip(self._bounds, self._slow, strict=True):
                    cum.append(cum[-1] + (gap > bound))
            fresh = self._fresh
            for r in fresh:  # first token on D
                if r.first_t < 0:
                    r.first_t = now
                elif r.gap_from < 0:
                    stall = now - r.last_t
                    if stall > r.max_gap:
                        r.max_gap = stall
                    if self._bounds:
                        r.slow += self._slow_gap(r, stall)
                r.gap_from = d + 1
                r.last_t = now
            emitted = n_dec - len(fresh)
            if emitted > 0:  # GapHistogram.add, inlined: this runs once per step
                gaps = self.sim.recorder.gaps
                i = int(log10(gap / MIN_GAP_S if gap > MIN_GAP_S else 1.0) * BINS_PER_DECADE)
                gaps.counts[i if i < NBINS else NBINS] += emitted
                gaps.total += emitted
            self.sum_ctx += n_dec
            self.dstep = d + 1
            self.last_dec_end = now
        for r, take in self._chunks:
            r.computed += take
            if r.computed >= r.target:
                self.prefilling.remove(r)
                self._prefill_done(r, now, take)
        if n_dec:
            done = self.finish.pop(d, None)
            if done:
                for r in done:
                    if r in self.decoding and r.step0 + (r.output - r.gen0) - 1 == d:
                        self._complete(r, now, d)
        self.busy = False
        if self.waiting or self.prefilling or self.n_dec:
            self.start_step(now)

    def _slow_since(self, r: Req, first: int, end: int) -> int:
        """Decode steps ``first`` to ``end - 1`` whose gap exceeded ``r``'s class bound."""
        cum = self._slow[self.sim.recorder.bound_of_class[r.cls]]
        return cum[end] - cum[first]

    def _slow_gap(self, r: Req, gap: float) -> int:
        rec = self.sim.recorder
        return int(gap > self._bounds[rec.bound_of_class[r.cls]])

    def _max_gap_since(self, first: int) -> float:
        idx = self._gap_idx
        i = bisect_left(idx, first)
        return self._gap_val[i] if i < len(idx) else 0.0

    def _prefill_done(self, r: Req, now: float, last_chunk: int) -> None:
        """A prompt's last chunk ran: it emits a token here, or its KV goes to D."""
        self._remember_prefix(r.prefix)
        if self.role == PREFILL:
            self.sim.prefill_done(self, r, now, last_chunk)
            return
        if r.first_t < 0:
            r.first_t = now
        elif r.last_t >= 0:  # resumed after a preemption: the stall is one gap
            gap = now - r.last_t
            if gap > r.max_gap:
                r.max_gap = gap
            if self._bounds:
                r.slow += self._slow_gap(r, gap)
        r.generated += 1
        r.last_t = now
        if r.generated >= r.output:
            self.kv_used -= r.computed
            self._finish(r, now)
            return
        r.ctx0 = r.target
        r.step0 = self.dstep
        if not self.n_dec:
            self.last_dec_end = now  # its first gap runs from this token
        r.gen0 = r.generated
        r.gap_from = r.step0
        self.decoding[r] = None
        self.n_dec += 1
        self.sum_ctx += r.ctx0
        self._schedule_finish(r)

    def _complete(self, r: Req, now: float, s: int) -> None:
        if r.gap_from >= 0:
            gap = self._max_gap_since(r.gap_from) if r.gap_from <= s else 0.0
            if gap > r.max_gap:
                r.max_gap = gap
            if self._bounds and r.gap_from <= s:
                r.slow += self._slow_since(r, r.gap_from, s + 1)
        ctx = r.ctx0 + (s + 1 - r.step0)
        del self.decoding[r]
        self.n_dec -= 1
        self.sum_ctx -= ctx
        self.kv_used -= ctx
        r.generated = r.output
        r.last_t = now
        self._remember_prefix(r.prefix)
        self._finish(r, now)

    def _finish(self, r: Req, now: float) -> None:
        self.backend.outstanding -= 1
        self.sim.request_done(r, now)
