"""The engines' auxiliary endpoints through the proxy: relayed to one server of the pools.

Runs in the proxy process, on its event loop, over the control-plane session (aiohttp, like
``/v1/models``). A client of a vLLM server (``vllm bench serve`` among them) expects
``/tokenize``, ``/detokenize`` and ``/version`` next to ``/v1``; SGLang serves ``/tokenize``,
``/detokenize`` (also under ``/v1/``) and ``/model_info``. Every server of a deployment runs
the same model, so any healthy one answers exactly what the client would get from the engine:
relayed, not served by the proxy (its tokenizer counts prompts, but the engine's answer also
carries fields such as ``max_model_len`` that only the engine knows).

Invariants: the engine's status and body reach the client unchanged (a 400 for a bad request
included); a server that cannot be reached is skipped for the next one (decode pool first, then
prefill); none reachable is a 503.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import aiohttp

from splitserve.proxy.errors import NoHealthyServer
from splitserve.proxy.http.messages import Handler, Request, Response

if TYPE_CHECKING:
    from splitserve.proxy.server import ProxyState

# (method, path) relayed per engine.
VLLM_ROUTES = (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"))
SGLANG_ROUTES = (
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/tokenize"),
    ("POST", "/v1/detokenize"),
    ("GET", "/model_info"),
)


def aux_routes(state: ProxyState) -> dict[tuple[str, str], Handler]:
    """The relayed routes of ``state.config.engine``."""
    routes = SGLANG_ROUTES if state.config.engine == "sglang" else VLLM_ROUTES
    return {(method, path): _relay(state, method, path) for method, path in routes}


def _relay(state: ProxyState, method: str, path: str) -> Handler:
    async def relay(request: Request) -> Response:
        assert state.session is not None
        candidates = state.decode.healthy() + state.prefill.healthy()
        if not candidates:
            raise NoHealthyServer(f"no healthy server to answer {path}")
        headers: dict[str, str] = dict(state.upstream_headers())
        kwargs: dict[str, Any] = {}
        if method == "POST":
            headers["Content-Type"] = "application/json"
            kwargs["data"] = request.body
        timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s + 5)
        last = "no server answered"
        for b in candidates:
            try:
                async with state.session.request(
                    method, b.url + path, headers=headers, timeout=timeout, **kwargs
                ) as r:
                    raw = await r.read()
                    if r.status < 500:
                        return Response(raw, r.status, content_type=r.content_type)
                    last = f"{b.url} answered {r.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                last = f"{b.url}: {type(e).__name__} {e}"
        raise NoHealthyServer(f"cannot answer {path}: {last}")

    return relay
