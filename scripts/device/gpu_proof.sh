#!/usr/bin/env bash
# The H200 run of benchmarks/gpu_proof.py (issue 23): run ON the device machine by the `run`
# tool, from the repository root, with $OUT set; everything it writes lands under $OUT.
#
# Prepared here first (the device machine has torch with CUDA 13 and Python 3.12, no registry):
#   scripts/device/make_wheels.sh     # -> scripts/device/wheels/ (git-ignored, ~31 MB + numpy)
# Then one call of the `run` tool (docs/benchmarks.md, "GPU (H200)", has the same):
#   carry:     ["scripts/device/wheels"]
#   command:   bash scripts/device/gpu_proof.sh
#   timeout_s: 540
# Order: machine facts, install (pip --no-index --target, no registry), part 3 (torch only, so
# it runs even if NIXL cannot), then parts 1 and 2 (NIXL on VRAM). Each part has its own
# timeout, so a hang in one leaves the other's results and the log.
# Rehearsal on a CPU machine (the orchestration, not the figures):
#   OUT=/tmp/rehearsal DEVICE=cpu SKIP_INSTALL=1 PYTHON=.venv/bin/python \
#     STEPS_ARGS="--model splitserve-tiny" TRANSFER_ARGS="--model splitserve-tiny --tokens 256" \
#     scripts/device/gpu_proof.sh
set -u
OUT=${OUT:?OUT must name the folder to write results to}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-scripts/device/wheels}
PKGS=${PKGS:-/tmp/splitserve-pkgs}
DEVICE=${DEVICE:-cuda}
GPU_ARGS=(--device "$DEVICE")
[ "$DEVICE" = cuda ] && GPU_ARGS+=(--gpu H200)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

echo "== machine $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
nvidia-smi topo -m || true
"$PY" -V
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" \
    || { echo "FATAL: torch is not importable"; exit 2; }

if [ -z "${SKIP_INSTALL:-}" ]; then
    echo "== install (no index) into $PKGS"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$PKGS" "$WHEELS"/*.whl \
        || { echo "FATAL: pip install of the carried wheels failed"; exit 3; }
    if ! "$PY" -c "import numpy" 2>/dev/null; then
        echo "numpy missing: installing the carried one"
        "$PY" -m pip install --quiet --no-index --no-deps --target "$PKGS" \
            "$WHEELS"/if-missing/*.whl
    fi
    export PYTHONPATH="$PWD:$PKGS${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import numpy, zmq, pydantic, nixl; print('numpy', numpy.__version__, 'zmq', zmq.zmq_version(), 'pydantic', pydantic.VERSION, 'nixl ok')"
env | grep -E '^(UCX_|NIXL_|CUDA_)' || true

echo "== part 3: step times"
timeout "${STEPS_TIMEOUT:-200}" "$PY" benchmarks/gpu_proof.py "${GPU_ARGS[@]}" --parts 3 --out "$OUT/steps" ${STEPS_ARGS:-}
echo "part 3 exit $?"

echo "== parts 1 and 2: NIXL on VRAM, layer poster, event ordering"
timeout "${TRANSFER_TIMEOUT:-240}" "$PY" benchmarks/gpu_proof.py "${GPU_ARGS[@]}" --parts 1,2 --out "$OUT/transfer" ${TRANSFER_ARGS:-}
echo "parts 1/2 exit $?"
ls -lR "$OUT"
