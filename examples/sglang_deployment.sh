#!/usr/bin/env bash
# An SGLang prefill/decode deployment behind the splitserve proxy, on a GPU node.
# NOT RUN HERE (our machines have no GPU); on our CPUs the same flow runs in
# tests/integration/test_sglang_pd.py with CPU flags (see splitserve/launch/engines.py).
#
# usage: examples/sglang_deployment.sh MODEL   (a local dir or a Hugging Face id)
#
# KV moves with SGLang's own `nixl` backend today. splitserve's layer-wise `splitserve` backend
# is not built yet (docs/sglang.md). The adaptive chunk budget (SPLITSERVE_ADAPTIVE_BUDGET=1,
# settings: SPLITSERVE_SCHEDULER_CONFIG=file.yaml) is NOT switched on here: an SGLang prefill server
# never decodes (the budget would always answer its maximum chunk) and an SGLang decode server
# never prefills (it only receives KV), so in a prefill/decode pair it has nothing to do. It
# belongs on unified SGLang servers (docs/sglang.md).
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}
PY=${PYTHON:-python}

# Prefill server on GPU 0; its bootstrap port (8998) is where decode servers fetch KV metadata.
CUDA_VISIBLE_DEVICES=0 $PY -m sglang.launch_server \
    --model-path "$MODEL" --host 127.0.0.1 --port 30001 \
    --disaggregation-mode prefill --disaggregation-bootstrap-port 8998 \
    --disaggregation-transfer-backend nixl > sglang_prefill.log 2>&1 &
P=$!
# Decode server on GPU 1.
CUDA_VISIBLE_DEVICES=1 $PY -m sglang.launch_server \
    --model-path "$MODEL" --host 127.0.0.1 --port 30002 \
    --disaggregation-mode decode \
    --disaggregation-transfer-backend nixl > sglang_decode.log 2>&1 &
D=$!
trap 'kill $P $D ${X:-} 2>/dev/null; wait' EXIT INT TERM

# SGLang's /health runs a generation: give it time.
for port in 30001 30002; do
    until curl -sf -m 30 "http://127.0.0.1:$port/health" >/dev/null; do sleep 5; done
done

# The proxy adds bootstrap_host / bootstrap_port / bootstrap_room to each request and sends it
# to P and D at once; the client reads D's answer.
$PY -m splitserve.cli proxy --engine sglang \
    --prefill http://127.0.0.1:30001 --bootstrap-port 8998 \
    --decode http://127.0.0.1:30002 --host 127.0.0.1 --port 8000 &
# (To listen on 0.0.0.0, give clients a key: export SPLITSERVE_PROXY_API_KEY=...; see
# docs/security.md. Without one the proxy refuses a non-loopback host.)
X=$!
until curl -sf http://127.0.0.1:8000/ready >/dev/null; do sleep 1; done
echo "serving at http://127.0.0.1:8000/v1"
wait
