"""Adaptive chunk-size schedulers: the per-step token budget follows decode load and an ITL target.

``policy`` (with ``step_model``) is the pure, engine-agnostic decision; ``vllm`` is the adapter
for vLLM's ``--scheduler-cls``. Importing this package imports no engine.
"""
