#!/usr/bin/env bash
# Everything alignaudit runs on one CUDA machine, in named stages, each with its own time limit:
#   bench/gpu_run.sh tests sweep sweep-segments sweep-medium sweep-attention sweep-rmsnorm-rows bench bench-quick bench-attention launch compile-probe forward forward-native q8 q8-strict q8-native q8-bisect q8-bisect-strict \
#                    tp-bench q8-tp2 q8-tp2-bisect q8-tp2-rollout rl17 decode-diag families q14 moe repeat \
#                    vllm-fixture vllm-q8 vllm-q8-hf vllm-q8-native vllm-q8-bisect vllm-moe vllm-rl17 vllm-bench vllm-warmup \
#                    ipc rl-bench train-profile grpo17 grpo8 linear19 attention19 sweep19 decode-gen19 targets19 \
#                    moe-bench vllm-moe-graphs bench-attention-backward determinism
# determinism: distinct bit patterns of dq/dk/dv over 8 runs of one input, torch's SDPA flash backward with and without
# its deterministic mode and the fused varlen backward (bench/attention_determinism.py);
# tests: the strict-kernel tests on the GPU (TESTS_K=EXPR: those pytest -k selects; TESTS_N=N: N pytest-xdist workers on
# the one GPU, with pytest-xdist and execnet carried as wheels in .whl/extra/); sweep: launch-
# configuration sweep (sweep-segments: the K-segmented products and the TMA kernel at M = 256; sweep-medium: every layer at M = 32-128; sweep-attention: its attention section; sweep-rmsnorm-rows: the per-head q/k
# norms by rows a program); bench: kernels vs defaults (bench-attention:
# attention only); launch: host time per strict op call at decode shapes (bench/launch_overhead.py; LAUNCH_TOKENS=2048: an eager prefill's);
# compile-probe: the fixture's strict forward under Inductor, the whole traceback of a failure (bench/compile_probe.py);
# forward: the whole Qwen3-8B-shape forward, eager and compiled, and where one forward's GPU time goes by kernel
# (--profile; its JSON kept in /tmp/keep for targets19 in a later call) (forward-native: --strict-exp native); q8: Qwen3-8B-shape compare (random
# weights) megatron vs hf, default and --strict (q8-native: --strict --strict-exp native);
# q8-bisect: bisect of layer 0; tp-bench: the strict row-parallel reduction vs NCCL's all-reduce (2 GPUs);
# q8-tp2*: megatron at tensor-parallel size 2 (NCCL) vs hf / vs megatron at size 1; rl17: alignaudit rl on
# the Qwen3-1.7B shape, megatron trains, hf rolls out, 20 steps --strict; decode-diag: the first module
# where HF's KV-cache decode parts from its own prefill (bench/decode_vs_prefill.py); families: Qwen2.5-0.5B
# and Llama-3.2-1B shapes, megatron vs hf, --strict, rollout mode; q14: the Qwen3-14B shape (40 query heads
# over 8 KV heads), megatron vs hf, --strict, rollout mode; moe: the Qwen3-MoE fixture, megatron vs hf,
# default and --strict, prompt mode (routing read) and rollout mode; repeat: Qwen3-1.7B shape, megatron vs
# hf, each engine 3 times (alone, then among random fillers), default and --strict. Needs megatron-core carried as a
# wheel in .whl/ for the megatron stages (device README).
# vllm-*: CUDA vLLM (installed first by ../shared/gpu/vllm-cuda.sh into /tmp/site, on PYTHONPATH): vllm-fixture-strict
# megatron vs vllm on the fixture --strict, prompt and rollout mode; vllm-fixture default, and hf vs vllm strict
# rollout; vllm-q8 the Qwen3-8B shape (2 x 512 tokens) --strict rollout (64 sampled tokens, vLLM's CUDA graphs on;
# vllm-q8-rollout alone), prompt, and default (VQ8_OPTS: extra options, e.g. --infer-opt max_num_seqs=16); vllm-q8-hf
# hf vs vllm strict rollout; vllm-q8-native --strict-exp native; vllm-q8-bisect bisect of layer 0, default;
# vllm-fp8 [21]: megatron bf16 vs vLLM bf16 / quantization=fp8 / + kv_cache_dtype=fp8, Qwen3-1.7B shape, rollout mode (needs
# loguru: carry its wheel in .whl/extra/, installed into /tmp/site); vllm-fp8-bisect the first diverging op
# under fp8 weights; [22] with two GPUs: VQ8_OPTS="--train-opt tensor_model_parallel_size=2 --infer-opt
# tensor_parallel_size=2" vllm-q8;
# vllm-moe the Qwen3-MoE fixture and the Qwen3-30B-A3B shape cut to MOE_LAYERS (4) layers, strict; vllm-rl17
# alignaudit rl on the Qwen3-1.7B shape, megatron trains, vllm rolls out; vllm-bench generation tokens/s
# (bench/vllm_generate.py, BENCH_CONFIGS; VB_CAPTURE: vLLM's max_cudagraph_capture_size for every configuration; VB_PREFILL=N: N batches with one new token each, roughly the prefill's share, in the fresh engine and after the timed batches; VB_PROFILE_BATCH=one-token: BENCH_PROFILE's configurations profile such a batch, not a full one); vllm-warmup: strict generation at max_model_len WARMUP_MAX_LEN (4096)
# with 600 sequences (decode unsplit), to read that no strict kernel builds inside a timed batch.
# vllm-q8-prompt / vllm-q8-default: one of vllm-q8's three. [24]: vllm-q8-bi the strict rollout under VLLM_BATCH_INVARIANT=1,
# and its infer capture diffed against vllm-q8-rollout's (the same bits?); vllm-q8-bi-default the default stack under it;
# vllm-q8-processed strict and default rollouts with logprobs_mode=processed_logprobs at temperature 0.7, top-k 50, top-p 0.9. synth: build the
# random checkpoints of SYNTH (comma-separated presets) once, before stages run side by side (the cache is not
# safe for two writers). CMP_OPTS: options added to every compare and to vllm-rl17 (e.g. --infer-opt
# gpu_memory_utilization=0.2 --infer-opt kv_cache_memory_bytes=4294967296, for two stages side by side on one GPU);
# CMP_TIMEOUT: seconds per compare (420). CMP_OPTS reaches grpo's runs (grpo17, grpo8, task-rl) and vllm-rl17-shaped too.
# [27] MoE: moe-bench the strict MoE expert work by dispatch (gathered, grouped, every_expert; eager and graph replays;
# bits against gathered) vs vLLM's fused_experts at the Qwen3-30B-A3B layer shape, MOE_TOKENS (8,64,512,4096) tokens
# (bench/moe_gpu.py; vLLM's column needs the bundle packed with --moe; MOEB_OPTS=--tiles also sweeps the grouped tiles); vllm-moe-graphs the vllm-moe compares in rollout
# mode with vLLM's CUDA graphs on (FULL_AND_PIECEWISE), once per dispatch in MOEG_HOW (auto, the grouped one on CUDA;
# every_expert also captures). bench-attention-backward: the strict attention's backward (ALIGNAUDIT_BACKWARD reference, fused) vs
# torch's flash backward at 1k/4k/8k (bench/kernels_gpu.py --sections attention-backward).
# top-p-probe: whether torch's softmax and cumsum give a row of 151936 fp32 logits the same bits alone and in batches
# (bench/top_p_probe.py: could strict top-p run batched instead of a row a call?);
# [18]: ipc the CUDA IPC weight-transfer test; rl-bench seconds per RL step and stage, strict vs default, Qwen3-1.7B shape,
# 8 prompts x 4 completions x 64 tokens (bench/rl_steps.py; RLB_STEPS; RLB_ROUNDS; RLB_CONFIGS: strict,strict-fused,default adds the
# fused backward side by side); grpo17 the same shape for GRPO_STEPS (200) steps
# (GRPO_OPTS: --strict by default, GRPO_TAG names the run); grpo8 the Qwen3-8B shape (GRPO8_STEPS, GRPO8_MB micro-batch);
# train-profile: where one strict and one default update of that shape spend their time (bench/train_step_profile.py);
# GRPO_LR (1e-6), GRPO_KL (grpo17's --kl-coef, 0.04; grpo8 runs without), GRPO_TIMEOUT (570 s; never past CALL_S,
# 590 s after the script started, less 25 s for the summary; lower CALL_S by what the call ran before the script,
# e.g. the vLLM install: about 30 s); the run itself stops (rl --max-seconds) GRPO_CLOSE_S (60) seconds before that
# limit, after a whole step, so that it closes sealed.
# [19]: linear19 strict linear vs cuBLAS for qkv, o, gate_up, down at LIN_MS (32,64,128,256,4096), graph replays;
# attention19 strict prefill and paged decode vs vLLM's FlashAttention-3 (needs CUDA vLLM); sweep19 the linear
# candidates (bench/sweep_gpu.py --sections issue19); decode-gen19 paged decode at vllm-bench's decode shape vs FA3
# (pages of 16 and 64, split, stages, warps; needs CUDA vLLM); targets19 the [19] target table from the stages' JSON in $OUT
# (forward.json from forward, vllm-generate.json from vllm-bench; BENCH_PROFILE: configurations profiled there).
# vllm-bench's shape: VB_MODEL (Qwen3-8B), VB_PROMPTS (64), VB_PROMPT_LEN (512), VB_NEW (256); the RL rollout shape is
# VB_MODEL=Qwen3-1.7B VB_PROMPTS=32 VB_PROMPT_LEN=64 VB_NEW=64.
# [30]'s long-rollout shape: VB_PROMPTS=16 VB_N=8 VB_NEW=4096 VB_BATCHES=2 (16 prompts x n = 8 completions x 4096
# new tokens, EOS ignored; VB_N: completions per prompt, VB_BATCHES: timed batches, the rate the second's);
# BENCH_CONFIGS=default,strict,strict-flash puts FlashAttention-3 as strict attention beside the portable kernel.
# [25]: vllm-q8-shaped the Qwen3-8B shape rolled out as frameworks do: 8 prompts sharing a 384-token prefix
# (SHAPED_PROMPTS, made here) x n = 8, EOS and 2000 stop token ids ending completions, no prompt logprobs (prefix cache
# read), --engine-mode async with arrivals 50 ms apart; strict then default (SHAPED_HOW); vllm-rl17-shaped alignaudit
# rl at the Qwen3-1.7B shape with the same shape (RL_ENGINE_MODE: async, arrivals 50 ms apart, by default; offline) and
# --sleep-level 1, RL_STEPS (20) steps --strict;
# trl: TRL's GRPOTrainer with CUDA vLLM colocated on the fixture (bench/trl_grpo.py), strict then default (TRL_HOW),
# TRL_STEPS (3) steps, TRL_OPTS added (e.g. "--beta 0.04 --top-k 0 --top-p 1"); needs trl, accelerate, datasets, dill,
# multiprocess, xxhash carried in .whl/extra/.
# [30]: flash: tests/kernels/test_flash.py (FA3 at one key split: a row's bits in every layout, the backward) and
# compare --strict --strict-attention flash, FLASH_TRAIN (megatron hf) vs CUDA vLLM, rollout mode, FLASH_MODEL
# (Qwen3-0.6B) shape with random weights; needs the CUDA vLLM bundle.
# [26]: task-model trains a TASK_SHAPE (Qwen3-0.6B) model on the addition task (fixtures/train_task_fixture.py on the
# GPU, TASK_STEPS 300, TASK_LR 3e-4) into /tmp/task-model, its training.json into $OUT; task-rl then runs alignaudit
# rl --reward task on it, TASK_RL_STEPS (200) steps, strict or default (TASK_HOW), EOS on, TASK_PER_STEP (8) fresh
# training questions a step x 8 completions, the task's 64 held-out questions (TASK_EVAL_N: that many, in a file) scored
# every TASK_EVAL_EVERY (20) steps. TASK_QUESTIONS (train): the task model sees only the training side of the split.
# Each stage's whole output is also kept in $OUT/<stage>.log (what a cut-short call still brings back).
set -uo pipefail
started=$SECONDS  # the device call began just before (CALL_S: grpo's deadline)
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/aa-out}; mkdir -p "$out"
# This checkout's packages, nothing installed: alignaudit and bench from the root, alignaudit_kernels from kernels/ (a
# plain folder holding it), alignaudit_fixtures (the folder fixtures/, installed under that name) through a link.
shim=$(mktemp -d) && ln -s "$PWD/fixtures" "$shim/alignaudit_fixtures" || exit 1
export PYTHONPATH="$PWD:$PWD/kernels:$shim:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 ALIGNAUDIT_CACHE=/tmp/aa-cache
# NVLink multicast stays off on shared multi-GPU hosts (device KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  # once per machine: lanes side by side (bench/gpu_lanes.sh) find it installed
  PYTHONPATH=/tmp/site python3 -c "import megatron.core" 2>/dev/null \
    || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if ls .whl/extra/*.whl >/dev/null 2>&1; then  # pure-Python packages the image lacks (loguru for fp8, pytest-xdist)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/extra/*.whl
  case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH="$PYTHONPATH:/tmp/site" ;; esac
fi
python3 -c "import torch, triton, transformers; print('gpu', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>/dev/null || echo "megatron-core: not available"
status=0
log() { tee -a "$out/${stage:-run}.log"; }  # each stage's whole output, kept under $OUT even if the call is cut short
q8() {  # $1 name, rest: extra compare options
  local name=$1; shift
  timeout 420 python3 -m alignaudit compare --model Qwen3-8B --random-weights --random-prompts 2 --prompt-len 512 \
    --train megatron --infer hf --device cuda --out /tmp/runs/$name --force "$@" 2>&1 | log | tail -32
  cp /tmp/runs/$name/summary.json "$out/$name-summary.json" 2>/dev/null
  for side in train infer; do grep -A3 '"timing_s"' /tmp/runs/$name/$side/manifest.json 2>/dev/null || tail -5 /tmp/runs/$name/$side/worker.log; done
}
cmp() {  # $1 name, rest: compare options (model, engines, mode); summary, engine records and the verdict lines
  local name=$1; shift
  timeout ${CMP_TIMEOUT:-420} ${CMP_CMD:-python3 -m alignaudit} compare --device cuda --out /tmp/runs/$name --force "$@" ${CMP_OPTS:-} 2>&1 | log \
    | grep -E "IDENTICAL|differ|mismatch|tokens compared|generated|rerouted|rror|Traceback" | tail -8
  cp /tmp/runs/$name/summary.json "$out/$name-summary.json" 2>/dev/null
  python3 - /tmp/runs/$name <<'PY' 2>&1 | log
import json, sys, pathlib
run = pathlib.Path(sys.argv[1])
s = json.loads((run / "summary.json").read_text())
print("  ", run.name, "tokens", s.get("tokens_compared"), "mismatches", s.get("mismatches"), "ulp_max", s.get("ulp_max"),
      "generated", {k: s["generated"].get(k) for k in ("tokens_compared", "mismatches")} if s.get("generated") else None)
for side in ("train", "infer"):
    m = json.loads((run / side / "manifest.json").read_text())
    e = m.get("engine_settings", {})
    r = e.get("resolved", {})
    print("  ", side, m.get("engine"), "strict", e.get("strict"), "attention", e.get("attention_impl"), e.get("attention_exp"),
          "graphs", r.get("cudagraph_mode"), "eager", r.get("enforce_eager"), "startup_s", r.get("startup_s"),
          "timing", m.get("timing_s"), *(("max_model_len", r["max_model_len"], "KV cache bytes given",
          e.get("llm", {}).get("kv_cache_memory_bytes"), "tokens", r.get("kv_cache_tokens")) if "max_model_len" in r else ()))
PY
}
Q8="--model Qwen3-8B --random-weights --random-prompts 2 --prompt-len 512"
SHAPED_PROMPTS=/tmp/shared-prefix.jsonl
STOPS="stop_token_ids=$(python3 -c 'print(list(range(1000, 3000)))' | tr -d ' ')"
shaped_prompts() {  # $1 vocabulary size: 8 prompts of 512 ids sharing their first 384 (a system prompt), seeded
  python3 - "$1" > $SHAPED_PROMPTS <<'PY'
import json, random, sys
rng = random.Random(0); vocab = int(sys.argv[1]); prefix = [rng.randrange(vocab) for _ in range(384)]
for _ in range(8):
    print(json.dumps({"token_ids": prefix + [rng.randrange(vocab) for _ in range(128)]}))
PY
}
shaped_summary() {  # $1 run directory: how the rollout was shaped, read back from the infer capture
  python3 - "$1" <<'PY' 2>&1 | log
import json, sys, pathlib, pandas as pd
run = pathlib.Path(sys.argv[1]); m = json.loads((run / "infer" / "manifest.json").read_text()); e = m["engine_settings"]
t = pd.read_parquet(run / "infer" / "logprobs.parquet"); g = t[t.generated].groupby("seq").size()
print("   shape", {k: m["rollout"][k] for k in ("group_size", "stop_at_eos", "prompt_logprobs", "engine_mode", "arrival_gap_s")},
      "prefix_cache_hits", e.get("prefix_cache_hits"), "arrivals", e.get("arrivals"), "sequences", len(g),
      "ended early", int((g < m["rollout"]["max_new_tokens"]).sum()), "completion len min/mean", int(g.min()), round(float(g.mean()), 1),
      "prefix caching", e.get("resolved", {}).get("enable_prefix_caching"), "graphs", e.get("resolved", {}).get("cudagraph_mode"))
PY
}
G17="--model Qwen3-1.7B --random-weights --random-prompts 8 --prompt-len 64 --max-new-tokens 64 --group-size 4"
grpo() {  # $1 name, rest: rl options; megatron trains, CUDA vLLM rolls out; steps.parquet, plot, run.json and a summary
  local name=$1; shift
  # the run ends CALL_S (590) seconds after the script started, less 25 for this summary, whatever GRPO_TIMEOUT says:
  # a device call's limit that cut the summary off left only /dev/shm to copy from (2026-12-01)
  local left=$(( ${CALL_S:-590} - (SECONDS - ${started:-0}) - 25 )) limit=${GRPO_TIMEOUT:-570}
  (( left < limit )) && limit=$left
  local stop=$(( limit - ${GRPO_CLOSE_S:-60} )); (( stop < limit / 2 )) && stop=$(( limit / 2 ))
  # rl stops itself GRPO_CLOSE_S (60) seconds before the limit, after a whole step, and closes sealed; timeout is the
  # backstop (2026-12-05: cut by it while closing after its last step, the grpo8 run's record said interrupted)
  timeout $limit python3 -m alignaudit rl --train megatron --infer vllm --device cuda --lr ${GRPO_LR:-1e-6} \
    --max-seconds $stop --no-token-rows --out /dev/shm/$name --force "$@" ${CMP_OPTS:-} \
    2>&1 | log | tail -5
  for f in steps.parquet eval.parquet steps.png run.json; do cp /dev/shm/$name/$f "$out/$name-$f" 2>/dev/null; done
  python3 - /dev/shm/$name <<'PY' 2>&1 | log
import json, sys, pathlib, pandas as pd
run = pathlib.Path(sys.argv[1])
t = pd.read_parquet(run / "steps.parquet")
r = json.loads((run / "run.json").read_text())
late = t.iloc[1:] if len(t) > 1 else t
print("  ", run.name, "status", r["status"], "stopped", r.get("stopped"), "steps", len(t), "steps with mismatches", int((t.mismatches > 0).sum()),
      "tokens/step", int(t.tokens.iloc[0]), "syncs bit-equal", bool(t.sync_bit_equal.all()), "forward==rescore",
      bool(t.train_forward_equal.all()), "distinct digests", t.weights_digest.nunique())
print("   grad_norm min", t.grad_norm.min(), "weights_changed min", int(t.weights_changed.min()), "max", int(t.weights_changed.max()),
      "fraction min", t.weights_changed_fraction.min(), "max_abs_dw max", t.max_abs_dw.max(),
      "reward", round(t.reward_mean.iloc[0], 4), "->", round(t.reward_mean.iloc[-1], 4), "max ulp", int(t.ulp_max.max()),
      "kl_k3 max", t.kl_k3.max())
print("   median s (steps 2..):", {c: round(float(late[c].median()), 3) for c in ("seconds", "rollout_s", "rescore_s", "update_s", "optimizer_s", "sync_s") if c in late},
      "max sync_s", float(late.sync_s.max()))
e = r.get("engines", {})
print("   transport", r.get("weight_sync"), "optimizer", e.get("train", {}).get("optimizer"), "host threads", e.get("train", {}).get("host_threads"))
print("   start-up s: train", e.get("train", {}).get("worker_startup_s"), "infer", e.get("infer", {}).get("worker_startup_s"),
      "vLLM", e.get("infer", {}).get("resolved", {}).get("startup_s"), "graph sizes", e.get("infer", {}).get("resolved", {}).get("cudagraph_capture_sizes"))
print("   zero-gradient steps", int((t.grad_norm == 0).sum()), "steps with no weight change", int((t.weights_changed == 0).sum()),
      "kl_ref max", t.kl_ref.max() if "kl_ref" in t else None, "total s", round(float(t.seconds.sum()), 1))
print("   memory plan", {k: (round(v / 1e9, 1) if isinstance(v, float) and v > 1e6 else v) for k, v in (r.get("memory_plan") or {}).items()})
print(t[["step", "mismatches", "ulp_max", "sync_bit_equal", "reward_mean", "grad_norm", "weights_changed", "max_abs_dw", "seconds",
         "rollout_s", "update_s", "sync_s"]].iloc[list(range(min(3, len(t)))) + list(range(max(3, len(t) - 3), len(t)))].to_string())
PY
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    synth) python3 -c "from alignaudit.inputs.checkpoint import resolve_model as r; [r(m, random_weights=True) for m in '${SYNTH:-Qwen3-8B}'.split(',')]" \
             2>&1 | log | tail -3 ;;
    tests) timeout 480 python3 -m pytest -v -p no:cacheprovider tests/kernels --ignore=tests/kernels/test_kernels_interpret.py \
             --ignore=tests/kernels/test_kernels_compile.py --kernel-device cuda -rs ${TESTS_K:+-k "$TESTS_K"} ${TESTS_N:+-n $TESTS_N} 2>&1 \
             | tee "$out/gpu-kernel-tests.log" | tail -15 || status=1 ;;
    sweep) timeout 300 python3 bench/sweep_gpu.py --json "$out/sweep.json" 2>&1 | log | tail -25 ;;
    sweep-medium) timeout 300 python3 bench/sweep_gpu.py --sections medium-m --json "$out/sweep-medium.json" 2>&1 | log | tail -25 ;;
    sweep-segments) timeout 300 python3 bench/sweep_gpu.py --sections segments,small-m --json "$out/sweep-segments.json" 2>&1 | log | tail -25 ;;
    sweep-attention-tma) timeout ${SAT_TIMEOUT:-300} python3 bench/sweep_gpu.py --sections attention-tma \
        --json "$out/sweep-attention-tma.json" 2>&1 | log | grep -v Warn | tail -40 ;;
    sweep-rmsnorm-rows) timeout 240 python3 bench/sweep_gpu.py --sections rmsnorm-rows \
        --json "$out/sweep-rmsnorm-rows.json" 2>&1 | log | grep -v Warn | tail -35 ;;
    sweep-attention) timeout 240 python3 bench/sweep_gpu.py --sections attention --json "$out/sweep-attention.json" 2>&1 | log | tail -30 ;;
    bench) timeout 300 python3 bench/kernels_gpu.py --json "$out/bench.json" 2>&1 | log | tail -45 ;;
    q8) q8 q8-default; q8 q8-strict --strict ;;
    q8-strict) q8 q8-strict --strict ;;
    q8-native) q8 q8-strict-native --strict --strict-exp native
               grep -h '"attention_exp"' /tmp/runs/q8-strict-native/*/manifest.json ;;
    launch) timeout 120 python3 bench/launch_overhead.py --tokens ${LAUNCH_TOKENS:-1} 2>&1 | log | tail -10 ;;
    determinism) timeout 200 python3 bench/attention_determinism.py --json "$out/determinism.json" 2>&1 | log | tail -5 ;;
    bench-attention-backward) timeout 300 python3 bench/kernels_gpu.py --sections attention-backward \
                                --json "$out/bench-attention-backward.json" 2>&1 | log | tail -8 ;;
    bench-attention) timeout 200 python3 bench/kernels_gpu.py --quick --sections attention --json "$out/bench-attention.json" 2>&1 | log | tail -14 ;;
    bench-quick) timeout 200 python3 bench/kernels_gpu.py --quick --json "$out/bench.json" 2>&1 | log | tail -40 ;;
    compile-probe) for m in "" --mask; do timeout 200 python3 bench/compile_probe.py $m 2>&1 | log | grep -v Warn | tail -25; done ;;
    forward) timeout ${FWD_TIMEOUT:-540} python3 bench/forward_gpu.py --profile --json "$out/forward.json" 2>&1 | log | grep -v Warn | tail -40
             mkdir -p /tmp/keep && cp "$out/forward.json" /tmp/keep/ 2>/dev/null ;;  # for targets19 in a later call
    forward-native) timeout 540 python3 bench/forward_gpu.py --exp native 2>&1 | log | grep -v Warn | tail -9 ;;
    q8-bisect-strict) timeout 300 python3 -m alignaudit bisect --model Qwen3-8B --random-weights --random-prompts 2 \
                 --prompt-len 256 --train megatron --infer hf --device cuda --layers 0 --mode natural --strict \
                 --out /tmp/runs/q8-bisect-strict --force 2>&1 | log | grep -E "✗|◀|every op|first diverging|error" | head -20 ;;
    tp-bench) timeout 200 python3 bench/tp_reduction.py --world 2 --device cuda --hidden 4096 --tokens 16,256,1024,4096 \
                --json "$out/tp-reduction.json" 2>&1 | log | tail -8 ;;
    q8-tp2) q8 q8-tp2-strict --strict --train-opt tensor_model_parallel_size=2
            q8 q8-tp2-default --train-opt tensor_model_parallel_size=2 ;;
    q8-tp2-strict) q8 q8-tp2-strict --strict --train-opt tensor_model_parallel_size=2 ;;
    q8-tp2-default) q8 q8-tp2-default --train-opt tensor_model_parallel_size=2 ;;
    q8-tp2-rollout) q8 q8-tp2-rollout-strict --strict --train-opt tensor_model_parallel_size=2 --mode rollout --max-new-tokens 64 ;;
    q8-tp2-bisect) timeout 400 python3 -m alignaudit bisect --model Qwen3-8B --random-weights --random-prompts 2 \
                 --prompt-len 256 --train megatron --infer megatron --train-opt tensor_model_parallel_size=2 --device cuda \
                 --layers 0 --mode natural --out /tmp/runs/q8-tp2-bisect --force 2>&1 | log | grep -E "◀|first diverging|error" | head -5
               cp /tmp/runs/q8-tp2-bisect/bisect.json "$out/q8-tp2-bisect.json" 2>/dev/null ;;
    rl17) timeout 560 python3 -m alignaudit rl --model Qwen3-1.7B --random-weights --random-prompts 2 --prompt-len 64 \
            --train megatron --infer hf --device cuda --strict --steps 20 --group-size 4 --max-new-tokens 32 \
            --no-token-rows --out /dev/shm/rl17 --force 2>&1 | log | tail -4
          cp /dev/shm/rl17/steps.parquet "$out/rl17-steps.parquet" 2>/dev/null; cp /dev/shm/rl17/steps.png "$out/rl17-steps.png" 2>/dev/null
          python3 -c "import pandas as pd; t=pd.read_parquet('/dev/shm/rl17/steps.parquet'); print(t[['step','tokens','mismatches','ulp_max','sync_bit_equal','reward_mean','loss','grad_norm','seconds','rollout_s','rescore_s','update_s','sync_s']].to_string())" 2>&1 | log | tail -22 ;;
    families) for model in Qwen2.5-0.5B Llama-3.2-1B; do
                timeout 200 python3 -m alignaudit compare --model $model --random-weights --random-prompts 2 --prompt-len 256 \
                  --train megatron --infer hf --device cuda --strict --mode rollout --max-new-tokens 32 \
                  --out /tmp/runs/fam-$model --force 2>&1 | log | grep -E "IDENTICAL|MISMATCH|tokens compared|mismatching|error" | head -4
                cp /tmp/runs/fam-$model/summary.json "$out/fam-$model-summary.json" 2>/dev/null
              done ;;
    q14) timeout 500 python3 -m alignaudit compare --model Qwen3-14B --random-weights --random-prompts 2 --prompt-len 256 \
           --train megatron --infer hf --device cuda --strict --mode rollout --max-new-tokens 32 --out /tmp/runs/q14 \
           --force 2>&1 | log | grep -E "IDENTICAL|differ|tokens compared|mismatching|generated|error" | head -6
         cp /tmp/runs/q14/summary.json "$out/q14-strict-rollout-summary.json" 2>/dev/null ;;
    moe) for args in "default" "strict --strict" "strict-rollout --strict --mode rollout --max-new-tokens 32"; do
           set -- $args; name=$1; shift
           timeout 200 python3 -m alignaudit compare --model qwen3-moe-tiny --train megatron --infer hf --device cuda "$@" \
             --out /tmp/runs/moe-$name --force 2>&1 | log | grep -E "IDENTICAL|differ|mismatching|generated|rerouted|error" | head -5
           cp /tmp/runs/moe-$name/summary.json "$out/moe-$name-summary.json" 2>/dev/null
         done ;;
    repeat) for args in "default" "strict --strict"; do
              set -- $args; name=$1; shift
              timeout 280 python3 -m alignaudit compare --model Qwen3-1.7B --random-weights --random-prompts 8 --prompt-len 256 \
                --train megatron --infer hf --device cuda --repeat 3 "$@" --out /tmp/runs/repeat-$name --force 2>&1 \
                | log | grep -E "IDENTICAL|differ|mismatching|runs|repeat|error" | head -8
              cp /tmp/runs/repeat-$name/summary.json "$out/repeat-$name-summary.json" 2>/dev/null
            done ;;
    decode-diag) for run in "Qwen3-0.6B 128 32 2" "Qwen3-1.7B 128 32 2" "Qwen3-1.7B 512 32 2" "Qwen3-8B 512 16 1"; do
                   set -- $run
                   timeout 300 python3 bench/decode_vs_prefill.py --model $1 --random-weights --device cuda --strict all \
                     --prompt-len $2 --new-tokens $3 --prompts $4 2>&1 | log | grep -v Warn | tail -8
                 done ;;
    vllm-fixture) cmp vfx-default --train megatron --infer vllm
                  cmp vfx-strict-hf --train hf --infer vllm --strict --mode rollout --max-new-tokens 32 ;;
    vllm-fixture-strict) cmp vfx-strict --train megatron --infer vllm --strict
                         cmp vfx-strict-rollout --train megatron --infer vllm --strict --mode rollout --max-new-tokens 32 ;;
    vllm-fixture-rollout) cmp vfx-strict-rollout --train megatron --infer vllm --strict --mode rollout --max-new-tokens 32 ;;
    vllm-q8) cmp vq8-strict-rollout $Q8 --train megatron --infer vllm --strict --mode rollout --max-new-tokens 64 ${VQ8_OPTS:-}
             cmp vq8-strict $Q8 --train megatron --infer vllm --strict ${VQ8_OPTS:-}
             cmp vq8-default $Q8 --train megatron --infer vllm ${VQ8_OPTS:-} ;;
    vllm-fp8) for args in "bf16" "w8 --infer-opt quantization=fp8" "w8kv8 --infer-opt quantization=fp8 --infer-opt kv_cache_dtype=fp8"; do
                set -- $args; name=$1; shift
                cmp fp8-$name --model Qwen3-1.7B --random-weights --random-prompts 4 --prompt-len 256 --mode rollout \
                  --max-new-tokens 64 --train megatron --infer vllm "$@"
              done ;;
    vllm-fp8-bisect) timeout 400 python3 -m alignaudit bisect --model Qwen3-1.7B --random-weights --random-prompts 2 \
                       --prompt-len 256 --train megatron --infer vllm --infer-opt quantization=fp8 --layers 0 --device cuda \
                       --out /tmp/runs/fp8-bisect --force 2>&1 | log | tail -30 ;;
    vllm-q8-prompt) cmp vq8-strict $Q8 --train megatron --infer vllm --strict ${VQ8_OPTS:-} ;;
    vllm-q8-bi) VLLM_BATCH_INVARIANT=1 cmp vq8-bi-strict-rollout $Q8 --train megatron --infer vllm --strict --mode rollout \
                  --max-new-tokens 64
                [ -d /tmp/runs/vq8-strict-rollout ] || cmp vq8-strict-rollout $Q8 --train megatron --infer vllm --strict \
                  --mode rollout --max-new-tokens 64
                timeout 120 python3 -m alignaudit diff /tmp/runs/vq8-bi-strict-rollout/infer /tmp/runs/vq8-strict-rollout/infer \
                  --out /tmp/runs/vq8-bi-vs-plain --force 2>&1 | log | grep -E "IDENTICAL|differ|tokens compared|rror" | head -4 ;;
    vllm-q8-bi-default) VLLM_BATCH_INVARIANT=1 cmp vq8-bi-default-rollout $Q8 --train megatron --infer vllm --mode rollout \
                          --max-new-tokens 64 ;;
    vllm-q8-processed) for how in ${PROCESSED_HOW:-strict default}; do
                         VLLM_USE_V2_MODEL_RUNNER=${PROCESSED_V2:-0} cmp vq8-processed-$how $Q8 --train megatron --infer vllm $([ $how = strict ] && echo --strict) \
                           --mode rollout --max-new-tokens 64 --temperature 0.7 --top-k 50 --top-p 0.9 \
                           --infer-opt logprobs_mode=processed_logprobs
                       done ;;
    vllm-q8-shaped) shaped_prompts 151936
                    for how in ${SHAPED_HOW:-strict default}; do
                      cmp vq8-shaped-$how --model Qwen3-8B --random-weights --prompts $SHAPED_PROMPTS --train megatron --infer vllm \
                        $([ $how = strict ] && echo --strict) --mode rollout --max-new-tokens 128 --group-size 8 \
                        --engine-mode async --arrival-gap 0.05 --infer-opt "$STOPS"
                      shaped_summary /tmp/runs/vq8-shaped-$how
                    done ;;
    vllm-rl17-shaped) shaped_prompts 151936
                      timeout ${RL_TIMEOUT:-500} python3 -m alignaudit rl --model Qwen3-1.7B --random-weights --prompts $SHAPED_PROMPTS \
                        --train megatron --infer vllm --device cuda --strict --steps ${RL_STEPS:-20} --group-size 8 --max-new-tokens 64 \
                        --sleep-level 1 --engine-mode ${RL_ENGINE_MODE:-async} $([ "${RL_ENGINE_MODE:-async}" = async ] && echo --arrival-gap 0.05) \
                        --infer-opt "$STOPS" --lr 1e-6 --no-token-rows --out /dev/shm/vrl17s --force ${CMP_OPTS:-} 2>&1 | log | tail -4
                      cp /dev/shm/vrl17s/steps.parquet "$out/vrl17s-steps.parquet" 2>/dev/null
                      python3 -c "import pandas as pd; t=pd.read_parquet('/dev/shm/vrl17s/steps.parquet'); print(t[['step','tokens','mismatches','ulp_max','sync_bit_equal','completions_ended_early','completion_len_mean','prefix_cache_hits','arrived_while_running','max_running_requests','sleep_freed_gib','wake_taken_gib','seconds','rollout_s','sync_s']].to_string())" 2>&1 | log | tail -22 ;;
    trl) for how in ${TRL_HOW:-strict default}; do
           timeout ${TRL_TIMEOUT:-240} python3 bench/trl_grpo.py fixtures/qwen3-tiny $how /tmp/trl-$how --device cuda --steps ${TRL_STEPS:-3} ${TRL_OPTS:-} 2>&1 \
             | log | grep -E "^RESULT|^MOVED|Error|rror:" | tail -4
         done ;;
    flash) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_flash.py -rs 2>&1 | log | tail -4
           for train in ${FLASH_TRAIN:-megatron hf}; do
             cmp vflash-$train-rollout --model ${FLASH_MODEL:-Qwen3-0.6B} --random-weights --random-prompts 4 --prompt-len 512 \
               --train $train --infer vllm --strict --strict-attention flash --mode rollout --max-new-tokens 64
           done ;;
    task-model) timeout ${TASK_TIMEOUT:-400} python3 fixtures/train_task_fixture.py --shape ${TASK_SHAPE:-Qwen3-0.6B} --device cuda \
                  --steps ${TASK_STEPS:-300} --lr ${TASK_LR:-3e-4} --questions ${TASK_QUESTIONS:-train} --out /tmp/task-model 2>&1 | log | tail -20
                cp /tmp/task-model/training.json "$out/task-model-training.json" 2>/dev/null ;;
    task-rl) eval_file=
             if [ -n "${TASK_EVAL_N:-}" ]; then  # more held-out questions than rl's 64, for a smaller spread
               held=$(mktemp /tmp/task-eval-XXXX.txt)  # one file per lane (bench/gpu_lanes.sh runs two side by side)
               python3 -c "from alignaudit.rl.task import questions; print('\n'.join(questions(${TASK_EVAL_N}, 0, 'held_out')))" \
                 > $held && eval_file="--eval-prompts $held"
             fi
             for how in ${TASK_HOW:-strict default}; do
               grpo task-$how --model /tmp/task-model --reward task --steps ${TASK_RL_STEPS:-200} --group-size 8 \
                 --max-new-tokens 8 --prompts-per-step ${TASK_PER_STEP:-8} --eval-every ${TASK_EVAL_EVERY:-20} $eval_file \
                 $([ $how = strict ] && echo --strict)
             done ;;
    vllm-q8-default) cmp vq8-default $Q8 --train megatron --infer vllm ${VQ8_OPTS:-} ;;
    vllm-q8-rollout) cmp vq8-strict-rollout $Q8 --train megatron --infer vllm --strict --mode rollout --max-new-tokens 64 ${VQ8_OPTS:-} ;;
    vllm-q8-hf) cmp vq8-strict-hf-rollout $Q8 --train hf --infer vllm --strict --mode rollout --max-new-tokens 64 ;;
    vllm-q8-native) cmp vq8-native-rollout $Q8 --train megatron --infer vllm --strict --strict-exp native --mode rollout \
                      --max-new-tokens 64 ;;
    vllm-q8-bisect) timeout 400 python3 -m alignaudit bisect --model Qwen3-8B --random-weights --random-prompts 2 --prompt-len 256 --train megatron --infer vllm \
                      --device cuda --layers 0 --mode natural --out /tmp/runs/vq8-bisect --force ${CMP_OPTS:-} 2>&1 | log \
                      | grep -E "◀|first diverging|every op|rror" | tail -8
                    cp /tmp/runs/vq8-bisect/bisect.json "$out/vq8-bisect.json" 2>/dev/null ;;
    vllm-moe) cmp vmoe-strict --model qwen3-moe-tiny --train megatron --infer vllm --strict
              cmp vmoe-strict-rollout --model qwen3-moe-tiny --train megatron --infer vllm --strict --mode rollout --max-new-tokens 32
              python3 -c "
