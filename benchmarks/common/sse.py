"""Reading a streamed OpenAI completion: when each event that carries a token arrived.

The load generators of ``goodput.py``/``no_regret.py`` and ``chunking.py`` time tokens the same
way; one reader keeps their TTFT and gap figures comparable."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator


async def token_times(content: AsyncIterable[bytes]) -> AsyncIterator[float]:
    """``time.perf_counter()`` at each ``data:`` event with at least one choice, in order (the
    ``[DONE]`` marker, comments and choice-less events, such as a usage chunk, are skipped)."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        if json.loads(line[6:]).get("choices"):
            yield time.perf_counter()
