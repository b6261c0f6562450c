"""``splitserve plan --calibration FILE``: plan with figures measured earlier, on another machine.

Pure (JSON and pydantic; no torch): runs in the CLI process. A calibration measured where the
planner cannot run it (an H200 lent for minutes) is kept as a file and used later. Accepted:

- the file ``benchmarks/gpu_proof.py`` writes (``"format": "splitserve-calibration/1"``): the
  accelerator's achieved FLOP/s and copy bandwidth from whole-step timings of a model layer,
  the step points with the roofline's error against them, and ``transfer_link`` (two processes
  on the one device: recorded, never used as a P->D link);
- the JSON ``splitserve plan --calibrate --json`` prints (its ``calibration`` object), or that
  object alone: the accelerator and the NIXL link measured on that machine.

Invariant: a file that does not say what it measured with valid figures is refused with one
line naming the file and the field; nothing is guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from splitserve.planner.catalog import Accelerator, Link, PlannerInputError, explain_validation

FORMAT = "splitserve-calibration/1"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class LoadedCalibration:
    path: str
    accelerator: Accelerator
    weight_bytes: int
    measured_on: str  # the catalog GPU or device name the figures come from
    link: Link | None  # a P->D link measured with it (``--calibrate`` files), else None
    data: dict[str, Any]

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
    return LoadedCalibration(str(path), acc, int(weight_bytes), measured_on, link, data)
