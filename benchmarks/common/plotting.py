"""matplotlib, when it is installed, on its file-only backend (benchmarks write PNGs)."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` with the ``Agg`` backend, or None when matplotlib is not
    installed (a benchmark's JSON and tables carry every figure without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
