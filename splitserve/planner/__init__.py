"""The arithmetic of disaggregation: KV size, handoff per link, viability, chunk and pool advice.

A plain-Python library (no engine import: importing ``splitserve.planner`` never imports vLLM,
SGLang or torch) behind ``splitserve plan``. Modules, one job each:

- ``catalog``: model shapes (built-in or a Hugging Face ``config.json``), accelerators, links;
- ``kv``: KV bytes per token, per layer slice, per request;
- ``handoff``: bulk and layer-wise streamed transfer, exposed handoff;
- ``roofline``: FLOPs, bytes, arithmetic intensity, ridge point, step times, chunk search;
- ``pools``: prefill/decode/colocated replica sizing and the verdict;
- ``plan``: assembles all of it into a ``Plan`` (``Plan.to_dict()`` is the JSON output);
- ``calibrate`` / ``nixl_probe``: measure this machine (torch layer timing, NIXL bandwidth);
- ``report`` / ``cli``: tables and the click command.

docs/planner.md derives every formula.
"""

from splitserve.planner.catalog import (
    ACCELERATORS,
    LINKS,
    MODELS,
    Accelerator,
    Link,
    ModelShape,
    PlannerInputError,
    custom_link,
    get_accelerator,
    get_link,
    get_model,
)
from splitserve.planner.plan import Plan, make_plan
from splitserve.planner.pools import Slo, Workload

__all__ = [
    "ACCELERATORS",
    "LINKS",
    "MODELS",
    "Accelerator",
    "Link",
    "ModelShape",
    "Plan",
    "PlannerInputError",
    "Slo",
    "Workload",
    "custom_link",
    "get_accelerator",
    "get_link",
    "get_model",
    "make_plan",
]
