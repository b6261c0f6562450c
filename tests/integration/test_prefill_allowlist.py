"""D refuses prefill targets it is not allowed to contact, at request time, with a 400 naming the
field (issue #15): a real vLLM D with SplitserveConnector, ``allowed_prefill_hosts:
["127.0.0.1"]`` and the request guard (``--middleware``, as ``splitserve up`` starts it), fed
by the shared pair's ``ss-a`` as P. The connector's own check behind it (a server without the
guard serves malformed params locally) is ``test_connector_vllm``'s
``test_malformed_kv_transfer_params_are_served_locally``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from metrics_text import fetch_metrics, metric_sum
from test_connector_vllm import (
    assert_same,
    body_for,
    concurrent_flow,
    first_token_flow,
    prompt_of,
    reference,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def guarded_d(ss_third) -> tuple[str, int]:
    """``(url, side_port)`` of a D that may contact prefill side channels on 127.0.0.1 only
    (``ss-c``, tests/integration/conftest.py)."""
    return ss_third.url, ss_third.side_port


def post_raw(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def d_params(host: str, port: int | str) -> dict:
    return {
        "do_remote_prefill": True,
        "transfer_id": "refused-" + str(port),
        "remote_host": host,
        "remote_port": port,
    }


def served(url: str) -> float:
    return metric_sum(fetch_metrics(url), "vllm:request_success_total")


def test_refused_targets_get_a_400_naming_the_field(guarded_d, ss_pair):
    d_url, _ = guarded_d
    p_side = ss_pair["ss-a"][1]
    before = served(d_url)
    failed_before = metric_sum(fetch_metrics(d_url), "vllm:splitserve_loads_failed_total")
    prompt = prompt_of(40, 9100)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", body_for(prompt), d_params("10.255.0.1", p_side), "remote_host"),
        ("/v1/chat/completions", chat, d_params("localhost", p_side), "remote_host"),
        ("/v1/completions", body_for(prompt), d_params("127.0.0.1", "x"), "remote_port"),
        ("/v1/completions", body_for(prompt), d_params("127.0.0.1", 70000), "remote_port"),
    ]
    for path, body, params, field in cases:
        status, answer = post_raw(d_url, path, {**body, "kv_transfer_params": params})
        assert status == 400, (path, params, answer)
        assert answer["error"]["param"] == f"kv_transfer_params.{field}", answer
        assert f"kv_transfer_params.{field}" in answer["error"]["message"], answer
    status, answer = post_raw(
        d_url, "/v1/completions", {**body_for(prompt), "vllm_xargs": {"kv_transfer_params": "x"}}
    )
    assert status == 400 and answer["error"]["param"] == "vllm_xargs.kv_transfer_params", answer
    # None reached the engine: nothing served, no load tried (so no address was contacted).
    assert served(d_url) == before
    assert metric_sum(fetch_metrics(d_url), "vllm:splitserve_loads_failed_total") == failed_before


@pytest.mark.parametrize("flow", [concurrent_flow, first_token_flow])
def test_an_allowed_prefill_server_still_transfers(guarded_d, ss_pair, flow):
    p = ss_pair["ss-a"]
    d_url, _ = guarded_d
    loaded = metric_sum(fetch_metrics(d_url), "vllm:splitserve_loads_completed_total")
    prompt = prompt_of(300, 9200 + (flow is first_token_flow))
    assert_same(flow(p, guarded_d, prompt), reference(p[0], prompt), flow.__name__)
    assert metric_sum(fetch_metrics(d_url), "vllm:splitserve_loads_completed_total") > loaded
