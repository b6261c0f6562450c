"""A fleet to simulate: pools of prefill, decode and colocated servers, each of a hardware type.

Pure data (pydantic, validated at the edge); runs in the simulating process.

Prices: ``GPU_PRICES`` are on-demand dollars per GPU-hour, the middle of the "specialty cloud"
range of one published survey (Mercatus, "Cloud GPU pricing", May 2026,
https://www.mercatus-ai.com/blog/cloud-gpu-pricing: A100 80GB $1.10-1.50, H100 SXM5
$2.50-3.50, H200 SXM5 $3.50-4.50) and, for B200, RunPod's published rate as quoted by
usagepricing.com ("GPU-hour pricing": B200 $5.89/h). Prices move; give your own with
``--price GPU=DOLLARS`` (or ``prices:`` in a fleet file).

Invariants: a fleet has either a colocated pool or both a prefill and a decode pool (or all
three); every pool's hardware is a catalog accelerator or a calibration file's.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The roles of a pool (``PoolSpec.role``), as the simulator's engine and servers compare them.
PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"

GPU_PRICES: dict[str, float] = {
    "A100": 1.30,  # Mercatus May 2026, specialty tier $1.10-1.50 (middle)
    "H100": 3.00,  # Mercatus May 2026, specialty tier $2.50-3.50 (middle)
    "H200": 4.00,  # Mercatus May 2026, specialty tier $3.50-4.50 (middle)
    "B200": 5.89,  # RunPod list price via usagepricing.com, 2026
}
PRICE_SOURCES = {
    "A100": "Mercatus cloud GPU pricing survey, May 2026 (specialty tier, middle)",
    "H100": "Mercatus cloud GPU pricing survey, May 2026 (specialty tier, middle)",
    "H200": "Mercatus cloud GPU pricing survey, May 2026 (specialty tier, middle)",
    "B200": "RunPod list price quoted by usagepricing.com, 2026",
}


def price_of(gpu: str, prices: dict[str, float]) -> float:
    """Dollars per GPU-hour of ``gpu``: the user's price, else the catalog default, else NaN
    (a calibrated machine has no list price: costs then read n/a until ``--price`` gives one)."""
    for table in (prices, GPU_PRICES):
        for name, value in table.items():
            if name.lower() == gpu.lower():
                return value
    return math.nan


class PoolSpec(BaseModel):
    """``count`` servers of one role on ``gpu`` (``gpus`` per server, tensor parallel)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(pattern="^(prefill|decode|colocated)$")
    count: int = Field(ge=0)
    gpu: str = "H100"
    gpus: int = Field(1, ge=1, description="GPUs per server")
    budget: str = Field(
        "fixed",
        pattern="^(fixed|adaptive)$",
        description="prefill token budget: max_num_batched_tokens, or the adaptive policy",
    )


class ServerSettings(BaseModel):
    """Engine settings every server shares (vLLM's names and GPU defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_batched_tokens: int = Field(8192, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    chunked_prefill: bool = Field(
        True, description="False: vLLM V0's default, prompts whole in prefill-only steps first"
    )
    efficiency: float = Field(1.0, gt=0, le=1, description="share of peak FLOP/s and bandwidth")
    step_overhead_ms: float = Field(0.0, ge=0, description="fixed cost added to every step")
    prefix_cache_entries: int = Field(256, ge=0, description="shared heads a server keeps")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="vLLM's cap on one prompt's tokens in a step (0: none)"
    )
    adaptive_target_itl_ms: float | None = Field(
        None, gt=0, description="the adaptive budget's target (None: the tightest class's ITL)"
    )
    adaptive_min_chunk: int | None = Field(
        None, ge=1, description="the adaptive budget's min_chunk, a multiple of block_size "
        "(None: the policy's default floor, which follows the target)",
    )  # fmt: skip
    adaptive_share_prefill: bool = Field(
        True, description="the adaptive budget shares its prefill tokens max-min fairly among "
        "pending prompts (the policy's share_prefill)",
    )  # fmt: skip
    block_size: int = Field(
        16, ge=1, description="the engine's KV block (vLLM: 16 on GPU, 128 on CPU): the "
        "adaptive budget's alignment and the per-request rule's prefix granularity",
    )  # fmt: skip
    kv_dtype: str = "bf16"
    weight_bytes: int = Field(2, ge=1, le=4)


class RoutingSpec(BaseModel):
    """The proxy's routing (its policy names) and the per-request disaggregation rule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill: str = Field(
        "least_outstanding", pattern="^(round_robin|least_outstanding|power_of_two)$"
    )
    decode: str = Field(
        "least_outstanding", pattern="^(round_robin|least_outstanding|power_of_two)$"
    )
    colocated: str = Field(
        "least_outstanding", pattern="^(round_robin|least_outstanding|power_of_two)$"
    )
    prefix_affinity: bool = False
    per_request: bool = Field(False, description="the proxy's per-request rule (decide:)")
    decide_threshold_tokens: int | None = Field(
        None, ge=0, description="decide.threshold_tokens (None: the proxy's default)"
    )
    decode_prefill_cost_ratio: float | None = Field(
        None, gt=0, description="decide's D/P prefill cost per token (None: from the pools)"
    )
    decide_busy_max_tokens: int | None = Field(
        None, ge=0, description="decide.busy_max_tokens (None: the proxy's default)"
    )
    first_token_from_prefill: bool = False


