"""One request of a simulated fleet: the single record its servers and the event loop share.

Pure data; runs in the simulating process. ``engine.Simulation`` makes one ``Req`` per arrival
and hands it to a server (``server.Server``) or, disaggregated, to a P and then a D; every
phase of the request updates this one object rather than per-phase sets or maps. ``__slots__``
because a run makes one per request and the step loop reads them.

Fields, by what they record:

- the request: ``rid``, ``cls`` (the index of its request class), ``arrival``, ``prompt``
  and ``output`` tokens, the shared ``prefix`` it starts with (-1: none) and ``prefix_len``;
- progress: ``target`` (tokens to compute before the next token can be sampled: the prompt,
  plus what was generated when a preemption made it recompute), ``computed``, ``generated``;
- its place among a server's decodes, counted rather than iterated: ``admit`` (admission order,
  which preemption reads), ``ctx0`` and ``gen0`` (context and tokens generated when it joined
  the decodes at decode step ``step0``);
- timing: ``first_t``, ``last_t`` (first and latest token), ``prefill_start``, ``max_gap``
  (largest gap between two tokens), ``slow`` (gaps over the class's bound, counted only for
  the ``p99`` metric) and ``gap_from`` (the decode step from which the server's
  gap record still counts for it; -1 after a preemption, whose stall is the next gap);
- the handoff: ``pserver`` and ``dserver``, ``ready`` (on D: its KV has arrived, it only
  decodes) and ``held`` (KV tokens P keeps until the handoff lands).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.planner.sim.server import Server


class Req:
    """One request's state across the fleet (one record, one phase at a time)."""

    __slots__ = (
        "rid",
        "cls",
        "arrival",
        "prompt",
        "output",
        "prefix",
        "prefix_len",
        "target",
        "computed",
        "generated",
        "first_t",
        "last_t",
        "admit",
        "ctx0",
        "step0",
        "gen0",
        "gap_from",
        "max_gap",
        "slow",
        "pserver",
        "dserver",
        "ready",
        "prefill_start",
        "held",
    )

    def __init__(
        self, rid: int, cls: int, arrival: float, prompt: int, output: int, prefix: int, plen: int
    ) -> None:
        self.rid = rid
        self.cls = cls
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.prefix = prefix
        self.prefix_len = plen
        self.target = prompt  # tokens to compute before the next token can be sampled
        self.computed = 0
        self.generated = 0
        self.first_t = -1.0
        self.last_t = -1.0
        self.admit = 0
        self.ctx0 = 0
        self.step0 = 0
        self.gen0 = 0
        self.gap_from = 0
        self.max_gap = 0.0
        self.slow = 0  # gaps over its class's ITL bound so far (itl_metric p99 only)
        self.pserver: Server | None = None
        self.dserver: Server | None = None
        self.ready = False  # on D: its KV has arrived, it only decodes
        self.prefill_start = -1.0
        self.held = 0  # KV tokens P keeps until the handoff lands
