"""A per-request timeline of the ``splitserve`` SGLang backend: one log line per event, from
server-side wall clocks, that ``benchmarks/sglang_timeline.py`` joins across P's and D's logs.

Runs in SGLang's scheduler process of a prefill (P) or decode (D) server, called by the manager
(``splitserve.connectors.sglang.conn``, with its sides in ``.prefill`` and ``.decode``) and the
run_batch hook (``splitserve.connectors.sglang.layerwise``). Off by default;
``SPLITSERVE_SGLANG_TIMELINE=1`` logs each event at INFO, else nothing is formatted. Imports no
SGLang (the parser imports it).

A line reads ``splitserve-timeline room=<bootstrap_room> event=<name> wall=<unix seconds>`` and
optional ``key=value`` fields. Events, in the order a request meets them (``EVENTS``):

- P: ``p_request`` (its sender made: the request is in P's bootstrap queue), ``p_registered``
  (the scheduler's poll saw D's REGISTER), ``p_init`` (SGLang took it off the bootstrap queue:
  pages allocated, prefill can be scheduled), per chunk ``p_forward_start`` / ``p_forward_end``
  (the prefill forward that computes it; ``last_layer=`` the wall clock of the last layer the
  per-layer hook posted in it), ``p_last_chunk`` (the last chunk's ``send``: DONE may go),
  ``p_sent`` / ``p_failed`` (the poll saw the transfer settle).
- D: ``d_request`` (its receiver made), ``d_bootstrapped`` (P's side channel known from the
  bootstrap server), ``d_registered`` (D's KV allocated; its REGISTER, with HELLO first on a new
  connection, sent), ``d_done`` / ``d_failed`` (the poll saw DONE or the failure;
  ``handoff=`` the exposed handoff), ``d_first_decode`` / ``d_first_decode_end`` (the first
  decode batch holding it starts / its forward returns).

Invariants: a few lines per request and one per prefill chunk, never one per layer; a disabled
timeline costs one attribute test per event.
"""

from __future__ import annotations

import logging
import re
import time

logger = logging.getLogger(__name__)

PREFIX = "splitserve-timeline"
EVENTS = (
    "p_request",
    "d_request",
    "d_bootstrapped",
    "d_registered",
    "p_registered",
    "p_init",
    "p_forward_start",
    "p_forward_end",
    "p_last_chunk",
    "p_sent",
    "p_failed",
    "d_done",
    "d_failed",
    "d_first_decode",
    "d_first_decode_end",
)
LINE = re.compile(PREFIX + r" room=(\S+) event=(\w+) wall=([0-9.]+)((?: \w+=\S+)*)")


class Timeline:
    """One server's timeline: the events it logs and what spans more than one call (the rooms
    of the running prefill forward, the loaded requests awaiting their first decode step)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.forward_rooms: list[int] = []  # P: rooms of the running prefill forward
        self.last_layer_wall = 0.0  # P: wall clock of the last layer store hooked
        self.awaiting_decode: set[int] = set()  # D: loaded, first decode step not seen
        self.decode_rooms: list[int] = []  # D: rooms whose first decode step is running

    def event(self, room: object, name: str, wall: float | None = None, **fields: object) -> None:
        if not self.enabled:
            return
        logger.info(format_event(room, name, time.time() if wall is None else wall, fields))

    def forward_started(self, reqs) -> None:
        """P: a prefill forward of these requests (SGLang ``Req``s) starts."""
        wall = time.time()
        self.forward_rooms, self.last_layer_wall = [], 0.0
        for req in reqs:
            room = getattr(req, "bootstrap_room", None)
            if room is None:
                continue
            self.forward_rooms.append(room)
            tokens = f"{getattr(req, 'prefix_len', 0)}-{req.extend_end}"
            self.event(room, "p_forward_start", wall, tokens=tokens)

    def forward_ended(self, *, layerwise: bool) -> None:
        """P: that forward returned (``layerwise``: its layers went out from the hook)."""
        wall, rooms, self.forward_rooms = time.time(), self.forward_rooms, []
        last_layer = self.last_layer_wall if layerwise else 0.0
        for room in rooms:
            self.event(room, "p_forward_end", wall, last_layer=last_layer)

    def loaded(self, room: int) -> None:
        """D: the request's KV is in; its first decode step is next."""
        if self.enabled:
            self.awaiting_decode.add(room)

    def decode_batch(self, reqs) -> None:
        """D: a decode batch of these requests starts."""
        wall = time.time()
        for req in reqs:
            room = getattr(req, "bootstrap_room", None)
            if room in self.awaiting_decode:
                self.awaiting_decode.discard(room)
                self.decode_rooms.append(room)
                self.event(room, "d_first_decode", wall)

    def decode_ended(self) -> None:
        """D: the forward of the batch ``decode_batch`` saw returned."""
        wall, rooms, self.decode_rooms = time.time(), self.decode_rooms, []
        for room in rooms:
            self.event(room, "d_first_decode_end", wall)


def format_event(room: object, name: str, wall: float, fields: dict[str, object]) -> str:
    extra = "".join(
        f" {key}={value:.6f}" if isinstance(value, float) else f" {key}={value}"
        for key, value in fields.items()
    )
    return f"{PREFIX} room={room} event={name} wall={wall:.6f}{extra}"


def parse_line(line: str) -> tuple[str, str, float, dict[str, str]] | None:
    """(room, event, wall, fields) of a timeline line (anywhere in a log line), else None."""
    match = LINE.search(line)
    if match is None:
        return None
    room, name, wall, rest = match.groups()
    fields = dict(item.split("=", 1) for item in rest.split())
    return room, name, float(wall), fields
