"""The engine dispatch protocols (splitserve.proxy.dispatch) build exactly the contract's bodies."""

from __future__ import annotations

import copy
import os

import pytest

from splitserve.proxy import dispatch

BODY = {
    "model": "tiny",
    "prompt": "hello world",
    "max_tokens": 16,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_ids_stay_unique_across_buffer_refills() -> None:
    n = 3 * dispatch._RandomBytes._SIZE // 16  # several refills of the urandom buffer
    ids = [dispatch.new_transfer_id() for _ in range(n)]
    assert len(set(ids)) == n and all(len(t) == 32 for t in ids)
    rooms = {dispatch.new_bootstrap_room() for _ in range(1000)}
    assert len(rooms) == 1000 and all(0 <= r < 2**63 for r in rooms)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_forked_child_draws_other_ids_than_its_parent() -> None:
    dispatch.new_transfer_id()  # the buffer is filled before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ids and leave at once
        os.write(write, "".join(dispatch.new_transfer_id() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 4096).decode()
    os.close(read)
    parent = "".join(dispatch.new_transfer_id() for _ in range(4))
    assert child and child != parent


def test_new_transfer_id_is_fresh_uuid4_hex() -> None:
    ids = {dispatch.new_transfer_id() for _ in range(100)}
    assert len(ids) == 100
    for tid in ids:
        assert len(tid) == 32
        int(tid, 16)


def test_vllm_concurrent_bodies_follow_contract() -> None:
    original = copy.deepcopy(BODY)
    prefill, decode = dispatch.vllm_concurrent_requests(BODY, "tid1", "10.0.0.5", 7001)
    assert original == BODY, "caller's body must not change"
    assert decode == {
        **BODY,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": "tid1",
            "remote_host": "10.0.0.5",
            "remote_port": 7001,
        },
    }
    assert prefill["max_tokens"] == 1
    assert prefill["stream"] is False
    assert "stream_options" not in prefill
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "tid1"}
    assert prefill["prompt"] == BODY["prompt"] and prefill["temperature"] == 0


def test_vllm_concurrent_rejects_empty_transfer_id() -> None:
    with pytest.raises(dispatch.DispatchError, match="transfer_id"):
        dispatch.vllm_concurrent_requests(BODY, "", "h", 1)


def test_prefill_caps_max_completion_tokens_and_drops_min_tokens() -> None:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "min_tokens": 5,
    }
    prefill = dispatch.vllm_sequential_prefill_request(chat)
    assert prefill["max_tokens"] == 1
    assert prefill["max_completion_tokens"] == 1
    assert "min_tokens" not in prefill
    assert prefill["messages"] == chat["messages"]


def test_vllm_sequential_prefill_stock_params() -> None:
    prefill = dispatch.vllm_sequential_prefill_request(BODY)
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert prefill["stream"] is False and prefill["max_tokens"] == 1
    assert "stream_options" not in prefill
    assert "request_id" not in prefill
    with_id = dispatch.vllm_sequential_prefill_request(BODY, "abc")
    assert with_id["kv_transfer_params"]["transfer_id"] == "abc"
    assert with_id["request_id"] == "abc"  # P and D serve it under one id (NixlPushConnector)


def test_vllm_sequential_decode_passes_prefill_params_unchanged() -> None:
    returned = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e1",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
    }
    decode = dispatch.vllm_sequential_decode_request(BODY, {"kv_transfer_params": returned})
    assert decode == {**BODY, "kv_transfer_params": returned}
    # P's answer is handed over, not copied (its block ids can be thousands of integers).
    assert decode["kv_transfer_params"] is returned
    same_id = dispatch.vllm_sequential_decode_request(BODY, {"kv_transfer_params": returned}, "t")
    assert same_id["request_id"] == "t"


@pytest.mark.parametrize("answer", [{}, {"kv_transfer_params": None}, [], "x"])
def test_vllm_sequential_decode_without_params_is_an_error(answer: object) -> None:
    with pytest.raises(dispatch.DispatchError):
        dispatch.vllm_sequential_decode_request(BODY, answer)  # type: ignore[arg-type]


def test_client_cannot_inject_transfer_fields() -> None:
    hostile = {
        **BODY,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil.example"},
        "bootstrap_host": "evil.example",
        "bootstrap_port": 1,
        "bootstrap_room": 5,
    }
    prefill, decode = dispatch.vllm_concurrent_requests(hostile, "t", "127.0.0.1", 9)
    for b in (prefill, decode):
        assert "bootstrap_host" not in b
    assert decode["kv_transfer_params"]["remote_host"] == "127.0.0.1"
    seq = dispatch.vllm_sequential_prefill_request(hostile)
    assert seq["kv_transfer_params"]["remote_host"] is None
    sp, sd = dispatch.sglang_requests(hostile, "10.1.1.1", 8998, 42)
    for b in (sp, sd):
        assert b["bootstrap_host"] == "10.1.1.1" and b["bootstrap_room"] == 42
        assert "kv_transfer_params" not in b


def test_sglang_bodies() -> None:
    room = dispatch.new_bootstrap_room()
    assert 0 <= room < 2**63
    prefill, decode = dispatch.sglang_requests(BODY, "10.0.0.7", 8998, room)
    fields = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998, "bootstrap_room": room}
    assert decode == {**BODY, **fields}
    assert prefill == {
        **{k: v for k, v in BODY.items() if k != "stream_options"},
        **fields,
        "stream": False,
    }
    assert prefill["max_tokens"] == BODY["max_tokens"], "SGLang P keeps the sampling settings"
    none_port, _ = dispatch.sglang_requests(BODY, "h", None, 0)
    assert none_port["bootstrap_port"] is None


@pytest.mark.parametrize("room", [-1, 2**63])
def test_sglang_room_range(room: int) -> None:
    with pytest.raises(dispatch.DispatchError, match="bootstrap_room"):
        dispatch.sglang_requests(BODY, "h", 1, room)


def test_non_object_body_is_an_error() -> None:
    with pytest.raises(dispatch.DispatchError, match="JSON object"):
        dispatch.vllm_sequential_prefill_request(["not", "a", "dict"])  # type: ignore[arg-type]
