"""The proxy's endpoint: routes, auth, error mapping, lifecycle.

Runs in the proxy process: one event loop holds the HTTP server (``http/server.py``), the
upstream client for completions (``http/client.py``), the control-plane session for health
checks and ``/v1/models`` (``http/session.py``), the health-check task and the metrics
registry. Requests are served by ``forward.Forwarder``; ``background.BackgroundProxy`` runs
this server on a thread for tests and benchmarks.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``GET
/v1/models`` (a healthy decode server's answer), ``/health`` (the proxy is alive), ``/ready``
(at least one healthy server in each pool), ``/metrics`` (Prometheus). With an API key set,
every route but ``/health`` needs it; ``/v1`` requests are bounded by ``max_in_flight``.

Invariants: every answer the proxy makes itself is an OpenAI-style error body (never an HTML
page); a client mistake is a 4xx, upstream trouble a 502/503/504; a 500 only ever means a bug
here, and is logged with its traceback. A client that disconnects cancels its handler (the
server does), and with it both upstream requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import signal
from collections.abc import Callable
from typing import Any

import aiohttp

from splitserve.proxy import jsonio, validation
from splitserve.proxy.aux import aux_routes
from splitserve.proxy.calls import RequestOutcome
from splitserve.proxy.config import ProxyConfig
from splitserve.proxy.discovery import Discovery
from splitserve.proxy.errors import NoHealthyServer, ProxyError, Unauthorized, error_body
from splitserve.proxy.forward import Forwarder
from splitserve.proxy.health import HealthChecker, HealthTracker
from splitserve.proxy.http.client import UpstreamClient
from splitserve.proxy.http.edge import RETRY_AFTER_S, EdgeLimits
from splitserve.proxy.http.messages import Handler, Request, Response, StreamResponse
from splitserve.proxy.http.server import HTTPServer
from splitserve.proxy.http.session import new_control_session
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, Pool

logger = logging.getLogger(__name__)


def _json_response(data: Any, status: int = 200) -> Response:
    return Response(jsonio.dumps(data), status)


class ProxyState:
    """Everything one running proxy holds; built on start-up, closed on clean-up."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill_backends = [Backend("prefill", e.url, e) for e in config.prefill]
        self.decode_backends = [Backend("decode", e.url, e) for e in config.decode]
        r = config.routing
        metrics = self.metrics

        def on_panic(pool: str) -> None:
            metrics.of(metrics.panic_routes, pool).inc()

        self.prefill = Pool(
            "prefill",
            self.prefill_backends,
            r.prefill,
            r.prefix_affinity,
            panic_threshold=r.panic_threshold,
            on_panic=on_panic,
        )
        self.decode = Pool(
            "decode", self.decode_backends, r.decode, panic_threshold=r.panic_threshold,
            on_panic=on_panic,
        )  # fmt: skip
        self.tracker = HealthTracker(
            self.prefill_backends + self.decode_backends,
            config.health,
            self.metrics,
            config.outlier,
        )
        self.discovery: Discovery | None = None  # dynamic pools (discovery.py), when configured
        if config.discovery is not None:
            self.discovery = Discovery(
                config, {"prefill": self.prefill, "decode": self.decode}, self.tracker, metrics
            )
        self.session: aiohttp.ClientSession | None = None  # health checks and /v1/models
        self.upstream: UpstreamClient | None = None  # every completion request
        self.checker: HealthChecker | None = None
        self.forwarder: Forwarder | None = None
        self._api_key = config.client_key()
        self._upstream_key = config.upstream_key()
        self.in_flight = 0  # /v1 requests being served (bounded by config.max_in_flight)

    async def start(self) -> None:
        # Completions go through the lean client of http/client.py; control-plane requests
        # (health checks, /v1/models) through an aiohttp session (http/session.py).
        self.session = new_control_session(self.config.timeouts.connect_s)
        upstream_headers = self.upstream_headers()
        self.checker = HealthChecker(self.tracker, self.session, upstream_headers)
        await self.checker.check_all(decisive=True)
        self.checker.start()
        if self.discovery is not None:
            await self.discovery.start(self.checker)
        self.upstream = UpstreamClient(self.config.timeouts.connect_s, upstream_headers)
        self.forwarder = Forwarder(
            self.config, self.upstream, self.prefill, self.decode, self.tracker, self.metrics
        )
        if self.config.decide is not None:  # per-request disaggregation (decider.py)
            from splitserve.proxy.decider import Decider

            self.forwarder.decider = Decider(
                self.config.decide, self.metrics.registry, self.forwarder.loop
            )
        logger.info(
            "proxy ready: %s %s flow, %d prefill / %d decode servers (%d / %d healthy)",
            self.config.engine,
            self.config.flow,
            len(self.prefill.backends),
            len(self.decode.backends),
            len(self.prefill.healthy()),
            len(self.decode.healthy()),
        )

    def upstream_headers(self) -> dict[str, str]:
        """Headers every request to an engine carries (its API key, when configured)."""
        key = self._upstream_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self.checker is not None:
            await self.checker.stop()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            self.upstream.close()

    def authorized(self, request: Request) -> bool:
        if self._api_key is None:
            return True
        header = request.header("Authorization") or ""
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self._api_key
        )


