"""Stitching one client answer from P's first token and D's continuation (first token from P).

Pure functions and one small stream rewriter; runs in the proxy process, imports no engine.

With ``first_token_from_prefill`` the client's first token is the one P sampled: the proxy
sends it as soon as P answers, and D (which continues from prompt + that token) produces the
rest. This module decides which requests may go that way, turns P's one-token answer into the
client's first chunk(s), rewrites D's stream (one ``id``, no second chat role chunk, usage that
counts P's token) and merges the two non-streamed answers.

Invariants:
- The client sees one ordinary OpenAI answer: one ``id`` across all chunks, ``usage`` with
  ``completion_tokens`` = 1 + D's and ``prompt_tokens`` as the engines count them.
- A request goes this way only when every field it carries is known to mean the same with the
  first token sampled on P (``first_token_eligible``); anything else takes the plain flow.
- Rewriting never drops an event it does not understand: non-JSON data lines (``[DONE]``) and
  error events pass unchanged.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from splitserve.proxy import jsonio

# Fields that mean the same when P samples the first token and D the rest. Anything else
# (logprobs, echo, seeds, penalties that count output tokens, structured output, tools, ...)
# makes the proxy use the plain concurrent flow for that request.
_SAFE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "n",
        "user",
        "ignore_eos",
        "repetition_penalty",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "priority",
        "cache_salt",
        "kv_transfer_params",  # replaced by the proxy anyway
    }
)
# Fields allowed only at their neutral value.
_NEUTRAL = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logprobs": (None, False),
    "echo": (None, False),
    "seed": (None,),
    "min_tokens": (None, 0),
}


def max_new_tokens(body: dict[str, Any]) -> int | None:
    """The client's output-token limit, when it gave one."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The request's stop strings (``stop``: one string or a list), empty ones left out."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


def stop_may_span_seam(body: dict[str, Any], first_text: str) -> bool:
    """True when a stop string could begin inside the first token's text and end in D's: the
    text ends with a non-empty proper prefix of one. D checks stop strings on its own text
    only, so such a match would go unseen; the proxy then serves the request in the plain
    flow, where D's engine sees the whole output. A stop string within the first token's text
    is P's (its answer says ``stop``); one within D's text is D's."""
    for stop in stop_strings(body):
        for k in range(1, min(len(stop), len(first_text) + 1)):
            if first_text.endswith(stop[:k]):
                return True
    return False


def plain_flow_reason(body: dict[str, Any], first_text: str) -> str | None:
    """Why a request whose first token P answered must not continue from it on D, or None.

    - ``empty_first_token_text``: the token has no text of its own, typically the first bytes
      of a character split over several tokens (vLLM's detokenizer holds those back). D's
      detokenizer never sees the token, so it would render D's first token without those
      bytes (a U+FFFD where a colocated server prints the character).
    - ``stop_string_at_seam``: see ``stop_may_span_seam``.
    """
    if first_text == "":
        return "empty_first_token_text"
    if stop_may_span_seam(body, first_text):
        return "stop_string_at_seam"
    return None


def first_token_eligible(body: dict[str, Any]) -> bool:
    """True when ``body`` may be served with P's first token and D's continuation."""
    for key, value in body.items():
        if key in _SAFE_FIELDS:
            continue
        if key in _NEUTRAL and any(value == v and type(value) is type(v) for v in _NEUTRAL[key]):
            continue
        if key in _NEUTRAL and value is None:
            continue
        return False
    options = body.get("stream_options")
    return options is None or isinstance(options, dict)


