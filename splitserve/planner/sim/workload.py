"""What the simulated fleet serves: request classes with their SLOs, arrivals, trace files.

Pure Python (``random`` with a seed, pydantic at the edge); runs in the simulating process.
A workload is one or more request classes (share of traffic, prompt and output lengths drawn
uniformly between a minimum and a maximum, a TTFT and an inter-token target, optionally a
shared prefix) and an arrival process: Poisson at a rate, bursty (gamma inter-arrival times
with a coefficient of variation above 1, same mean rate), or a trace file.

Trace format (JSON Lines, one request per line, sorted or not)::

    {"t": 0.125, "prompt_tokens": 812, "output_tokens": 64,
     "class": "chat", "prefix_id": "sys-7", "prefix_tokens": 600}

``t`` (seconds from the start), ``prompt_tokens`` and ``output_tokens`` are required;
``class`` names a class of the workload (its SLO applies; default: the first class);
``prefix_id`` / ``prefix_tokens`` name a prompt head that other requests share (prefix caching
and prefix routing see it). A bad line stops the run with one error naming the file and line.

Invariant: the same workload, rate, count and seed always give the same requests.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitserve.planner.catalog import PlannerInputError, explain_validation


class RequestClass(BaseModel):
    """One kind of request: its lengths, its share of arrivals, its SLO."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "default"
    share: float = Field(1.0, gt=0, description="relative share of arrivals")
    prompt_min: int = Field(ge=1)
    prompt_max: int = Field(ge=1)
    output_min: int = Field(ge=1)
    output_max: int = Field(ge=1)
    ttft_ms: float = Field(gt=0, description="time-to-first-token target")
    itl_ms: float = Field(gt=0, description="inter-token target (see Workload.itl_metric)")
    prefix_tokens: int = Field(0, ge=0, description="length of a shared prompt head")
    prefix_groups: int = Field(0, ge=0, description="distinct shared heads (0: none)")

    @model_validator(mode="after")
    def _check(self) -> RequestClass:
        if self.prompt_min > self.prompt_max:
            raise ValueError(f"class {self.name}: prompt_min exceeds prompt_max")
        if self.output_min > self.output_max:
            raise ValueError(f"class {self.name}: output_min exceeds output_max")
        if self.prefix_groups and self.prefix_tokens >= self.prompt_min:
            raise ValueError(f"class {self.name}: prefix_tokens must be below prompt_min")
        return self


