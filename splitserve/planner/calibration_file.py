"""``splitserve plan --calibration FILE``: plan with figures measured earlier, on another machine.

Pure (JSON and pydantic; no torch): runs in the CLI process. A calibration measured where the
planner cannot run it (an H200 lent for minutes) is kept as a file and used later. Accepted:

- the file ``benchmarks/gpu_proof.py`` writes (``"format": "splitserve-calibration/1"``): the
  accelerator's achieved FLOP/s and copy bandwidth from whole-step timings of a model layer,
  the step points with the roofline's error against them, and ``transfer_link`` (two processes
  on the one device: recorded, never used as a P->D link);
- the JSON ``splitserve plan --calibrate --json`` prints (its ``calibration`` object), or that
  object alone: the accelerator and the NIXL link measured on that machine;
- either with a ``step_model`` object (``benchmarks/calibrate_engine.py`` writes one): whole
  engine steps of one model timed on a served engine and fitted in the adaptive budget's
  linear form (``EngineStepModel``); the simulator then times that model's steps with it
  instead of the roofline. Its ``points`` (the timings and the fit's error on each) and
  ``notes`` are kept for the reader and not parsed.

Invariant: a file that does not say what it measured with valid figures is refused with one
line naming the file and the field; nothing is guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.planner.catalog import Accelerator, Link, PlannerInputError, explain_validation
from splitserve.schedulers.step_model import FEATURE_NAMES, StepFeatures

FORMAT = "splitserve-calibration/1"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class EngineStepModel(BaseModel):
    """Step times measured on a served engine, in the adaptive budget's own linear form.

    ``step_ms = intercept_ms + ms_per_1k_tokens * tokens / 1e3 + ms_per_100_sequences *
    sequences / 1e2 + ms_per_1m_pairs * pairs / 1e6``: the features and coefficient names of
    ``splitserve.schedulers.step_model`` (the model the budget policy fits online), fitted once
    to whole-step timings of one model on one server (``benchmarks/calibrate_engine.py``). Where
    the roofline times a layer's matrix products, this includes what a real step adds: the
    engine's per-step work (scheduling, sampling, streaming), its attention kernels' own
    efficiency, and, on a CPU, the server's thread and core settings. It belongs to the model
    it was measured with: ``model`` names it, and the simulator refuses another.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="the model measured (catalog name)")
    intercept_ms: float = Field(ge=0, description="fixed cost of one step")
    ms_per_1k_tokens: float = Field(ge=0, description="cost of 1000 computed tokens")
    ms_per_100_sequences: float = Field(ge=0, description="cost of 100 requests in a batch")
    ms_per_1m_pairs: float = Field(ge=0, description="cost of 1e6 attention token pairs")

    def coefficients(self) -> list[float]:
        return [getattr(self, name) for name in FEATURE_NAMES]

    def predict_ms(self, tokens: int, sequences: int, pairs: int) -> float:
        x = StepFeatures(tokens, sequences, pairs).vector()
        return sum(c * v for c, v in zip(self.coefficients(), x, strict=True))

    def seconds_per_unit(self) -> tuple[float, ...]:
        """Seconds per step, per token, per sequence and per attention pair (the features'
        own scaling, for callers that evaluate the model without building features)."""
        units = StepFeatures(1, 1, 1).vector()
        return tuple(c * u / 1e3 for c, u in zip(self.coefficients(), units, strict=True))


@dataclass(frozen=True)
class LoadedCalibration:
    path: str
    accelerator: Accelerator
    weight_bytes: int
    measured_on: str  # the catalog GPU or device name the figures come from
    link: Link | None  # a P->D link measured with it (``--calibrate`` files), else None
    data: dict[str, Any]
    step_model: EngineStepModel | None = None  # whole-step timings of one served model

    def matches(self, gpu: str) -> bool:
        """Whether the figures were measured on catalog accelerator ``gpu`` (``H200`` matches
        ``NVIDIA H200`` as torch names it)."""
        return gpu.lower() in self.measured_on.lower()

    def section(self) -> dict[str, Any]:
        """What the plan's Calibration section shows."""
        notes = [f"from {self.path}, measured on {self.measured_on}"] + list(
            self.data.get("notes", [])
        )
        out = {"title": f"Calibration (from {self.path})", "notes": notes}
        for key in ("layer", "nixl", "steps", "roofline_error"):
            if self.data.get(key):
                out[key] = self.data[key]
        return out


def load_calibration(path: Path) -> LoadedCalibration:
    """Read and validate a calibration file (see module docstring)."""
    where = f"--calibration {path}"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlannerInputError(f"{where}: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("calibration"), dict):
        data = data["calibration"]  # a whole `plan --calibrate --json` output
    if not isinstance(data, dict) or not isinstance(data.get("accelerator"), dict):
        raise PlannerInputError(f"{where}: no 'accelerator' object: not a calibration file")
    try:
        acc = Accelerator(**data["accelerator"])
        link = Link(**data["link"]) if isinstance(data.get("link"), dict) else None
        step_model = None
        if data.get("step_model") is not None:
            step_model = EngineStepModel.model_validate(
                {k: v for k, v in data["step_model"].items() if k not in ("points", "notes")}
                if isinstance(data["step_model"], dict)
                else data["step_model"]
            )
    except (TypeError, ValidationError) as e:
        detail = explain_validation(e) if isinstance(e, ValidationError) else str(e)
        raise PlannerInputError(f"{where}: {detail}") from None
    if data.get("format") == FORMAT:
        weight_bytes = data.get("weight_bytes")
        measured_on = data.get("gpu") or data.get("device_name")
    elif "format" in data:
        raise PlannerInputError(f"{where}: format {data['format']!r}, expected {FORMAT!r}")
    else:  # `plan --calibrate`: the layer's dtype says the weights' width
        dtype = (data.get("layer") or {}).get("dtype")
        weight_bytes = _DTYPE_BYTES.get(dtype or "")
        measured_on = acc.name
    if weight_bytes not in (1, 2, 4):
        raise PlannerInputError(f"{where}: weight bytes unknown ({weight_bytes!r})")
    if not isinstance(measured_on, str) or not measured_on:
        raise PlannerInputError(f"{where}: it does not say which device it measured")
    return LoadedCalibration(str(path), acc, int(weight_bytes), measured_on, link, data, step_model)
