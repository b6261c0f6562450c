"""The proxy's per-request disaggregation at run time: count a request's prompt tokens with the
model's own tokenizer, look up what the chosen decode server holds, ask ``decide`` (pure) and
report the answer as metrics and debug logs.

Runs in the proxy process, on its event loop; tokenizing a long prompt runs on the loop's
default thread pool (``DecisionSettings.thread_chars``), so a long prompt never holds the loop
for the other requests. Imports no engine: the tokenizer is the ``tokenizers`` library on the
model's ``tokenizer.json``, the chat template is rendered with ``jinja2`` (what transformers
does, without importing it).

How a prompt is counted (vLLM's own rules, so the counts match the engine's):
- completions: a string is encoded with the tokenizer's special tokens (vLLM's
  ``add_special_tokens`` default there); token ids are taken as they are; a batch of prompts
  counts all of them (and is not looked up in the prefix index);
- chat: the model's chat template with ``add_generation_prompt``, encoded without special
  tokens (the template writes them); a model without a template, or a template that fails on
  these messages, counts the text of the messages joined by newlines (its parts of type
  ``text``), a close estimate.

Invariants: a failure here never fails a request: anything unexpected routes it through P
(``reason=error``, logged once per kind); the decision never changes a body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.proxy.config import ConfigError
from splitserve.proxy.decide import (
    Decision,
    DecisionInputs,
    DecisionSettings,
    PrefixIndex,
    QueueEstimate,
    decide,
)
from splitserve.proxy.routing import Backend

logger = logging.getLogger(__name__)

_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class PromptCounter:
    """The model's tokenizer and chat template, loaded once per proxy process."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ConfigError(
                f"decide.tokenizer: {file} not found; give the model directory (with its "
                "tokenizer.json) or the tokenizer.json file"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception on a bad file
            raise ConfigError(f"decide.tokenizer: cannot load {file}: {e}") from None
        self.template, self.special = _chat_template(file.parent)

    def completion_ids(self, prompt: Any) -> list[int] | int | None:
        """Token ids of one prompt, the total count of a batch, or None when it is no prompt."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) for t in prompt):
                return list(prompt)
            total = 0
            for one in prompt:
                ids = self.completion_ids(one)
                if ids is None:
                    return None
                total += ids if isinstance(ids, int) else len(ids)
            return total
        return None

    def chat_ids(self, messages: Any) -> list[int]:
        text = None
        if self.template is not None:
            try:
                text = self.template.render(
                    messages=messages, add_generation_prompt=True, **self.special
                )
            except Exception as e:  # a template may refuse these messages: count the text
                logger.debug("chat template failed (%s): counting the messages' text", e)
        if text is None:
            return self.tokenizer.encode(_messages_text(messages), add_special_tokens=True).ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _chat_template(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The model's chat template (``chat_template.jinja``, or ``chat_template`` in
    ``tokenizer_config.json``), compiled, and the special tokens it may name."""
    config: dict[str, Any] = {}
    cfg_file = model_dir / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except (OSError, ValueError):
            config = {}
    source = None
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text()
    elif isinstance(config.get("chat_template"), str):
        source = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in config["chat_template"]}
        source = named.get("default")
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    if source is None:
        return None, special
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source), special
    except TemplateError as e:
        logger.warning("the model's chat template does not compile (%s): counting text", e)
        return None, special


def _messages_text(messages: Any) -> str:
    parts: list[str] = []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for c in content:
                if isinstance(c, dict) and c.get("type") == "text":
                    text = c.get("text")
                    if isinstance(text, str):
                        parts.append(text)
    return "\n".join(parts)


def _prompt_chars(body: dict[str, Any], route: str) -> int:
    """A cheap size of the prompt, to choose between the loop and a thread."""
    source = body.get("messages") if route == "chat" else body.get("prompt")
    if isinstance(source, str):
        return len(source)
    if isinstance(source, list):
        return sum(len(str(x)) for x in source) if len(source) < 256 else 1 << 30
    return 0


class DecisionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "splitserve_proxy_decisions", "Per-request disaggregation decisions, by route "
            "(decode: straight to D; disaggregate: through P) and reason",
            ["route", "reason"], registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Histogram(
            "splitserve_proxy_decision_prompt_tokens", "Prompt tokens of decided requests",
            ["route"], buckets=_TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.uncached_tokens = Histogram(
            "splitserve_proxy_decision_uncached_tokens",
            "Prompt tokens the chosen D does not hold, of decided requests",
            ["route"], buckets=_TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.count_seconds = Histogram(
            "splitserve_proxy_decision_count_seconds", "Time to count a prompt's tokens",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1), registry=registry,
        )  # fmt: skip


class Decider:
    """One proxy's decider: the counter, the prefix index, P's queue estimate, the metrics."""

    def __init__(
        self, settings: DecisionSettings, registry: CollectorRegistry, loop: Any = None
    ) -> None:
        if settings.tokenizer is None:
            raise ConfigError(
                "decide.tokenizer: give the model directory (its tokenizer.json); `splitserve "
                "up` fills it in"
            )
        self.settings = settings
        self.counter = PromptCounter(settings.tokenizer)
        self.index = PrefixIndex(settings.block_tokens, settings.prefix_blocks)
        self.queue = QueueEstimate()
        self.metrics = DecisionMetrics(registry)
        self._loop = loop
        self._failed: set[str] = set()

    def count(self, body: dict[str, Any], route: str) -> list[int] | int | None:
        """The prompt's token ids (one prompt) or its token count (a batch); blocking."""
        if route == "chat":
            return self.counter.chat_ids(body.get("messages"))
        return self.counter.completion_ids(body.get("prompt"))

    async def straight_to_decode(
        self, body: dict[str, Any], route: str, p: Backend, d: Backend
    ) -> bool:
        """Decide for one attempt on the pair (p, d): True sends it to ``d`` alone."""
        loop = self._loop or asyncio.get_running_loop()
        t0 = loop.time()
        try:
            if _prompt_chars(body, route) > self.settings.thread_chars:
                ids = await loop.run_in_executor(None, self.count, body, route)
            else:
                ids = self.count(body, route)
        except Exception as e:  # never fail a request over its count: take P
            self._error(type(e).__name__, e)
            return False
        self.metrics.count_seconds.observe(loop.time() - t0)
        if ids is None:
            self._error("no_prompt", "no prompt to count")
            return False
        return self.decide_counted(ids, p, d).route == "decode"

    def decide_counted(self, ids: Sequence[int] | int, p: Backend, d: Backend) -> Decision:
        """Decide for a counted prompt, record it, report it (blocking-free)."""
        batch = isinstance(ids, int)
        n = ids if isinstance(ids, int) else len(ids)
        cached = 0 if batch else self.index.cached_tokens(d.url, ids)  # type: ignore[arg-type]
        decision = decide(
            self.settings, DecisionInputs(n, cached, self.queue.tokens_ahead(p.outstanding))
        )
        if not batch:
            self.index.record(d.url, ids)  # type: ignore[arg-type]
        if decision.route == "disaggregate":
            self.queue.observe(decision.uncached_tokens)
        m = self.metrics
        m.decisions.labels(decision.route, decision.reason).inc()
        m.prompt_tokens.labels(decision.route).observe(n)
        m.uncached_tokens.labels(decision.route).observe(decision.uncached_tokens)
        logger.debug(
            "decision route=%s reason=%s prompt_tokens=%d cached_on_decode=%d p_in_flight=%d "
            "decode=%s",
            decision.route,
            decision.reason,
            n,
            cached,
            p.outstanding,
            d.url,
        )
        return decision

    def _error(self, kind: str, detail: object) -> None:
        self.metrics.decisions.labels("disaggregate", "error").inc()
        if kind not in self._failed:
            self._failed.add(kind)
            logger.warning("cannot count a prompt (%s: %s): sent through P", kind, detail)
