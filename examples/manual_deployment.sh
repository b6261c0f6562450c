#!/usr/bin/env bash
# The CPU demo deployment started by hand: what `splitserve up configs/demo-cpu.yaml` runs,
# spelled out so it can be ported to any orchestrator (systemd, Kubernetes, Slurm ...).
# `splitserve up CONFIG --print-commands` prints these lines for any deployment file.
#
# usage: examples/manual_deployment.sh MODEL_DIR   (e.g. a dir from `splitserve model build`)
# Stop with Ctrl-C: the trap stops all three processes.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_DIR}
PY=${PYTHON:-python}

# Every vLLM server on a CPU machine: KV cache size (GiB), no hub, fp32, eager.
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1

# The deployment's key (docs/security.md): a fresh one in a 0600 file, named by the environment
# (never on a command line). Every prefill and decode server reads the same file.
umask 077
KEY_DIR=$(mktemp -d)
"$PY" -c 'import secrets; print(secrets.token_urlsafe(32))' > "$KEY_DIR/auth.key"
export SPLITSERVE_AUTH_KEY_FILE="$KEY_DIR/auth.key"

# SplitserveConnector on both sides. side_channel_port is where P's connector listens for D's
# registrations; the proxy must know P's, so it is fixed. Both servers use kv_role kv_both.
KV_P='{"kv_connector":"SplitserveConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"side_channel_host":"127.0.0.1","side_channel_port":5600}}'
KV_D='{"kv_connector":"SplitserveConnector","kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{"side_channel_host":"127.0.0.1","side_channel_port":5700}}'

# The adaptive chunk scheduler on the decode server (settings through --additional-config): D
# decodes, so its prefill budget follows the decode load and the ITL target. Not on the prefill
# server: P never decodes, so the policy would always answer its maximum chunk.
SCHED=(--scheduler-cls splitserve.schedulers.vllm.AdaptiveChunkScheduler
       --additional-config '{"splitserve_scheduler":{}}')

# Prefill server on core 0, decode server on core 1 (two servers must not share OpenMP cores).
VLLM_CPU_OMP_THREADS_BIND=0 $PY -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny --host 127.0.0.1 --port 8100 --dtype float32 --enforce-eager \
    --max-model-len 2048 --max-num-batched-tokens 2048 --kv-transfer-config "$KV_P" \
    > prefill.log 2>&1 &
P=$!
VLLM_CPU_OMP_THREADS_BIND=1 $PY -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny --host 127.0.0.1 --port 8200 --dtype float32 --enforce-eager \
    --max-model-len 2048 --max-num-batched-tokens 2048 --kv-transfer-config "$KV_D" \
    "${SCHED[@]}" > decode.log 2>&1 &
D=$!
trap 'kill $P $D ${X:-} 2>/dev/null; wait' EXIT INT TERM

for port in 8100 8200; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; done
done

# The proxy: concurrent flow (P and D get the request at once; KV streams layer by layer).
$PY -m splitserve.cli proxy --engine vllm --flow concurrent \
    --prefill http://127.0.0.1:8100 --side-channel-port 5600 \
    --decode http://127.0.0.1:8200 --host 127.0.0.1 --port 8000 &
X=$!
until curl -sf http://127.0.0.1:8000/ready >/dev/null; do sleep 1; done
echo "serving at http://127.0.0.1:8000/v1"
wait
