"""The parts of ``benchmarks/gpu_proof.py``: device streams (``device``), the two-process
transfer and event-ordering check (``transfer``), the step-time calibration (``steps``)."""
