"""The bare floor: the least a Python/aiohttp proxy can do for the vLLM sequential flow.

P, then D, relayed, with no validation, routing, metrics, timeouts or retries: the cost the
runtime sets, below which no Python proxy on aiohttp can go. Runs in its own process, started by
``launcher.Launcher`` through the entry script's hidden ``--bare`` option.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web

from proxybench.stubs import install_uvloop


def run_bare(port: int, prefill: str, decode: str) -> None:
    """Serve the bare proxy on ``port`` in front of ``prefill`` and ``decode``."""
    install_uvloop()
    p_url, d_url = prefill + "/v1/completions", decode + "/v1/completions"
    headers = {"Content-Type": "application/json"}

    async def completions(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.json()
        p_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        async with session.post(p_url, data=json.dumps(p_body).encode(), headers=headers) as r:
            params = (await r.json())["kv_transfer_params"]
        d_body = {**body, "kv_transfer_params": params}
        async with session.post(d_url, data=json.dumps(d_body).encode(), headers=headers) as r:
            if not body.get("stream"):
                return web.Response(body=await r.read(), content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/ready", health)
    web.run_app(
        app,
        host="127.0.0.1",
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=1,
        backlog=1024,
    )
