"""The proxy's HTTP server: routes, auth, error mapping, lifecycle (aiohttp).

Runs in the proxy process: one event loop holds the aiohttp web app, the upstream client
(``upstream.py``: keep-alive connections for completions) and an aiohttp client session (health
checks, ``/v1/models``), both to the configured servers and to nothing else, the health-check
task and the metrics registry.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``GET
/v1/models`` (a healthy decode server's answer), ``/health`` (the proxy is alive), ``/ready``
(at least one healthy server in each pool), ``/metrics`` (Prometheus).

Invariants: every answer the proxy makes itself is an OpenAI-style error body (never an HTML
page); a client mistake is a 4xx, upstream trouble a 502/503/504; a 500 only ever means a bug
here, and is logged with its traceback. Requests are served with handler cancellation on, so a
client that disconnects cancels its handler and with it both upstream requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from splitserve.proxy import validation
from splitserve.proxy.config import ProxyConfig
from splitserve.proxy.errors import (
    NoHealthyServer,
    PayloadTooLarge,
    ProxyError,
    Unauthorized,
    error_body,
)
from splitserve.proxy.forward import Forwarder, Outcome
from splitserve.proxy.health import HealthChecker, HealthTracker
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, Pool
from splitserve.proxy.upstream import UpstreamClient

logger = logging.getLogger(__name__)

_STATE = web.AppKey("splitserve_proxy", "ProxyState")


def _json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


class ProxyState:
    """Everything one running proxy holds; built on start-up, closed on clean-up."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill_backends = [Backend("prefill", e.url, e) for e in config.prefill]
        self.decode_backends = [Backend("decode", e.url, e) for e in config.decode]
        r = config.routing
        self.prefill = Pool("prefill", self.prefill_backends, r.prefill, r.prefix_affinity)
        self.decode = Pool("decode", self.decode_backends, r.decode)
        self.tracker = HealthTracker(
            self.prefill_backends + self.decode_backends, config.health, self.metrics
        )
        self.session: aiohttp.ClientSession | None = None  # health checks and /v1/models
        self.upstream: UpstreamClient | None = None  # every completion request
        self.checker: HealthChecker | None = None
        self.forwarder: Forwarder | None = None
        self._api_key = (
            config.api_key.get_secret_value().encode() if config.api_key is not None else None
        )

    async def start(self) -> None:
        # Control-plane requests (health checks, /v1/models) go through aiohttp; completions
        # through the lean client of upstream.py (aiohttp's was most of the per-request CPU).
        # Both pools are unbounded (the clients bound the concurrency); TCP_NODELAY is on
        # (uvloop and asyncio set it on every TCP socket).
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector,
            # Bodies are relayed as they come, so ask for none compressed (and decompress none).
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            # The engines set no cookies that matter; a jar would be filtered on every request.
            cookie_jar=aiohttp.DummyCookieJar(),
            # Connect bound only: every read is bounded by the forwarder's own deadlines
            # (first byte, stream idle, total), without a timer object per request here.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.timeouts.connect_s),
        )
        upstream_headers = {}
        if self.config.upstream_api_key is not None:
            key = self.config.upstream_api_key.get_secret_value()
            upstream_headers["Authorization"] = f"Bearer {key}"
        self.checker = HealthChecker(self.tracker, self.session, upstream_headers)
        await self.checker.check_all(decisive=True)
        self.checker.start()
        self.upstream = UpstreamClient(self.config.timeouts.connect_s, upstream_headers)
        self.forwarder = Forwarder(
            self.config, self.upstream, self.prefill, self.decode, self.tracker, self.metrics
        )
        logger.info(
            "proxy ready: %s %s flow, %d prefill / %d decode servers (%d / %d healthy)",
            self.config.engine,
            self.config.flow,
            len(self.prefill_backends),
            len(self.decode_backends),
            len(self.prefill.healthy()),
            len(self.decode.healthy()),
        )

    async def close(self) -> None:
        if self.checker is not None:
            await self.checker.stop()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            self.upstream.close()

    def authorized(self, request: web.Request) -> bool:
        if self._api_key is None:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self._api_key
        )