class LinkSpec(BaseModel):
    """The P->D KV path: a catalog link (or GB/s) and bulk or layer-wise streaming."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "NVLink4"
    gbps: float | None = Field(None, gt=0)
    mode: str = Field("layerwise", pattern="^(bulk|layerwise)$")


class Fleet(BaseModel):
    """Pools, engine settings, routing, link and prices of one configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pools: list[PoolSpec] = Field(min_length=1)
    server: ServerSettings = Field(default_factory=ServerSettings)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    link: LinkSpec = Field(default_factory=LinkSpec)
    prices: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shape(self) -> Fleet:
        roles = {p.role: p.count for p in self.pools}
        if len(roles) != len(self.pools):
            raise ValueError("one pool per role (prefill, decode, colocated)")
        disagg = roles.get("prefill", 0) > 0 or roles.get("decode", 0) > 0
        if disagg and not (roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0):
            raise ValueError("a prefill pool needs a decode pool and the other way round")
        if not disagg and roles.get("colocated", 0) < 1:
            raise ValueError("no servers: give colocated servers, or prefill and decode ones")
        if roles.get("colocated", 0) and disagg:
            raise ValueError("colocated and prefill/decode pools together are not simulated")
        return self

    @property
    def disaggregated(self) -> bool:
        return any(p.role == "prefill" and p.count for p in self.pools)

    def pool(self, role: str) -> PoolSpec | None:
        return next((p for p in self.pools if p.role == role), None)

    def gpu_count(self) -> int:
        return sum(p.count * p.gpus for p in self.pools)

    def cost_per_hour(self) -> float:
        return sum(p.count * p.gpus * price_of(p.gpu, self.prices) for p in self.pools)

    def label(self) -> str:
        """Short name, e.g. ``3P H100 + 5D A100 adaptive per-request`` or ``8C H100``."""
        parts = [
            f"{p.count}{p.role[0].upper()} {p.gpu}" + (f"x{p.gpus}" if p.gpus > 1 else "")
            for p in self.pools
            if p.count
        ]
        flags = []
        if any(p.budget == "adaptive" for p in self.pools if p.role != "prefill"):
            flags.append("adaptive")
        if self.disaggregated and self.routing.per_request:
            flags.append("per-request")
        if not self.server.chunked_prefill:
            flags.append("no-chunked-prefill")
        if self.routing.prefix_affinity:
            flags.append("prefix")
        if self.disaggregated and self.link.mode == "bulk":
            flags.append("bulk")
        if self.disaggregated and self.routing.first_token_from_prefill:
            flags.append("first-token-from-prefill")
        return " + ".join(parts) + "".join(f" {f}" for f in flags)


_ROLE_LETTERS = {"p": "prefill", "d": "decode", "c": "colocated"}
_FLAGS = (
    "adaptive",
    "per-request",
    "bulk",
    "layerwise",
    "prefix",
    "first-token-from-prefill",
    "no-chunked-prefill",
)


def parse_fleet(spec: str, base: Fleet) -> Fleet:
    """A fleet from ``--fleet`` text: pools ``<count><P|D|C>[:<GPU>[x<GPUs per server>]]``
    joined by ``,``, then optional ``/flag,flag`` (``adaptive``: the adaptive budget on
    decode/colocated servers; ``per-request``: the per-request rule; ``bulk`` / ``layerwise``:
    the handoff; ``prefix``: prefix-affinity routing; ``first-token-from-prefill``;
    ``no-chunked-prefill``: whole prompts in prefill-only steps, vLLM V0's default).
    Example: ``2P:H100,6D:A100/adaptive,per-request``. ``base`` supplies everything else."""
    head, _, tail = spec.partition("/")
    pools = []
    default = base.pools[0]
    for term in head.split(","):
        term = term.strip()
        count_role, _, hw = term.partition(":")
        if len(count_role) < 2 or not count_role[:-1].isdigit():
            raise ValueError(
                f"--fleet {spec!r}: {term!r} is not <count><P|D|C>[:GPU[xN]] (e.g. 2P:H100)"
            )
        role = _ROLE_LETTERS.get(count_role[-1].lower())
        if role is None:
            raise ValueError(f"--fleet {spec!r}: role letter of {term!r} must be P, D or C")
        gpu, gpus = default.gpu, default.gpus
        if hw:
            name, _, n = hw.partition("x")
            gpu = name or gpu
            if n:
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f"--fleet {spec!r}: GPUs per server in {term!r}")
                gpus = int(n)
        pools.append(PoolSpec(role=role, count=int(count_role[:-1]), gpu=gpu, gpus=gpus))
    flags = [f.strip().lower() for f in tail.split(",") if f.strip()]
    unknown = [f for f in flags if f not in _FLAGS]
    if unknown:
        raise ValueError(f"--fleet {spec!r}: unknown flag(s) {unknown}; known: {list(_FLAGS)}")
    if "adaptive" in flags:
        pools = [p.model_copy(update={"budget": "adaptive"}) for p in pools]
    routing = base.routing.model_copy(
        update={
            "per_request": "per-request" in flags or base.routing.per_request,
            "prefix_affinity": "prefix" in flags or base.routing.prefix_affinity,
            "first_token_from_prefill": "first-token-from-prefill" in flags
            or base.routing.first_token_from_prefill,
        }
    )
    link = base.link
    if "bulk" in flags or "layerwise" in flags:
        link = link.model_copy(update={"mode": "bulk" if "bulk" in flags else "layerwise"})
    server = base.server
    if "no-chunked-prefill" in flags:
        server = server.model_copy(update={"chunked_prefill": False})
    return Fleet(pools=pools, server=server, routing=routing, link=link, prices=base.prices)
