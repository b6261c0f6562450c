"""Engine imports stay inside the adapters: the engine-free parts of splitserve import no engine.

DESIGN.md: importing ``splitserve.transfer``, ``splitserve.proxy`` or ``splitserve.planner`` must
not import vLLM or SGLang. The proxy, the planner, the launcher and the CLI must stay light too
(no torch, no NIXL): they run outside the engines, and ``splitserve plan`` or ``splitserve proxy``
must start in a moment. ``splitserve.transfer`` runs inside the engines' processes, so torch and
NIXL may load there (lazily, today), but never an engine.

Each case imports the package and every module under it in a fresh interpreter, so what an
earlier test imported cannot hide an import, and a module reached only through a submodule is
checked too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ENGINES = ("vllm", "sglang")
LIGHT = (*ENGINES, "torch", "nixl")  # what a process outside the engines must not load

CASES = {
    "splitserve.transfer": ENGINES,
    "splitserve.proxy": LIGHT,
    "splitserve.planner": LIGHT,
    "splitserve.schedulers.policy": LIGHT,
    "splitserve.schedulers.step_model": LIGHT,
    "splitserve.config": LIGHT,
    "splitserve.netutil": LIGHT,
    "splitserve.launch": LIGHT,
    "splitserve.plugins": LIGHT,  # the entry functions import the engine, the module does not
    "splitserve.models": LIGHT,  # torch and transformers load when a model is built
    "splitserve.cli": LIGHT,
}

PROBE = """
import importlib, pkgutil, sys
root = importlib.import_module(sys.argv[1])
imported = [root.__name__]
for info in pkgutil.walk_packages(getattr(root, "__path__", []), root.__name__ + "."):
    importlib.import_module(info.name)
    imported.append(info.name)
forbidden = set(sys.argv[2].split(","))
bad = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
print(len(imported), "modules imported")
if bad:
    sys.exit("imports " + ", ".join(bad[:10]))
"""


@pytest.mark.parametrize("package", sorted(CASES))
def test_imports_no_engine(package: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, package, ",".join(CASES[package])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{package}: {done.stderr.strip()[-2000:]}"
