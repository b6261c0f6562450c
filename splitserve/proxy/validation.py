"""Checks on a client's request body before anything is sent upstream.

Runs in the proxy process. Only what the proxy itself needs is checked here (a JSON object, the
prompt or messages, the stream flag, one choice per request); the engine validates the rest and
its 4xx answer is relayed as is. Invariant: every rejection is a ``BadRequest`` naming the field.
"""

from __future__ import annotations

from typing import Any

from splitserve.proxy import jsonio
from splitserve.proxy.errors import BadRequest


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = jsonio.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("request body is not UTF-8 text") from None
    except ValueError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_common(body: dict[str, Any]) -> None:
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise BadRequest(
            "'n' must be 1: each choice would need its own prefill/decode pair", param="n"
        )
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BadRequest(f"'{field}' must be a positive integer", param=field)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")


def check_completion(body: dict[str, Any]) -> None:
    """``/v1/completions``: one prompt (text, or a list of token ids)."""
    if "prompt" not in body:
        raise BadRequest("missing required field 'prompt'", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    ok = (isinstance(prompt, str) and prompt != "") or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    if not ok:
        raise BadRequest(
            "'prompt' must be one non-empty string or one list of token ids (batched prompts "
            "are not supported through the prefill/decode proxy: send one request per prompt)",
            param="prompt",
        )
    _check_common(body)


def check_chat(body: dict[str, Any]) -> None:
    """``/v1/chat/completions``: a non-empty list of message objects."""
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("missing required field 'messages'", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest(f"messages[{i}] must be an object with a 'role'", param="messages")
    _check_common(body)