class Workload(BaseModel):
    """Request classes and how they arrive."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: list[RequestClass] = Field(min_length=1)
    arrival: str = Field("poisson", pattern="^(poisson|bursty)$")
    burstiness: float = Field(
        3.0, ge=1.0, description="bursty: coefficient of variation of inter-arrival times"
    )
    itl_metric: str = Field(
        "mean",
        pattern="^(mean|max|p99)$",
        description="per request: mean gap after the first token (TPOT), its largest gap, or "
        "the 99th percentile of its own gaps (nearest rank)",
    )

    @model_validator(mode="after")
    def _names(self) -> Workload:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")
        return self

    @classmethod
    def single(
        cls,
        prompt_tokens: int,
        output_tokens: int,
        ttft_ms: float,
        itl_ms: float,
        **extra: object,
    ) -> Workload:
        """One class of fixed lengths (the ``plan``-style shortcut)."""
        rc = RequestClass(
            prompt_min=prompt_tokens,
            prompt_max=prompt_tokens,
            output_min=output_tokens,
            output_max=output_tokens,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
        )
        return cls(classes=[rc], **extra)  # type: ignore[arg-type]

    def mean_tokens(self) -> tuple[float, float]:
        """Mean prompt and output tokens per request."""
        total = sum(c.share for c in self.classes)
        prompt = sum(c.share * (c.prompt_min + c.prompt_max) / 2 for c in self.classes)
        output = sum(c.share * (c.output_min + c.output_max) / 2 for c in self.classes)
        return prompt / total, output / total


def load_workload(path: Path) -> Workload:
    """A workload from YAML or JSON; errors name the file and field."""
    import yaml  # noqa: PLC0415  (only when a file is given)

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PlannerInputError(f"--workload {path}: {e}") from None
    try:
        return Workload.model_validate(data)
    except ValidationError as e:
        raise PlannerInputError(f"--workload {path}: {explain_validation(e)}") from None


@dataclass
class Requests:
    """Arrivals in columns (arrival order): the simulator reads them by index."""

    t: list[float] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    cls: list[int] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # -1: no shared head
    prefix_len: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.t)

    @property
    def duration_s(self) -> float:
        return self.t[-1] - self.t[0] if self.t else 0.0

    def scaled(self, factor: float) -> Requests:
        """The same requests arriving ``factor`` times faster."""
        return Requests(
            [x / factor for x in self.t],
            self.prompt,
            self.output,
            self.cls,
            self.prefix,
            self.prefix_len,
        )


def generate(workload: Workload, rate: float, count: int, seed: int = 0) -> Requests:
    """``count`` requests arriving at ``rate`` per second on average (see module docstring)."""
    if rate <= 0 or count < 1:
        raise PlannerInputError(f"need a positive rate and count, got {rate} and {count}")
    rng = random.Random(seed)
    out = Requests()
    weights = [c.share for c in workload.classes]
    classes = rng.choices(range(len(workload.classes)), weights=weights, k=count)
    bursty = workload.arrival == "bursty"
    shape = 1.0 / workload.burstiness**2  # gamma: CV = 1 / sqrt(shape)
    t = 0.0
    prefix_base = 0
    bases = []
    for c in workload.classes:
        bases.append(prefix_base)
        prefix_base += c.prefix_groups
    for ci in classes:
        c = workload.classes[ci]
        t += rng.gammavariate(shape, 1.0 / (shape * rate)) if bursty else rng.expovariate(rate)
        out.t.append(t)
        out.prompt.append(rng.randint(c.prompt_min, c.prompt_max))
        out.output.append(rng.randint(c.output_min, c.output_max))
        out.cls.append(ci)
        if c.prefix_groups:
            out.prefix.append(bases[ci] + rng.randrange(c.prefix_groups))
            out.prefix_len.append(c.prefix_tokens)
        else:
            out.prefix.append(-1)
            out.prefix_len.append(0)
    return out


def read_trace(path: Path, workload: Workload) -> Requests:
    """Requests from a JSON Lines trace (format in the module docstring), sorted by time."""
    names = {c.name: i for i, c in enumerate(workload.classes)}
    prefix_ids: dict[str, int] = {}
    rows: list[tuple[float, int, int, int, int, int]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise PlannerInputError(f"--trace {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--trace {path} line {n}"
        try:
            rec = json.loads(line)
            t = float(rec["t"])
            prompt, output = int(rec["prompt_tokens"]), int(rec["output_tokens"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise PlannerInputError(
                f"{where}: needs t, prompt_tokens and output_tokens ({e})"
            ) from None
        if not math.isfinite(t) or t < 0 or prompt < 1 or output < 1:
            raise PlannerInputError(f"{where}: t >= 0 and lengths >= 1 required")
        cname = rec.get("class", workload.classes[0].name)
        if cname not in names:
            raise PlannerInputError(f"{where}: class {cname!r} not in the workload ({names})")
        pid, plen = -1, 0
        if rec.get("prefix_id") is not None:
            pid = prefix_ids.setdefault(str(rec["prefix_id"]), len(prefix_ids))
            plen = min(int(rec.get("prefix_tokens", 0)), prompt - 1)
        rows.append((t, prompt, output, names[cname], pid, plen))
    if not rows:
        raise PlannerInputError(f"--trace {path}: no requests")
    rows.sort(key=lambda r: r[0])
    out = Requests()
    for t, prompt, output, ci, pid, plen in rows:
        out.t.append(t)
        out.prompt.append(prompt)
        out.output.append(output)
        out.cls.append(ci)
        out.prefix.append(pid)
        out.prefix_len.append(plen)
    return out
