"""Worker side (each worker process): the shares one request's transfer is made of on this rank.

At equal tensor parallel sizes a request is one transfer under its transfer id. At other sizes
(``ranks.py``) a P rank sends one share per D rank it feeds and a D rank loads one share from
each P rank holding its heads, each share a transfer of its own under ``ranks.share_id``. This
module keeps one record per transfer id and side, and says when the request is settled: P
reports the request's blocks free once its last share was released; D reports the load once
every share settled, failed if any failed (the first failure aborts the shares still loading).
``SplitserveWorker`` drives it from the engine's thread, under its lock.

Invariants:
- A request's shares are fixed when it starts (``start_sending`` / ``start_loading``): later
  steps, its end and its abort use the same ids, whatever the params say then.
- A record lives from its start until its last share settled (or, on P, until the engine ends
  a request with no share on this rank); a transfer id already recorded is refused, not mixed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.connectors.vllm.ranks import Ranks, fed_ranks, share_id, source_ranks
from splitserve.transfer.tp import tp_mismatch


@dataclass
class _Sending:
    """P: one request's shares on this rank, and those not released yet."""

    shares: list[str]
    unreleased: set[str]


@dataclass
class _Loading:
    """D: one request's shares on this rank; complete once every share settled."""

    shares: list[str]
    left: set[str]
    failure: str | None = None
    first_token: int | None = None


@dataclass
class Shares:
    """This rank's share records (see module docstring); ``decode_tp`` is the setting
    ``decode_tp_size`` (the D size this P feeds unless a request's params say otherwise)."""

    ranks: Ranks
    decode_tp: int | None = None
    _sending: dict[str, _Sending] = field(default_factory=dict)
    _loading: dict[str, _Loading] = field(default_factory=dict)

    # -- P ------------------------------------------------------------------------------------

    def sending(self, transfer_id: str, decode_tp: int | None = None) -> list[str]:
        """The ids this P rank sends the request's KV under, for a D of ``decode_tp`` (the
        params' word, else the setting, else our size): the id itself at equal sizes, else one
        share per D rank it feeds (none for a rank that only repeats replicated heads). A
        started request's own shares, whatever ``decode_tp`` says."""
        known = self._sending.get(transfer_id)
        if known is not None:
            return known.shares
        size, rank = self.ranks.size, self.ranks.rank
        decode = decode_tp or self.decode_tp or size
        if decode == size or tp_mismatch(size, decode) is not None:
            return [transfer_id]
        fed = fed_ranks(size, decode, rank, self.ranks.total_kv_heads)
        return [share_id(transfer_id, size, decode, j, rank) for j in fed]

    def start_sending(self, transfer_id: str, decode_tp: int | None) -> list[str] | None:
        """Record a request P starts producing: its shares, or None when the id is in use."""
        if transfer_id in self._sending:
            return None
        shares = self.sending(transfer_id, decode_tp)
        self._sending[transfer_id] = _Sending(shares, set(shares))
        return shares

    def released(self, transfer_id: str, share: str) -> bool:
        """The sender released ``share``: True when it was the request's last (its blocks
        may be reported free; the record is gone), False while others are unreleased."""
        record = self._sending.get(transfer_id)
        if record is None:
            return True
        record.unreleased.discard(share)
        if record.unreleased:
            return False
        del self._sending[transfer_id]
        return True

    def forget_sending(self, transfer_id: str) -> None:
        """A request with no share on this rank ended: nothing will be released for it."""
        self._sending.pop(transfer_id, None)

    # -- D ------------------------------------------------------------------------------------

    def sources(self, transfer_id: str, prefill_tp: int | None) -> list[tuple[int, str]]:
        """(P rank, the id registered there) for each share this D rank loads from a P of
        ``prefill_tp`` (default: our size); a size that cannot pair (the scheduler half
        refused it already) gets the plain rank-to-rank pair."""
        size, rank = self.ranks.size, self.ranks.rank
        prefill = prefill_tp or size
        if tp_mismatch(prefill, size) is not None:
            return [(rank, transfer_id)]
        ranks = source_ranks(prefill, size, rank, self.ranks.total_kv_heads)
        return [(i, share_id(transfer_id, prefill, size, rank, i)) for i in ranks]

    def start_loading(self, transfer_id: str, shares: list[str]) -> bool:
        """Record a load of ``shares``; False when the id is already awaited."""
        if transfer_id in self._loading:
            return False
        self._loading[transfer_id] = _Loading(list(shares), set(shares))
        return True

    def loading(self, transfer_id: str) -> list[str]:
        """The shares a load awaits (the id itself when it is not recorded)."""
        record = self._loading.get(transfer_id)
        return [transfer_id] if record is None else record.shares

    def settle(
        self,
        transfer_id: str,
        share: str,
        ok: bool,
        first_token: int | None,
        reason: str,
        abort: Callable[[str, str], None],
    ) -> tuple[bool, int | None, str] | None:
        """One share of a load settled: the load's (ok, P's first token, reason) once it was
        the last, else None. The first failure calls ``abort(share, reason)`` for each share
        still loading (the load failed as a whole; they settle on P's ABORT_ACK)."""
        record = self._loading.get(transfer_id)
        if record is None:
            return ok, first_token, reason
        record.left.discard(share)
        if not ok and record.failure is None:
            record.failure = reason if len(record.shares) == 1 else f"share {share}: {reason}"
            for other in sorted(record.left):
                abort(other, f"another share of the request failed ({share})")
        if ok and first_token is not None:
            record.first_token = first_token
        if record.left:
            return None
        del self._loading[transfer_id]
        return record.failure is None, record.first_token, record.failure or ""

    def is_idle(self) -> bool:
        """No record on either side (every request settled)."""
        return not self._sending and not self._loading
