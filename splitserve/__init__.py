"""splitserve: disaggregated prefill/decode serving on stock vLLM and SGLang.

Importing the top-level package imports nothing heavy: engine adapters
(`splitserve.connectors.vllm`, `splitserve.schedulers.vllm`, ...) import their engine
themselves, and the engine-agnostic parts (`transfer`, `proxy`, `planner`) never do.
"""

__version__ = "0.1.0"