# ---------------------------------------------------------------------- error mapping


def _guarded(state: ProxyState, handler: Handler, needs_key: bool, limited: bool) -> Handler:
    """``handler`` with every failure mapped to an OpenAI-style JSON error and its status;
    ``needs_key``: only with the API key (when one is set); ``limited``: counted against
    ``max_in_flight`` (past it: 503 with ``Retry-After``)."""
    max_in_flight = state.config.max_in_flight

    async def guarded(request: Request) -> Response | StreamResponse:
        try:
            if needs_key and not state.authorized(request):
                raise Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>')")
            if not limited:
                return await handler(request)
            if state.in_flight >= max_in_flight:
                return _overloaded(state)
            state.in_flight += 1
            try:
                return await handler(request)
            finally:
                state.in_flight -= 1
        except ProxyError as e:
            state.metrics.errors.labels(e.kind).inc()
            return _json_response(e.body(), e.status)
        except Exception:
            logger.exception("bug in the proxy while serving %s %s", request.method, request.path)
            state.metrics.errors.labels("internal").inc()
            return _json_response(error_body("internal proxy error", "internal_error", 500), 500)

    return guarded


def _overloaded(state: ProxyState) -> Response:
    state.metrics.of(state.metrics.edge_rejections, "max_in_flight").inc()
    message = (
        f"the proxy is serving its limit of {state.config.max_in_flight} requests; retry later"
    )
    response = _json_response(error_body(message, "service_unavailable", 503), 503)
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def edge_limits(config: ProxyConfig) -> EdgeLimits:
    """The HTTP server's limits from the proxy's settings."""
    t = config.client_timeouts
    return EdgeLimits(
        max_body_bytes=config.max_body_bytes,
        max_header_bytes=config.max_header_bytes,
        header_timeout_s=t.header_s,
        body_timeout_s=t.body_s,
        idle_timeout_s=t.idle_keepalive_s,
        max_connections=config.max_connections,
    )


def _server_error(state: ProxyState) -> Callable[[int, str], Response]:
    """How the HTTP server answers what it refuses itself (bad HTTP, too large, no route)."""

    def answer(status: int, message: str) -> Response:
        state.metrics.errors.labels("too_large" if status == 413 else "http").inc()
        err_type = "invalid_request_error" if status < 500 else "internal_error"
        if status == 503:  # past max_connections
            err_type = "service_unavailable"
        return _json_response(error_body(message, err_type, status), status)

    return answer


# ---------------------------------------------------------------------- handlers


def _generation_handler(
    state: ProxyState, route: str, path: str, check: Callable[[dict[str, Any]], None]
) -> Handler:
    metrics = state.metrics
    latency = metrics.of(metrics.latency, route)
    by_status: dict[int, Any] = {}  # the requests counter's child per final status

    async def handler(request: Request) -> Response | StreamResponse:
        outcome = RequestOutcome(status=500)
        assert state.forwarder is not None
        loop = state.forwarder.loop  # not get_running_loop(): a getpid() call on 3.11
        t0 = loop.time()
        try:
            body = validation.parse_json_object(request.body)
            check(body)
            return await state.forwarder.handle(request, route, path, body, outcome)
        except ProxyError as e:
            outcome.status = e.status
            raise
        except asyncio.CancelledError:
            outcome.status, outcome.error_kind = 499, "client_disconnected"
            raise
        finally:
            status = outcome.status
            counter = by_status.get(status)
            if counter is None:
                counter = by_status[status] = metrics.of(metrics.requests, route, str(status))
            counter.inc()
            if outcome.error_kind is not None:
                metrics.errors.labels(outcome.error_kind).inc()
            latency.observe(loop.time() - t0)

    return handler


def _models_handler(state: ProxyState) -> Handler:
    async def models(request: Request) -> Response:
        assert state.session is not None
        headers = state.upstream_headers()
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
                        return Response(raw)
                    last = f"{b.url} answered {r.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                last = f"{b.url}: {type(e).__name__} {e}"
        raise NoHealthyServer(f"cannot list models: {last}")

    return models


async def _health(request: Request) -> Response:
    return _json_response({"status": "ok"})


