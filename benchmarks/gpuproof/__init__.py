"""The parts of ``benchmarks/gpu_proof.py``: device streams (``device``), the two-process
transfer and event-ordering check (``transfer``: the setup, the receiver and the figures;
``sender``: the sender, in the child process), the step-time calibration (``steps``)."""
