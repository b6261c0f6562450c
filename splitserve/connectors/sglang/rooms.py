"""SGLang's ``bootstrap_room`` and our ``transfer_id``: the one place the two meet.

Runs in SGLang's scheduler process, wherever the backend (``splitserve.connectors.sglang.conn``,
``prefill``, ``decode``) crosses between SGLang's bookkeeping and ours. SGLang keys a transfer by
its ``bootstrap_room`` (an int); ``splitserve.transfer`` by a ``transfer_id`` (a str). A module of
its own because the manager's shared part and both sides' modules need the same two helpers.

Invariant: ``transfer_id == str(bootstrap_room)``, made once where SGLang calls us
(``TransferIdOfRoom``); ``room_of`` turns it back only to call SGLang's own bookkeeping.
"""

from __future__ import annotations


def room_of(transfer_id: str) -> int:
    """SGLang's key for a transfer (its ``bootstrap_room``): the inverse of the edge's ``str()``."""
    return int(transfer_id)


class TransferIdOfRoom:
    """SGLang's per-request objects know their ``bootstrap_room``; ours is its ``str()``."""

    bootstrap_room: int

    @property
    def transfer_id(self) -> str:
        return str(self.bootstrap_room)