# ---------------------------------------------------------------------- middleware


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Map every failure to an OpenAI-style JSON error with the right status."""
    state = request.app[_STATE]
    try:
        if request.path.startswith("/v1/") and not state.authorized(request):
            raise Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>')")
        return await handler(request)
    except ProxyError as e:
        state.metrics.errors.labels(e.kind).inc()
        return _json_response(e.body(), e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "too_large" if e.status == 413 else "http"
        state.metrics.errors.labels(kind).inc()
        message = e.text if e.text and not e.text.startswith("<") else e.reason
        err_type = "invalid_request_error" if e.status < 500 else "internal_error"
        return _json_response(error_body(message, err_type, e.status), e.status)
    except Exception:
        logger.exception("bug in the proxy while serving %s %s", request.method, request.path)
        state.metrics.errors.labels("internal").inc()
        return _json_response(error_body("internal proxy error", "internal_error", 500), 500)


# ---------------------------------------------------------------------- handlers


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes"
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes") from None


def _generation_handler(
    route: str, path: str, check: Callable[[dict[str, Any]], None]
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[_STATE]
        metrics = state.metrics
        outcome = Outcome(status=500)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            raw = await _read_body(request, state.config.max_body_bytes)
            body = validation.parse_json_object(raw)
            check(body)
            assert state.forwarder is not None
            return await state.forwarder.handle(request, route, path, body, outcome)
        except ProxyError as e:
            outcome.status = e.status
            raise
        except asyncio.CancelledError:
            outcome.status, outcome.error_kind = 499, "client_disconnected"
            raise
        finally:
            metrics.of(metrics.requests, route, str(outcome.status)).inc()
            if outcome.error_kind is not None:
                metrics.errors.labels(outcome.error_kind).inc()
            metrics.of(metrics.latency, route).observe(loop.time() - t0)

    return handler


async def _models(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    assert state.session is not None
    headers = {}
    if state.config.upstream_api_key is not None:
        headers["Authorization"] = f"Bearer {state.config.upstream_api_key.get_secret_value()}"
    candidates = state.decode.healthy() + state.prefill.healthy()
    if not candidates:
        raise NoHealthyServer("no healthy server to list models from")
    timeout = aiohttp.ClientTimeout(total=state.config.health.timeout_s + 5)
    last = "no server answered"
    for b in candidates:
        try:
            async with state.session.get(
                b.url + "/v1/models", headers=headers, timeout=timeout
            ) as r:
                raw = await r.read()
                if r.status == 200:
                    return web.Response(body=raw, status=200, content_type="application/json")
                last = f"{b.url} answered {r.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            last = f"{b.url}: {type(e).__name__} {e}"
    raise NoHealthyServer(f"cannot list models: {last}")


async def _health(request: web.Request) -> web.Response:
    return _json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    state = request.app[_STATE]

    def pool(p: Pool) -> dict[str, Any]:
        return {
            "healthy": len(p.healthy()),
            "servers": [
                {
                    "url": b.url,
                    "healthy": b.healthy,
                    "in_flight": b.outstanding,
                    "error": b.last_error,
                }
                for b in p.backends
            ],
        }

    ready = bool(state.prefill.healthy()) and bool(state.decode.healthy())
    data = {"ready": ready, "prefill": pool(state.prefill), "decode": pool(state.decode)}
    return _json_response(data, 200 if ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    return web.Response(
        body=state.metrics.render(), headers={"Content-Type": state.metrics.content_type}
    )


# ---------------------------------------------------------------------- app and runners


def build_app(config: ProxyConfig) -> web.Application:
    """The aiohttp application of one proxy (start-up runs the first health checks)."""
    app = web.Application(middlewares=[_errors], client_max_size=config.max_body_bytes)
    state = ProxyState(config)
    app[_STATE] = state

    async def lifecycle(_: web.Application):  # type: ignore[no-untyped-def]
        await state.start()
        yield
        await state.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post(
        "/v1/completions",
        _generation_handler("completions", "/v1/completions", validation.check_completion),
    )
    app.router.add_post(
        "/v1/chat/completions",
        _generation_handler("chat", "/v1/chat/completions", validation.check_chat),
    )
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    return app


def proxy_state(app: web.Application) -> ProxyState:
    return app[_STATE]


async def serve(
    config: ProxyConfig, started: Callable[[int], None] | None = None, reuse_port: bool = False
) -> None:
    """Run a proxy until cancelled. ``started`` gets the bound port (useful with port 0);
    ``reuse_port`` lets several worker processes listen on the same port."""
    runner = web.AppRunner(
        build_app(config), handler_cancellation=True, access_log=None, shutdown_timeout=5.0
    )
    await runner.setup()
    try:
        site = web.TCPSite(
            runner, config.host, config.port, backlog=1024, reuse_port=reuse_port or None
        )
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        logger.info("splitserve proxy listening on http://%s:%d", config.host, port)
        if started is not None:
            started(port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class BackgroundProxy:
    """A proxy on its own event loop in a daemon thread (tests, benchmarks, notebooks).

    ``with BackgroundProxy(config) as proxy: ... proxy.url``; port 0 picks a free port.
    """

    def __init__(self, config: ProxyConfig, start_timeout: float = 30.0) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self.port: int | None = None
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def state(self) -> ProxyState:
        assert self.app is not None
        return self.app[_STATE]

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            runner = web.AppRunner(
                build_app(self.config),
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=5.0,
            )
            await runner.setup()
            self.app = runner.app
            try:
                site = web.TCPSite(runner, self.config.host, self.config.port, backlog=1024)
                await site.start()
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                self._ready.set()
                await asyncio.Event().wait()
            finally:
                await runner.cleanup()

        self._task = loop.create_task(main())
        try:
            loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # reported to the thread that started us
            self._error = e
            self._ready.set()
        finally:
            loop.close()

    def start(self) -> BackgroundProxy:
        self._thread = threading.Thread(target=self._run, name="splitserve-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout):
            raise RuntimeError(f"proxy did not start within {self.start_timeout} s")
        if self._error is not None:
            raise RuntimeError(f"proxy failed to start: {self._error!r}") from self._error
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the proxy's loop and return its result (for state inspection)."""
        assert self._loop is not None
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            box.append(fn())
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)
        return box[0]

    def stop(self) -> None:
        if self._loop is not None and self._task is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> BackgroundProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
