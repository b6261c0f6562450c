"""Refuse bad ``kv_transfer_params`` at request time, in vLLM's API server: a 400 naming the field.

Runs in the API server process, as an ASGI middleware vLLM adds itself: ``--middleware
splitserve.connectors.vllm.middleware.PrefillTargetGuard`` (``splitserve up`` adds it to every
server whose connector is ``SplitserveConnector``; ``engines.SPLITSERVE_MIDDLEWARE``). Why here:
the connector's scheduler half sees a request's params only in the engine-core process, where it
cannot answer the client; all it can do is serve the request without a transfer and log it. At
the HTTP edge the client learns at once which field is wrong, and D never contacts a prefill
server it should not (docs/security.md, "D only contacts prefill servers it should").

What it checks: every POST with a JSON body (any route: completions, chat, responses, messages,
the token-in API all take the field) whose top level, or ``vllm_xargs`` (which vLLM passes into
the same sampling-params slot), carries ``kv_transfer_params``. They are read with the
connector's own rules (``params.check_params``): wrong types, a missing or out-of-range port, a
``remote_host`` outside ``allowed_prefill_hosts``. A refused request gets vLLM's error shape
(``{"error": {"message", "type": "BadRequestError", "param": "kv_transfer_params.remote_host",
"code": 400}}``) and never reaches the engine. The connector's own check stays as the second
wall (servers started without this middleware).

Where the allowlist comes from: the very ``--kv-transfer-config`` the server was started with,
read at the first request from the FastAPI app's state (``app.state.vllm_config``, which vLLM
sets before it serves) and parsed by the connector's own ``parse_connector_config``. No second
setting (an environment variable the launcher would have to keep equal) exists, so the guard
and the connector cannot disagree, however the server was started.

Order: vLLM adds ``--middleware`` classes outside its own API-key check. So that a client
without the key learns nothing and cannot make us buffer its body, a request to a route that
check guards without a valid key is passed on untouched (vLLM answers 401); vLLM's own
``AuthenticationMiddleware`` decides.

A server whose connector is not ``SplitserveConnector`` (or that has none) is passed through,
with one warning: the params then belong to another connector.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.connectors.vllm.config import parse_connector_config
from splitserve.connectors.vllm.params import KVParamsError, check_params
from splitserve.transfer.auth import PeerLog
from splitserve.transfer.peers import PeerAllowlist

logger = logging.getLogger(__name__)

FIELD = "kv_transfer_params"
CONNECTOR_NAME = "SplitserveConnector"
# Bodies that cannot carry the field as JSON: passed through without being buffered.
_NOT_JSON = ("multipart/", "application/x-www-form-urlencoded")


@dataclass(frozen=True)
class _Settings:
    """What the guard needs from the server, resolved once (see module docstring)."""

    active: bool  # False: not our connector; pass everything through
    allowlist: PeerAllowlist | None = None
    authorized: Callable[[Scope], bool] = lambda scope: True


def _bad_request(param: str, message: str) -> JSONResponse:
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return JSONResponse({"error": error}, status_code=400)


def _auth_check(state: Any) -> Callable[[Scope], bool]:
    """vLLM's own decision whether a request reaches its routes: the ``--api-key`` tokens
    (else ``VLLM_API_KEY``) on the paths its ``AuthenticationMiddleware`` guards."""
    args = getattr(state, "args", None)
    tokens = [t for t in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if t]
    if not tokens:
        return lambda scope: True
    from vllm.entrypoints.serve.middleware.authenticate import (
        GUARDED_PREFIX,
        AuthenticationMiddleware,
    )

    auth = AuthenticationMiddleware(app=None, tokens=tokens)  # type: ignore[arg-type]

    def authorized(scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return not path.startswith(GUARDED_PREFIX) or auth.verify_token(Headers(scope=scope))

    return authorized


def resolve_settings(app: Any) -> _Settings:
    """The guard's settings from the FastAPI app vLLM serves (its ``state.vllm_config``)."""
    state = getattr(app, "state", None)
    kv = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
    module = getattr(kv, "kv_connector_module_path", None) or ""
    if kv is None or (
        getattr(kv, "kv_connector", None) != CONNECTOR_NAME and not module.startswith("splitserve.")
    ):
        logger.warning(
            "PrefillTargetGuard: this server's connector is not %s; kv_transfer_params are not "
            "checked here",
            CONNECTOR_NAME,
        )
        return _Settings(active=False)
    config = parse_connector_config(getattr(kv, "kv_connector_extra_config", None))
    logger.info(
        "PrefillTargetGuard: kv_transfer_params checked at request time; allowed prefill hosts: %s",
        config.allowlist if config.allowlist is not None else "any",
    )
    return _Settings(active=True, allowlist=config.allowlist, authorized=_auth_check(state))


def problem(body: Any, allowlist: PeerAllowlist | None) -> tuple[str, str] | None:
    """``(param, message)`` for a request body whose transfer params are refused, else None."""
    if not isinstance(body, dict):
        return None  # not a request these routes accept; vLLM answers it
    places: list[tuple[str, Any]] = []
    if FIELD in body:
        places.append((FIELD, body[FIELD]))
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and FIELD in xargs:
        places.append((f"vllm_xargs.{FIELD}", xargs[FIELD]))
    for where, params in places:
        try:
            check_params(params, allowlist)
        except KVParamsError as exc:
            param = f"{where}.{exc.field}" if exc.field else where
            return param, f"{param}: {exc}"
    return None


class PrefillTargetGuard:
    """The ASGI middleware (see module docstring); vLLM constructs it with the next app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._settings: _Settings | None = None
        self._log = PeerLog(logger)

    def _settings_for(self, scope: Scope) -> _Settings:
        if self._settings is None:
            self._settings = resolve_settings(scope.get("app"))
        return self._settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        settings = self._settings_for(scope)
        content_type = Headers(scope=scope).get("content-type", "").lower()
        if (
            not settings.active
            or content_type.startswith(_NOT_JSON)
            or not settings.authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        refused = self._check(body, settings.allowlist)
        if refused is not None:
            param, text = refused
            client = (scope.get("client") or ("?",))[0]  # per host: ports change per request
            self._log.warn(str(client), param, "refused a request from %s (400): %s", client, text)
            await _bad_request(param, text)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _check(body: bytes, allowlist: PeerAllowlist | None) -> tuple[str, str] | None:
        # Parsing twice (here and in vLLM) only when the field can be in the body: its name
        # in clear, or JSON escapes that could spell it.
        if FIELD.encode() not in body and b"\\u" not in body:
            return None
        try:
            parsed = json.loads(body)
        except Exception:  # invalid JSON (or nested too deep): vLLM answers it
            return None
        return problem(parsed, allowlist)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the buffered body once, then the client's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