@dataclass(slots=True)
class PrefillHead:
    """The client's first token, from P's (non-streamed, one-token) answer (what the proxy
    sends first; not ``transfer.messages.FirstToken``, the connector's message to D). Not
    changed once made (a plain slotted class: a frozen one costs several microseconds to build,
    once per request)."""

    chat: bool
    id: str
    created: int
    model: str
    text: str
    finish_reason: str | None
    stop_reason: Any
    prompt_tokens: int | None

    @classmethod
    def from_prefill_answer(cls, answer: dict[str, Any], chat: bool) -> PrefillHead:
        """Raises ``ValueError`` when the answer is not a one-choice completion."""
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ValueError("prefill answer has no single choice")
        choice = choices[0]
        if chat:
            message = choice.get("message") or {}
            text = message.get("content") or ""
        else:
            text = choice.get("text") or ""
        if not isinstance(text, str):
            raise ValueError("prefill answer's text is not a string")
        usage = answer.get("usage") or {}
        return cls(
            chat=chat,
            id=str(answer.get("id", "")),
            created=int(answer.get("created", 0)),
            model=str(answer.get("model", "")),
            text=text,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
        )

    def ends_request(self, body: dict[str, Any]) -> bool:
        """The first token is the last one: P stopped (EOS, stop token or string) or the
        client asked for one token."""
        return self.finish_reason == "stop" or max_new_tokens(body) == 1

    def usage(self, completion_tokens: int = 1) -> dict[str, int]:
        prompt = self.prompt_tokens or 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    # ---------------------------------------------------------------- streamed answers

    def _chunk(self, choice: dict[str, Any], usage: dict[str, int] | None) -> bytes:
        event: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if usage is not None:
            event["usage"] = usage
        return b"data: " + jsonio.dumps(event) + b"\n\n"

    def head_events(self, body: dict[str, Any], last: bool) -> bytes:
        """The client's first SSE events: (chat: the role chunk, then) the first token; with
        ``last``, finished with P's finish reason, the usage chunk if asked, and ``[DONE]``."""
        options = body.get("stream_options") or {}
        continuous = bool(options.get("continuous_usage_stats"))
        usage = self.usage() if continuous else None
        finish = self.finish_reason if last else None
        stop = self.stop_reason if last else None
        out = b""
        if self.chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            out += self._chunk(
                dict(role, finish_reason=None), self.usage(0) if continuous else None
            )
            delta = {"content": self.text}
            out += self._chunk(
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": stop,
                },
                usage,
            )
        else:
            out += self._chunk(
                {
                    "index": 0,
                    "text": self.text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": stop,
                },
                usage,
            )
        if last:
            if options.get("include_usage"):
                event = {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage(),
                }
                out += b"data: " + jsonio.dumps(event) + b"\n\n"
            out += b"data: [DONE]\n\n"
        return out

    # ---------------------------------------------------------------- whole answers

    def alone(self, answer: dict[str, Any]) -> dict[str, Any]:
        """P's answer as the client's whole answer (the first token was the last)."""
        out = dict(answer)
        out.pop("kv_transfer_params", None)
        return out

    def merge(self, decode_answer: dict[str, Any]) -> dict[str, Any]:
        """D's non-streamed answer with the first token put in front (text and usage)."""
        out = dict(decode_answer)
        out["id"] = self.id or out.get("id")
        choices = out.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = dict(choices[0])
            if self.chat:
                message = dict(choice.get("message") or {})
                message["content"] = self.text + (message.get("content") or "")
                choice["message"] = message
            else:
                choice["text"] = self.text + (choice.get("text") or "")
            out["choices"] = [choice, *choices[1:]]
        out["usage"] = _count_first_token(out.get("usage"))
        out.pop("kv_transfer_params", None)
        return out


def _count_first_token(usage: Any) -> Any:
    if not isinstance(usage, dict):
        return usage
    usage = dict(usage)
    for key in ("completion_tokens", "total_tokens"):
        if isinstance(usage.get(key), int):
            usage[key] += 1
    return usage


