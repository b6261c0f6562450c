"""The stub backends: one process plays the prefill server, one the decode server.

They answer at once, so a cell measures the proxies' own cost. Two servers of the same stub:
on splitserve's own HTTP server (``run_fast_stub``: a fraction of aiohttp's CPU per request, so
the proxies, not the stubs, decide the throughput) or on aiohttp (``run_stub``, the older
harness). Each runs in its own process, started by ``launcher.Launcher`` through the entry
script's hidden ``--fast-stub`` / ``--stub`` options.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from splitserve.proxy.http.messages import Request, Response, StreamResponse
from splitserve.proxy.http.server import HTTPServer

STREAM_CHUNKS = 8


def stub_answers() -> tuple[bytes, bytes, list[bytes]]:
    """P's one-token answer (with ``kv_transfer_params``), D's whole answer, D's SSE chunks."""
    answer_p = json.dumps(
        {
            "id": "p",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "stub",
                "remote_block_ids": [[1]],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
            },
        }
    ).encode()
    answer_d = json.dumps(
        {
            "id": "d",
            "object": "text_completion",
            "choices": [{"index": 0, "text": " tok" * STREAM_CHUNKS, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": STREAM_CHUNKS, "total_tokens": 16},
        }
    ).encode()
    chunks = [
        b"data: "
        + json.dumps({"id": "d", "choices": [{"index": 0, "text": " tok"}]}).encode()
        + b"\n\n"
        for _ in range(STREAM_CHUNKS)
    ]
    return answer_p, answer_d, chunks


def is_prefill_request(body: dict) -> bool:
    """Whether a request is the prefill half: vLLM's (``do_remote_decode``) or SGLang's (one
    token with a ``bootstrap_room``)."""
    params = body.get("kv_transfer_params") or {}
    return bool(
        params.get("do_remote_decode") or (body.get("max_tokens") == 1 and "bootstrap_room" in body)
    )


def stub_app() -> web.Application:
    """The stub on aiohttp."""
    answer_p, answer_d, chunks = stub_answers()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if is_prefill_request(body):
            return web.Response(body=answer_p, content_type="application/json")
        if not body.get("stream"):
            return web.Response(body=answer_d, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for c in chunks:
            await out.write(c)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def info(request: web.Request) -> web.Response:  # what SGLang's router asks workers
        return web.json_response(
            {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True, "dp_size": 1}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", info)
    app.router.add_get("/model_info", info)
    return app


def run_fast_stub(port: int) -> None:
    """The same stub on splitserve's own HTTP server: a fraction of aiohttp's CPU per request, so
    the proxies, not the stubs, decide the throughput."""
    import uvloop

    answer_p, answer_d, chunks = stub_answers()

    async def completions(request: Request) -> Response | StreamResponse:
        body = json.loads(request.body)
        if is_prefill_request(body):
            return Response(answer_p)
        if not body.get("stream"):
            return Response(answer_d)
        out = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for c in chunks:
            await out.write(c)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    info = json.dumps(
        {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True, "dp_size": 1}
    ).encode()

    async def health(request: Request) -> Response:
        return Response(b"ok", content_type="text/plain")

    async def server_info(request: Request) -> Response:
        return Response(info)

    def error(status: int, message: str) -> Response:
        return Response(json.dumps({"error": {"message": message}}).encode(), status)

    async def main() -> None:
        server = HTTPServer(
            {
                ("POST", "/v1/completions"): completions,
                ("GET", "/health"): health,
                ("GET", "/server_info"): server_info,
                ("GET", "/model_info"): server_info,
            },
            error,
            max_body_bytes=1 << 22,
        )
        await server.start("127.0.0.1", port, backlog=4096)
        await asyncio.Event().wait()

    uvloop.run(main())


def install_uvloop() -> None:
    """uvloop's event loop for aiohttp's servers where it is installed."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def run_stub(port: int) -> None:
    """The stub on aiohttp."""
    install_uvloop()
    # A listen backlog above aiohttp's 128: a proxy opening a connection per client at 256
    # clients overflowed it (ListenOverflows in nstat), and each dropped SYN cost its request a
    # 1 s retransmit, which then read as the proxy's latency.
    web.run_app(
        stub_app(),
        host="127.0.0.1",
        port=port,
        access_log=None,
        print=None,
        shutdown_timeout=1,
        backlog=4096,
    )