import copy; from pathlib import Path; from alignaudit.arch import PRESETS; from alignaudit.inputs.synth import synthesize_checkpoint
c = copy.deepcopy(PRESETS['Qwen3-30B-A3B'].config); c['num_hidden_layers'] = ${MOE_LAYERS:-4}
synthesize_checkpoint(c, Path('/tmp/q30a3b')); print('Qwen3-30B-A3B shape at /tmp/q30a3b:', c['num_hidden_layers'], 'layers')" 2>&1 | log | tail -3
              cmp vq30-strict --model /tmp/q30a3b --random-prompts 2 --prompt-len 512 --train megatron --infer vllm --strict
              cmp vq30-strict-rollout --model /tmp/q30a3b --random-prompts 2 --prompt-len 512 --train megatron --infer vllm \
                --strict --mode rollout --max-new-tokens 64 ;;
    moe-bench) timeout ${MOEB_TIMEOUT:-400} python3 bench/moe_gpu.py --tokens ${MOE_TOKENS:-8,64,512,4096} ${MOEB_OPTS:-} \
                 --json "$out/moe-bench.json" 2>&1 | log | tail -8 ;;
    vllm-moe-graphs) python3 -c "
import copy; from pathlib import Path; from alignaudit.arch import PRESETS; from alignaudit.inputs.synth import synthesize_checkpoint
c = copy.deepcopy(PRESETS['Qwen3-30B-A3B'].config); c['num_hidden_layers'] = ${MOE_LAYERS:-4}
synthesize_checkpoint(c, Path('/tmp/q30a3b')); print('Qwen3-30B-A3B shape at /tmp/q30a3b:', c['num_hidden_layers'], 'layers')" 2>&1 | log | tail -3
              for how in ${MOEG_HOW:-auto}; do
                export ALIGNAUDIT_MOE_DISPATCH=$how
                cmp vmoeg-$how-rollout --model qwen3-moe-tiny --train megatron --infer vllm --strict --mode rollout \
                  --max-new-tokens 32
                cmp vq30g-$how-rollout --model /tmp/q30a3b --random-prompts 2 --prompt-len 512 --train megatron \
                  --infer vllm --strict --mode rollout --max-new-tokens 64
                unset ALIGNAUDIT_MOE_DISPATCH
              done ;;
    vllm-rl17) timeout 560 python3 -m alignaudit rl --model Qwen3-1.7B --random-weights --random-prompts 2 --prompt-len 64 \
                 --train megatron --infer vllm --device cuda --strict --steps ${RL_STEPS:-20} --group-size 4 --max-new-tokens 32 \
                 --no-token-rows --out /dev/shm/vrl17 --force ${CMP_OPTS:-} 2>&1 | log | tail -4
               cp /dev/shm/vrl17/steps.parquet "$out/vrl17-steps.parquet" 2>/dev/null
               python3 -c "import pandas as pd; t=pd.read_parquet('/dev/shm/vrl17/steps.parquet'); print(t[['step','tokens','mismatches','ulp_max','sync_bit_equal','reward_mean','loss','grad_norm','seconds','rollout_s','rescore_s','update_s','sync_s']].to_string())" 2>&1 | log | tail -22 ;;
    top-p-probe) timeout 120 python3 bench/top_p_probe.py --json "$out/top-p-probe.json" 2>&1 | log | tail -6 ;;
    ipc) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/rl/test_weight_transfer.py -rs 2>&1 | log | tail -5 ;;
    rl-bench) timeout ${RLB_TIMEOUT:-420} python3 bench/rl_steps.py --steps ${RLB_STEPS:-6} --configs ${RLB_CONFIGS:-strict,default} --rounds ${RLB_ROUNDS:-1} -- $G17 --device cuda --lr 1e-6 \
                ${RLB_OPTS:-} 2>&1 | log | tail -20
              cp bench-rl-steps.json "$out/" 2>/dev/null ;;
    train-profile) timeout ${TP_TIMEOUT:-500} python3 bench/train_step_profile.py --model Qwen3-1.7B --json "$out/train-profile.json" \
                     2>&1 | log | tail -70 ;;
    grpo17) grpo grpo17-${GRPO_TAG:-strict} $G17 ${GRPO_OPTS:---strict} --steps ${GRPO_STEPS:-200} --kl-coef ${GRPO_KL:-0.04} ;;
    grpo8) grpo grpo8 --model Qwen3-8B --random-weights --random-prompts 8 --prompt-len 64 --max-new-tokens 64 --group-size 4 \
             --train-opt micro_batch_size=${GRPO8_MB:-8} --strict --steps ${GRPO8_STEPS:-30} ;;
    vllm-bench) timeout 560 python3 bench/vllm_generate.py --model ${VB_MODEL:-Qwen3-8B} --prompts ${VB_PROMPTS:-64} \
                  --prompt-len ${VB_PROMPT_LEN:-512} --new-tokens ${VB_NEW:-256} --n ${VB_N:-1} --batches ${VB_BATCHES:-4} --capture-size ${VB_CAPTURE:-0} --prefill-batches ${VB_PREFILL:-0} \
                  --configs ${BENCH_CONFIGS:-default,batch-invariant,strict,strict-native-exp} --profile "${BENCH_PROFILE:-}" --profile-batch ${VB_PROFILE_BATCH:-full} \
                  --json "$out/vllm-generate.json" 2>&1 | log | tail -${BENCH_TAIL:-12} ;;
    vllm-warmup) timeout 400 python3 bench/vllm_generate.py --model Qwen3-8B --prompts 600 --prompt-len 128 --new-tokens 32 \
                   --max-model-len ${WARMUP_MAX_LEN:-4096} --batches 2 --configs strict \
                   --json "$out/vllm-warmup.json" 2>&1 | log | tail -4 ;;
    linear19) timeout 300 python3 bench/kernels_gpu.py --sections matmul --layers qkv,o,gate_up,down \
                --ms ${LIN_MS:-32,64,128,256,4096} --json "$out/linear19.json" 2>&1 | log | tail -22 ;;
    attention19) timeout 200 python3 bench/kernels_gpu.py --sections attention-fa3 --json "$out/attention19.json" 2>&1 \
                   | log | tail -12 ;;
    decode-gen19) timeout 200 python3 bench/sweep_gpu.py --sections decode-generation --json "$out/decode-gen19.json" \
                    2>&1 | log | tail -24 ;;
    sweep19) timeout 400 python3 bench/sweep_gpu.py --sections issue19 --json "$out/sweep19.json" 2>&1 | log | tail -40 ;;
    targets19) [ -f "$out/forward.json" ] || cp /tmp/keep/forward.json "$out/" 2>/dev/null
               python3 bench/targets.py $(for f in linear19 attention19; do [ -f "$out/$f.json" ] && echo --kernels "$out/$f.json"; done) \
                 --forward "$out/forward.json" --vllm "$out/vllm-generate.json" 2>&1 | log ;;
    q8-bisect) timeout 400 python3 -m alignaudit bisect --model Qwen3-8B --random-weights --random-prompts 2 \
                 --prompt-len 256 --train megatron --infer hf --device cuda --layers 0 --out /tmp/runs/q8-bisect --force \
                 2>&1 | log | tail -60
               cp /tmp/runs/q8-bisect/bisect.json "$out/q8-bisect.json" 2>/dev/null ;;
  esac
done
exit $status