def _ready_handler(state: ProxyState) -> Handler:
    def pool(p: Pool) -> dict[str, Any]:
        return {
            "healthy": len(p.healthy()),
            "panic": p.below_panic_threshold(),
            "servers": [
                {
                    "url": b.url,
                    "healthy": b.healthy,
                    "ejected_by": b.ejected_by,
                    "degraded": b.degraded,
                    "in_flight": b.outstanding,
                    "error": b.last_error,
                }
                for b in p.backends
            ],
        }

    async def ready(request: Request) -> Response:
        # A pool in panic still serves (soft-ejected servers are tried), but it is short of
        # servers: a load balancer in front should prefer another proxy, so not ready.
        is_ready = not (
            state.prefill.below_panic_threshold() or state.decode.below_panic_threshold()
        )
        data = {"ready": is_ready, "prefill": pool(state.prefill), "decode": pool(state.decode)}
        return _json_response(data, 200 if is_ready else 503)

    return ready


def _metrics_handler(state: ProxyState) -> Handler:
    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), content_type=state.metrics.content_type)

    return metrics


# ---------------------------------------------------------------------- the running proxy


class ProxyServer:
    """One proxy: its state and its HTTP server. ``await start()`` runs the first health checks
    and listens (port 0 picks a free port: ``port`` tells which); ``await close()`` undoes it."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.state = state = ProxyState(config)
        routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): _generation_handler(
                state, "completions", "/v1/completions", validation.check_completion
            ),
            ("POST", "/v1/chat/completions"): _generation_handler(
                state, "chat", "/v1/chat/completions", validation.check_chat
            ),
            ("GET", "/v1/models"): _models_handler(state),
            ("GET", "/health"): _health,
            ("GET", "/ready"): _ready_handler(state),
            ("GET", "/metrics"): _metrics_handler(state),
            **aux_routes(state),  # /tokenize, /detokenize, /version ... relayed (aux.py)
        }
        # With an API key, everything but /health needs it: /ready names the servers and their
        # errors, /metrics the servers and the traffic (docs/security.md).
        self.http = HTTPServer(
            {
                key: _guarded(state, handler, key[1] != "/health", key[1].startswith("/v1/"))
                for key, handler in routes.items()
            },
            _server_error(state),
            max_body_bytes=config.max_body_bytes,
            limits=edge_limits(config),
            shutdown_timeout_s=5.0,
            on_reject=lambda reason: state.metrics.of(state.metrics.edge_rejections, reason).inc(),
        )
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self, reuse_port: bool = False) -> ProxyServer:
        await self.state.start()
        try:
            self.port = await self.http.start(
                self.config.host, self.config.port, backlog=1024, reuse_port=reuse_port
            )
        except BaseException:
            await self.state.close()
            raise
        logger.info("splitserve proxy listening on %s", self.url)
        return self

    async def close(self) -> None:
        try:
            await self.http.close()
        finally:
            await self.state.close()


def _settle_heap() -> None:
    """Keep the garbage collector off what start-up built (a serving process only).

    Everything imported and built so far (aiohttp, pydantic, prometheus_client, the config) lives
    as long as the process; left to the collector, every full collection walks all of it again,
    a pause on the request path (its share of the proxy's CPU in a native profile:
    docs/benchmarks.md, "A server of our own"). ``gc.freeze()`` moves it to the permanent
    generation, as CPython's docs advise for servers; what requests allocate is still
    collected. The youngest generation is collected after 10,000 net allocations instead of
    700: with many requests in flight, each collection walks their live state whatever the
    threshold, so fewer collections cost less, and cyclic garbage waits a little longer
    (requests make almost none)."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, 10_000), middle, old)


async def serve(
    config: ProxyConfig, started: Callable[[int], None] | None = None, reuse_port: bool = False
) -> None:
    """Run a proxy until cancelled. ``started`` gets the bound port (useful with port 0);
    ``reuse_port`` lets several worker processes listen on the same port."""
    proxy = await ProxyServer(config).start(reuse_port=reuse_port)
    _settle_heap()
    try:
        if started is not None:
            assert proxy.port is not None
            started(proxy.port)
        await asyncio.Event().wait()
    finally:
        await proxy.close()


async def serve_until_stopped(
    config: ProxyConfig,
    started: Callable[[int], None] | None = None,
    reuse_port: bool = False,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """``serve`` in a process of its own, until one of ``signals``: SIGTERM (what Kubernetes,
    ``splitserve up`` and the worker pool send) or SIGINT stops the proxy as ``close`` does (no
    new connection; answers under way get ``shutdown_timeout_s``) and returns. Before, SIGTERM
    ended the process at once, and a SIGINT that the parent shell had set to be ignored (a proxy
    started in the background) did nothing: the process had to be killed. Main thread only."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    proxy = asyncio.ensure_future(serve(config, started, reuse_port))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({proxy, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        stopping.cancel()
        if not proxy.done():
            proxy.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await proxy
    if stop.is_set():
        logger.info("proxy stopped by a signal")
    else:
        proxy.result()  # serve's own error (a port it cannot listen on)