class StreamRewriter:
    """Rewrites D's SSE stream after the first token was sent: one ``id``, no second chat role
    chunk, usage counting P's token. Feed it D's bytes as they come; it returns whole events.

    Most of D's events (one token each) need only their ``id`` changed. The first event parsed
    in full shows D's id and how D writes it (``"id":"<id>"``, with whatever spaces D puts
    around the colon); from then on an event that holds those bytes and no ``"usage"``,
    ``"role"`` or ``"error"`` string gets the id's value replaced in place instead of being
    decoded and encoded again. In JSON an unescaped ``"`` only delimits strings, so the pattern
    can only be an ``id`` key with D's id as its value, never text; and a key named like a
    marker cannot hide behind spaces, since the markers are looked for without the colon. Any
    other event is parsed."""

    def __init__(self, head: PrefillHead) -> None:
        self.head = head
        self._buffer = b""
        self._d_id: bytes | None = None  # D's ``"id":"<id>"`` bytes as D wrote them, once seen
        self._p_id = b""  # the same with P's id as the value
        self._p_value = jsonio.dumps(head.id) if head.id else None

    def feed(self, data: bytes) -> bytes:
        if self._buffer:
            data = self._buffer + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self._buffer = data  # an unterminated event waits for its end
            return b""
        end += 2
        whole, self._buffer = data[:end], data[end:]
        events = whole.split(b"\n\n")
        del events[-1]  # what follows the last "\n\n": empty
        if self._d_id is not None:
            return self._known(whole, events, self._d_id)
        # D's id not learned yet: events are parsed until one shows it (the first, usually);
        # the rest of this read goes the quick way (often all of D's answer is in by then).
        out = []
        for k, event in enumerate(events):
            rewritten = self._rewrite(event + b"\n\n")
            if rewritten:
                out.append(rewritten)
            if self._d_id is not None:
                rest = events[k + 1 :]
                if rest:
                    out.append(self._known(b"\n\n".join(rest) + b"\n\n", rest, self._d_id))
                break
        return b"".join(out)

    def _known(self, whole: bytes, events: list[bytes], d_id: bytes) -> bytes:
        """``whole``, the complete ``events``, rewritten once D's id is known."""
        # The usual run of token events: the markers are looked for once in all of them.
        quick = not _has_marker(whole)
        if quick and _all_quick(events, d_id):
            # Each event holds D's id or is [DONE]: the loop below would replace the id in
            # every one and pass [DONE] as is, which one replace over the whole read does.
            return whole.replace(d_id, self._p_id)
        out = []
        for event in events:
            event += b"\n\n"
            if quick and d_id in event:
                out.append(event.replace(d_id, self._p_id))
                continue
            rewritten = self._rewrite(event)
            if rewritten:
                out.append(rewritten)
        return b"".join(out)

    def flush(self) -> bytes:
        """What is left when D's stream ended (an unterminated last event, passed as is)."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _rewrite(self, event: bytes) -> bytes:
        d_id = self._d_id
        if d_id is not None and d_id in event and not _has_marker(event):
            return event.replace(d_id, self._p_id)
        text = event.strip()
        if not text.startswith(b"data:"):
            return event
        payload = text[5:].strip()
        if not payload.startswith(b"{"):
            return event  # [DONE]
        try:
            data = jsonio.loads(payload)
        except (ValueError, RecursionError):
            return event
        if not isinstance(data, dict) or "error" in data:
            return event
        if self._p_value is not None:
            if self._d_id is None and isinstance(data.get("id"), str):
                self._learn_id(payload, data["id"])
            data["id"] = self.head.id
        choices = data.get("choices")
        if self.head.chat and isinstance(choices, list):
            kept = []
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and "role" in delta:
                    delta = {k: v for k, v in delta.items() if k != "role"}
                    choice = dict(choice, delta=delta)
                    if not any(delta.values()) and choice.get("finish_reason") is None:
                        continue  # D's own role chunk: the client already has one
                kept.append(choice)
            if not kept and choices and data.get("usage") is None:
                return b""
            data["choices"] = kept
        if "usage" in data:
            data["usage"] = _count_first_token(data["usage"])
        return b"data: " + jsonio.dumps(data) + b"\n\n"

    def _learn_id(self, payload: bytes, d_id: str) -> None:
        """How D writes ``"id": <d_id>`` (found once in ``payload``, an event D wrote), for the
        quick path; not found (D escapes the id otherwise than orjson), the quick path stays
        off and every event is parsed."""
        value = jsonio.dumps(d_id)
        m = _ID_KEY.search(payload)
        while m is not None:
            if payload.startswith(value, m.end()):
                pattern = payload[m.start() : m.end() + len(value)]
                if payload.count(pattern) == 1:
                    self._d_id = pattern
                    self._p_id = payload[m.start() : m.end()] + self._p_value  # type: ignore[operator]
                return
            m = _ID_KEY.search(payload, m.end())


_ID_KEY = re.compile(rb'"id"\s*:\s*')


_DONE_EVENT = b"data: [DONE]"


def _all_quick(events: list[bytes], d_id: bytes) -> bool:
    """True when every one of ``events`` (split on their ``\\n\\n``) holds ``d_id``, or is
    the ``[DONE]`` event as vLLM writes it: counted in C (``map``), no Python loop per event."""
    held = sum(map(bytes.__contains__, events, itertools.repeat(d_id, len(events))))
    missing = len(events) - held
    return missing == 0 or (missing == 1 and events[-1] == _DONE_EVENT)


def _has_marker(data: bytes) -> bool:
    """True when ``data`` holds a key (or string) the quick path must not pass unparsed."""
    return b'"usage"' in data or b'"role"' in data or b'"error"' in data
