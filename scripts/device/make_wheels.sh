#!/usr/bin/env bash
# Prepare, on a developer machine, the wheels the H200 run of benchmarks/gpu_proof.py installs.
#
# The device machine has torch (CUDA 13) and Python 3.12 but no package registry, and one `run`
# carries at most 64 MiB (tracked files + untracked files + the carried paths). splitserve's
# transfer core imports NIXL, pyzmq and pydantic; torch and numpy are expected there (checked
# by gpu_proof.sh). NIXL's cu13 wheel is 58.8 MB, most of it nixl_ep_cu13 (the expert-parallel
# extension, three 9 MB builds for three torch versions), which nothing of ours imports: this
# script drops it (and UCX's perftest library and NIXL's example binaries) from the wheel,
# rewriting its RECORD so the wheel stays valid, which leaves about 30 MB to carry (47 MB with numpy, in case the machine lacks it).
#
#   scripts/device/make_wheels.sh            # -> scripts/device/wheels/ (git-ignored)
set -euo pipefail
cd "$(dirname "$0")"
DEST=wheels
PY=${PYTHON:-../../.venv/bin/python}
rm -rf "$DEST" && mkdir -p "$DEST"
"$PY" -m pip download --no-deps -d "$DEST" --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    nixl==1.5.1 nixl-cu13==1.5.1 pyzmq==27.3.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
# numpy: NIXL and splitserve.transfer import it; installed there only if the machine lacks it
# (a second numpy ahead of the one torch was built with is a risk not worth taking).
"$PY" -m pip download --no-deps -d "$DEST/if-missing" --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 numpy==2.3.5
"$PY" - "$DEST"/nixl_cu13-*.whl <<'PYEOF'
import base64, hashlib, sys, zipfile
from pathlib import Path

DROP = ("nixl_ep_cu13/", "nixl_cu13.libs/ucx/libucx_perftest", "nixl_cu13.scripts/")
src = Path(sys.argv[1])
tmp = src.with_suffix(".tmp")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    kept = [i for i in zin.infolist() if not i.filename.startswith(DROP)]
    for info in kept:
        if info.filename != record_name:
            zout.writestr(info, zin.read(info.filename))
    lines = [
        line for line in zin.read(record_name).decode().splitlines()
        if line and not line.startswith(DROP)
    ]
    zout.writestr(zin.getinfo(record_name), "\n".join(lines) + "\n")
tmp.replace(src)
print(f"{src.name}: kept {len(kept)} files")
PYEOF
ls -lR "$DEST"
du -cb "$DEST"/*.whl "$DEST"/if-missing/*.whl | tail -1
