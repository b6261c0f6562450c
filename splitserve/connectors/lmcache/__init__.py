"""LMCache composition (issue #19): prefix reuse across a prefill pool, handoff by splitserve.

LMCache's vLLM adapter has no KV connector for vLLM's CPU KV cache (``CreateGPUConnector``
raises "No supported cpu connector found"). ``cpu_paged.py`` is that connector (plain torch index
ops over vLLM's slot mapping), ``shim.py`` installs it in place of LMCache's factory only when
LMCache's platform is the CPU, and ``vllm_connector.py`` is the vLLM connector class that
installs the shim before LMCache builds its engine. See docs/lmcache.md.

Importing this package imports neither LMCache nor vLLM.
"""
