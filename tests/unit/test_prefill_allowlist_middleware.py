"""PrefillTargetGuard (splitserve.connectors.vllm.middleware) over a tiny Starlette app.

The app below stands in for vLLM's API server (a fake of the engine, for a unit test of our own
logic): it carries ``state.vllm_config.kv_transfer_config`` and ``state.args`` the way vLLM's
FastAPI app does, and echoes the body it received, so each test sees whether a request reached
the engine and with which bytes. tests/integration/test_prefill_allowlist.py runs the guard in a
real vLLM server.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from splitserve.connectors.vllm.middleware import PrefillTargetGuard

D = {"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "10.0.0.5", "remote_port": 5701}


def fake_vllm_app(extra: dict | None, *, connector: str = "SplitserveConnector", api_key=None):
    """A stand-in for vLLM's app: routes that echo the body, state shaped like vLLM's."""

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"reached": True, "body": (await request.body()).decode()})

    routes = [
        Route(path, echo, methods=["POST", "GET"])
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/other")
    ]
    app = Starlette(routes=routes)
    kv = SimpleNamespace(
        kv_connector=connector,
        kv_connector_module_path=None,
        kv_connector_extra_config={"side_channel_port": 5701, **(extra or {})},
    )
    app.state.vllm_config = SimpleNamespace(kv_transfer_config=kv)
    app.state.args = SimpleNamespace(api_key=api_key)
    app.add_middleware(PrefillTargetGuard)
    return app


@pytest.fixture
def guarded():
    with TestClient(fake_vllm_app({"allowed_prefill_hosts": ["10.0.0.0/24", "p-0.pool"]})) as c:
        yield c


def post(client: TestClient, params, path: str = "/v1/completions", **extra):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}
    if params is not ...:
        body["kv_transfer_params"] = params
    return client.post(path, json=body)


def assert_refused(response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
    assert param in error["message"]


def test_a_disallowed_remote_host_is_refused_naming_the_field(guarded):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        answer = post(guarded, {**D, "remote_host": "10.0.1.5"}, path)
        assert_refused(answer, "kv_transfer_params.remote_host")
        assert "10.0.1.5" in answer.json()["error"]["message"]
        assert "10.0.0.0/24" not in answer.text  # the allowlist is not told to the client
    assert_refused(
        post(guarded, {**D, "remote_host": "evil.example"}), "kv_transfer_params.remote_host"
    )


def test_allowed_targets_and_plain_requests_reach_the_engine_unchanged(guarded):
    for params in (D, {**D, "remote_host": "P-0.pool"}, {"do_remote_decode": True}, None, ...):
        answer = post(guarded, params)
        assert answer.status_code == 200 and answer.json()["reached"], (params, answer.text)
    body = json.dumps({"prompt": "x", "kv_transfer_params": D}).encode()
    echoed = guarded.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert echoed.json()["body"] == body.decode()  # the engine reads the very bytes sent


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({**D, "remote_port": "5701"}, "kv_transfer_params.remote_port"),
        ({**D, "remote_port": 0}, "kv_transfer_params.remote_port"),
        ({**D, "remote_port": 65536}, "kv_transfer_params.remote_port"),
        ({**D, "remote_port": True}, "kv_transfer_params.remote_port"),
        ({k: v for k, v in D.items() if k != "remote_port"}, "kv_transfer_params.remote_port"),
        ({**D, "remote_host": 7}, "kv_transfer_params.remote_host"),
        ({**D, "remote_host": ""}, "kv_transfer_params.remote_host"),
        ({**D, "transfer_id": 7}, "kv_transfer_params.transfer_id"),
        ({**D, "first_token_from_prefill": "yes"}, "kv_transfer_params.first_token_from_prefill"),
        ({**D, "do_remote_prefill": "true"}, "kv_transfer_params.do_remote_prefill"),
        ({"do_remote_decode": True, "transfer_id": ""}, "kv_transfer_params.transfer_id"),
        ("10.0.0.5:5701", "kv_transfer_params"),
        ([D], "kv_transfer_params"),
    ],
)
def test_malformed_params_are_refused_naming_the_field(guarded, params, param):
    assert_refused(post(guarded, params), param)


def test_params_smuggled_in_vllm_xargs_are_checked_too(guarded):
    """vLLM copies ``vllm_xargs`` into the sampling params' extra args, where the connector
    reads ``kv_transfer_params``: a string there would otherwise reach the scheduler half."""
    answer = post(guarded, ..., vllm_xargs={"kv_transfer_params": "x"})
    assert_refused(answer, "vllm_xargs.kv_transfer_params")
    assert post(guarded, ..., vllm_xargs={"other": 1}).status_code == 200


def test_an_escaped_field_name_is_still_parsed(guarded):
    """JSON may spell the key with escapes; the shortcut that skips parsing must not miss it."""
    body = (
        '{"prompt": "x", "kv_transfer_\\u0070arams": {"do_remote_prefill": true, '
        '"transfer_id": "t", "remote_host": "192.0.2.1", "remote_port": 1}}'
    )
    answer = guarded.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_refused(answer, "kv_transfer_params.remote_host")


def test_what_the_guard_leaves_to_vllm(guarded):
    """Invalid JSON, GETs and form uploads pass untouched: vLLM answers them as it always did."""
    invalid = guarded.post(
        "/v1/completions",
        content=b"{kv_transfer_params",
        headers={"content-type": "application/json"},
    )
    assert invalid.json()["reached"]
    deep = b"[" * 100_000 + b"]" * 100_000  # RecursionError in json.loads, caught
    assert (
        guarded.post("/v1/completions", content=deep + b'"kv_transfer_params"').status_code == 200
    )
    assert guarded.get("/v1/completions").json()["reached"]
    form = guarded.post("/other", data={"kv_transfer_params": "x"})
    assert form.json()["reached"]


def test_without_an_allowlist_any_host_passes_but_malformed_params_do_not():
    with TestClient(fake_vllm_app(None)) as client:
        assert post(client, {**D, "remote_host": "203.0.113.9"}).status_code == 200
        assert_refused(post(client, {**D, "remote_port": -1}), "kv_transfer_params.remote_port")


def test_another_connector_is_passed_through():
    with TestClient(fake_vllm_app(None, connector="NixlConnector")) as client:
        assert post(client, {**D, "remote_port": -1}).status_code == 200


def test_a_client_without_the_api_key_is_left_to_vllms_own_check():
    """vLLM adds ``--middleware`` outside its API-key check: without the key the request is
    passed on unread (vLLM's check answers 401 there; this stand-in has no such check, so it
    shows the request passed unread); with the key it is checked."""
    app = fake_vllm_app({"allowed_prefill_hosts": ["10.0.0.0/24"]}, api_key=["sekrit-key"])
    bad = {**D, "remote_host": "192.0.2.1"}
    with TestClient(app) as client:
        assert post(client, bad).json()["reached"]  # unread: vLLM's own check answers it
        ok_auth = {"Authorization": "Bearer sekrit-key"}
        body = {"prompt": "x", "kv_transfer_params": bad}
        answer = client.post("/v1/completions", json=body, headers=ok_auth)
        assert_refused(answer, "kv_transfer_params.remote_host")
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer no"})
        assert wrong.json()["reached"]


def _up_servers(tmp_path, settings: dict | None = None, connector: str = "splitserve"):
    from splitserve.config import parse_deployment
    from splitserve.launch.deployment import plan_servers

    dep = parse_deployment(
        {
            "model": {"preset": "tiny", "served_name": "tiny"},
            "prefill": {"base_port": 9100, "side_channel_base_port": 9600},
            "decode": {"base_port": 9200, "side_channel_base_port": 9700},
            "connector": {"name": connector, "settings": settings or {}},
            "proxy": {"port": 9000},
        }
    )
    return plan_servers(dep, tmp_path)


def _argv_value(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_up_starts_every_splitserve_server_with_the_guard_and_a_loopback_allowlist(tmp_path):
    """``splitserve up``'s servers: the guard reads the very --kv-transfer-config the connector
    reads, so the two walls allow the same hosts (loopback: where up's prefill servers are)."""
    from splitserve.launch.engines import SPLITSERVE_GUARD

    for server in _up_servers(tmp_path):
        argv = server.command.argv
        assert _argv_value(argv, "--middleware") == [SPLITSERVE_GUARD]
        kv = json.loads(_argv_value(argv, "--kv-transfer-config")[0])
        app = fake_vllm_app(kv["kv_connector_extra_config"])
        with TestClient(app) as client:
            assert post(client, {**D, "remote_host": "127.0.0.1"}).status_code == 200
            refused = post(client, D)  # 10.0.0.5: not this host
            assert_refused(refused, "kv_transfer_params.remote_host")
    mine = _up_servers(tmp_path, {"allowed_prefill_hosts": ["10.0.0.0/8"]})[1].command.argv
    kv = json.loads(_argv_value(mine, "--kv-transfer-config")[0])
    assert kv["kv_connector_extra_config"]["allowed_prefill_hosts"] == ["10.0.0.0/8"]
    for server in _up_servers(tmp_path, connector="nixl"):
        assert "--middleware" not in server.command.argv
