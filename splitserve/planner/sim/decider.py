"""The per-request disaggregation rule in the simulator: the proxy's own, called as the proxy
calls it.

Pure; runs in the simulating process. ``splitserve.proxy.decide`` holds the rule the proxy
runs (straight to D when D holds most of the prompt, when its uncached tokens are at most
``threshold_tokens``, or when P's queued work would delay it beyond D's own prefill; otherwise
through P) and the proxy's estimate of P's queue (``QueueEstimate``: requests in flight on the
chosen P times the mean uncached prompt it sent to P). :class:`ProxyDecider` feeds them what
the simulator knows in the proxy's terms:

- the prompt's tokens, and the tokens the chosen D holds: its shared head, if D's prefix
  cache has it, in whole KV blocks (the proxy's ``PrefixIndex`` counts whole blocks of token
  ids; a simulated request has a head id and a length instead of token ids);
- P's requests in flight: its ``Backend.outstanding``, as the proxy reads it.

``decode_prefill_cost_ratio`` (D's prefill cost per token over P's) is set from the two pools'
step times when the settings leave it at 1 and the pools' hardware differs.
"""

from __future__ import annotations

from splitserve.proxy.decide import DecisionInputs, DecisionSettings, QueueEstimate, decide


class ProxyDecider:
    """``splitserve.proxy.decide.decide`` with the proxy's queue estimate (one per proxy)."""

    def __init__(self, settings: DecisionSettings) -> None:
        self.settings = settings
        self.queue = QueueEstimate()

    def decide(self, prompt_tokens: int, held_tokens: int, p_in_flight: int) -> tuple[bool, str]:
        """``(True, reason)`` to prefill on D, ``(False, reason)`` to go through P."""
        block = self.settings.block_tokens
        cached = min(held_tokens // block * block, max(0, prompt_tokens - 1))
        d = decide(
            self.settings,
            DecisionInputs(prompt_tokens, cached, self.queue.tokens_ahead(p_in_flight)),
        )
        if d.route == "disaggregate":
            self.queue.observe(d.uncached_tokens)
        return d.route == "decode", d.reason
