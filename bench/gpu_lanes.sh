#!/usr/bin/env bash
# Stages of bench/gpu_run.sh in lanes side by side on one GPU: each argument is one lane, its stages run in turn,
#   bench/gpu_lanes.sh "vllm-q8-rollout vllm-q8-default" "vllm-q8-prompt vllm-q8-bisect" "vllm-moe"
#   bench/gpu_lanes.sh "TASK_HOW=strict task-rl" "TASK_HOW=default task-rl"   # leading NAME=VALUE: that lane's env
# Each lane's output goes to $OUT/lane-N.txt; the tails are printed when all are done. Bits do not depend on what
# else runs on the GPU (the strict kernels and vLLM's scheduling see no other process), times do: never time a
# stage here that is meant to be timed (vllm-bench, bench, forward). Set CMP_OPTS so that every vLLM asks for a
# fixed KV cache and a small free-memory check (vLLM's memory profiling fails when another process frees memory
# while it profiles: vllm/v1/worker/gpu_worker.py determine_available_memory), and build shared checkpoints first
# (stage synth) so that no two lanes write one checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/aa-out}; mkdir -p "$out"
: "${CMP_OPTS:=--infer-opt gpu_memory_utilization=0.1 --infer-opt kv_cache_memory_bytes=2147483648}"
export CMP_OPTS
bench/gpu_run.sh >"$out/lane-setup.txt" 2>&1  # the wheels into /tmp/site once, before lanes could race on it
n=0
for lane in "$@"; do
  n=$((n + 1))
  vars=() stages=()
  for word in $lane; do  # leading NAME=VALUE words: that lane's environment
    if [ ${#stages[@]} -eq 0 ] && [[ $word == *=* ]]; then vars+=("$word"); else stages+=("$word"); fi
  done
  env "${vars[@]}" bench/gpu_run.sh "${stages[@]}" >"$out/lane-$n.txt" 2>&1 &
  sleep 5  # the lanes' first vLLM starts are apart
done
wait  # the lanes are this shell's children (a pgrep on the script's name also finds the device call's own shell)
for i in $(seq 1 "$n"); do echo "##### lane $i"; grep -v "^\s*$" "$out/lane-$i.txt" | tail -40; done
