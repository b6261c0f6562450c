"""The proxy's control-plane HTTP client: one aiohttp session for health checks and /v1/models.

Runs in the proxy process, on its event loop. Completions never go through it (they use
``client.py``, a leaner client); these requests are few, so aiohttp's convenience costs nothing
that matters here.
"""

from __future__ import annotations

import aiohttp


def new_control_session(connect_s: float) -> aiohttp.ClientSession:
    """A session to the configured servers: unbounded pool (the callers bound their own
    concurrency), no compression, no cookies, and a connect bound only (each caller bounds its
    own request). Made on the loop it serves."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        connector=connector,
        # Bodies are relayed as they come, so ask for none compressed (and decompress none).
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        # The engines set no cookies that matter; a jar would be filtered on every request.
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_s),
    )
