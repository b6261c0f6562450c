"""Our library's log lines in a vLLM server's log."""

from __future__ import annotations

import logging


def route_logs_to_vllm() -> None:
    """Our library loggers ("splitserve.*") write through vLLM's handlers, so their lines land
    in the server's log like vLLM's own (at vLLM's level). Idempotent; does nothing until vLLM
    has configured its own logger."""
    ours, theirs = logging.getLogger("splitserve"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False
