"""What each engine implements, consulted before any engine starts: a setting takes effect or is refused.

Three tables, each entry with the reason a user reads when it applies:
    CHECKPOINT_FEATURES  config.json fields that change the math, and which engines implement which values
    MEGATRON_OPTIONS     the TransformerConfig fields alignaudit knows to take effect in a forward pass
                         (an allowlist: TransformerConfig has ~240 fields, most of them for training,
                         parallelism or kernels this path never runs); MEGATRON_REFUSED says why common
                         others are refused
    VLLM_REFUSED         vLLM EngineArgs/SamplingParams settings that have no effect on what alignaudit
                         measures, that alignaudit sets itself (use its flag), or that make the values
                         something other than logprobs
``check_runs`` applies them to a comparison's two engines; it raises InputError with one line naming the
setting, the reason and the fix. docs/cli.md lists the same tables for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from alignaudit.errors import InputError

# --- checkpoint features ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Feature:
    """A config.json field and the values every engine adapter implements for it."""

    field: str
    supported: Callable[[Any], bool]
    describe: str


CHECKPOINT_FEATURES: tuple[Feature, ...] = (
    Feature("hidden_act", lambda v: v in (None, "silu"), "SiLU-gated MLPs (hidden_act silu)"),
    Feature("use_sliding_window", lambda v: not v, "full attention (use_sliding_window false)"),
    Feature("rope_scaling", lambda v: not v or (isinstance(v, dict) and v.get("rope_type", v.get("type")) in
                                                 ("default", "llama3")),
            "plain RoPE, or llama3 rope scaling on Llama (alignaudit.arch)"),
    Feature("mlp_bias", lambda v: not v, "MLPs without bias (mlp_bias false)"),
)


# Features some engine adapters implement and others implement differently: (name, whether a spec has it,
# engines that implement the checkpoint's meaning, why the others do not).
ENGINE_FEATURES: tuple[tuple[str, Callable[[Any], bool], frozenset[str], str], ...] = (
    ("attention_bias", lambda spec: spec.architecture == "Qwen3ForCausalLM" and spec.attention_bias,
     frozenset({"megatron", "vllm"}),
     "transformers' Qwen3 adds a bias to o_proj as well when attention_bias is true (modeling_qwen3.py), vLLM's "
     "and Megatron's Qwen3 put biases on q/k/v only: the engines would run different models"),
    ("rope_scaling", lambda spec: bool(spec.rope_llama3) and tuple(spec.rope_llama3[1:]) != (1.0, 4.0, 8192),
     frozenset({"hf", "vllm"}),
     "Megatron's llama3 rope scaling fixes low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings "
     "8192 (megatron/core/models/common/embeddings/rotary_pos_embedding.py); this checkpoint sets others"),
)


def check_engine_features(spec, engines: tuple[str, ...]) -> None:
    """Refuse a checkpoint feature that one of ``engines`` implements with other math.

    Raises:
        InputError: naming the feature, the engine and the reason.
    """
    for attribute, present, implemented, why in ENGINE_FEATURES:
        if present(spec):
            for engine in engines:
                if engine not in implemented:
                    raise InputError(f"{spec.name}: {attribute} is not supported with {engine}: {why}; compare "
                                     f"{' and '.join(sorted(implemented))}")


# What alignaudit does not run for mixture-of-experts models yet (alignaudit.arch.qwen3_moe), and why.
MOE_REFUSED: dict[str, str] = {
    "alignaudit rl": "the weight sync maps dense MLPs only; run rl on a dense model",
    "tensor parallelism": "expert weights are not sharded by alignaudit; run MoE models at tensor parallel size 1",
    "strict vLLM on CUDA with CUDA graphs": "its expert dispatch failed inside vLLM's graph capture (H200, vLLM "
    "0.26.0; eager: 0 mismatches, docs/findings.md)",
}


def refuse_moe(spec, what: str, fix: str = "") -> None:
    """Refuse ``what`` (a MOE_REFUSED key) for a mixture-of-experts model. Raises InputError with the reason
    and, where given, ``fix`` (appended after a semicolon)."""
    if spec.num_experts:
        raise InputError(f"{what} for {spec.architecture} ({spec.name}) is not implemented: {MOE_REFUSED[what]}"
                         + (f"; {fix}" if fix else ""))


def refuse_moe_cuda_graphs(spec, runs) -> None:
    """Refuse strict MoE inside CUDA vLLM unless vLLM runs eager (``enforce_eager=true``): not yet run in graphs.
    ``runs``: the train run, then the infer run (the fix names that side's option flag).

    Raises:
        InputError: with MOE_REFUSED's reason and the fix.
    """
    for run, flag in zip(runs, ("--train-opt", "--infer-opt")):
        s = run.settings
        if (run.engine == "vllm" and s.device == "cuda" and "linear" in s.strict_ops
                and not s.options.get("enforce_eager")):
            refuse_moe(spec, "strict vLLM on CUDA with CUDA graphs", fix=f"add {flag} enforce_eager=true")


# The engine option that sets the tensor-parallel size, by engine (hf has none)
TP_OPTION = {"megatron": "tensor_model_parallel_size", "vllm": "tensor_parallel_size"}


def tensor_parallel_size(run) -> int:
    """The tensor-parallel size an EngineRun asks for (1 unless the engine's own option says otherwise)."""
    key = TP_OPTION.get(run.engine)
    return run.settings.options.get(key, 1) if key else 1


def refuse_parallel(runs, what: str, why: str) -> None:
    """Refuse ``what`` for runs at tensor-parallel size > 1. Raises InputError naming the engine and why."""
    for run in runs:
        if tensor_parallel_size(run) != 1:
            raise InputError(f"{what} with {run.engine} at tensor parallel size > 1 is not implemented: {why}")


def check_parallel(spec, runs, device: str) -> None:
    """Refuse a tensor-parallel size the model cannot be split by, or the machine cannot hold.

    Raises:
        InputError: naming the size, what it must divide, or what the machine has.
    """
    import os

    for run in runs:
        key = TP_OPTION.get(run.engine)
        tp = tensor_parallel_size(run)
        if tp == 1:
            continue
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise InputError(f"{run.engine} {key}={tp!r}: expected an integer >= 1")
        sizes = [("attention heads", spec.num_heads), ("FFN width", spec.intermediate_size)]
        if run.engine == "megatron":  # vLLM replicates KV heads and pads the vocabulary itself
            sizes += [("query groups", spec.num_query_groups), ("vocabulary", spec.vocab_size)]
        elif spec.num_kv_heads % tp and tp % spec.num_kv_heads:
            raise InputError(f"vllm tensor_parallel_size={tp}: the {spec.num_kv_heads} KV heads of {spec.name} can be "
                             "neither split nor replicated evenly over that many ranks")
        for what, n in sizes:
            if n % tp:
                raise InputError(f"{run.engine} {key}={tp} does not divide the {n} {what} of {spec.name}; use a "
                                 "size that divides it")
        if device == "cuda":
            import torch

            have, unit = torch.cuda.device_count(), "GPUs"
        else:
            have, unit = len(os.sched_getaffinity(0)), "CPU cores"
        if tp > have:
            raise InputError(f"{run.engine} {key}={tp} needs {tp} {unit}, one per rank; this machine has {have}")


def check_checkpoint_config(config: dict, source: str) -> None:
    """Refuse a config.json whose math some engine adapter does not implement.

    Raises:
        InputError: naming the field, its value and what is supported.
    """
    for feature in CHECKPOINT_FEATURES:
        value = config.get(feature.field)
        if not feature.supported(value):
            raise InputError(f"{source}: {feature.field}={value!r} is not implemented by every engine adapter; "
                             f"alignaudit supports {feature.describe}")


# --- Megatron-Core ---------------------------------------------------------------------------------

# TransformerConfig fields alignaudit derives from the checkpoint or --dtype (engines/megatron.py).
MEGATRON_CHECKPOINT_FIELDS = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "bf16", "fp16", "params_dtype", "pipeline_dtype"})
MEGATRON_OPTIONS: dict[str, str] = {
    # Each reaches the model; "same bits" = measured on the fixture on CPU (bf16) against the default.
    "micro_batch_size": "sequences per forward pass, right-padded (alignaudit's option, not TransformerConfig's)",
    "tensor_model_parallel_size": "tensor-parallel ranks, one process each (gloo on CPU, NCCL on CUDA, one GPU a "
                                  "rank); must divide the heads, query groups, FFN width and vocabulary",
    "attention_softmax_in_fp32": "the unfused attention softmax's input dtype (same bits on CPU: torch's bf16 "
                                 "softmax accumulates in fp32 and rounds once)",
    "apply_query_key_layer_scaling": "QK^T scaled by 1/layer_number before the softmax and back inside it (same bits)",
    "bias_dropout_fusion": "the residual add through Megatron's jit-fused bias-dropout-add (same bits)",
    "deterministic_mode": "Megatron's deterministic kernel choices (same bits on CPU)",
    "cross_entropy_loss_fusion": "the logprob through Megatron's fused cross-entropy, native impl (18 of 176 tokens "
                                 "change)",
    "masked_softmax_fusion": "the fused scale-mask-softmax kernel (CUDA only)",
    "apply_rope_fusion": "the fused RoPE kernel (CUDA with Transformer Engine or apex only)",
    "hidden_dropout": "0 only: the forward pass runs in eval mode",
    "attention_dropout": "0 only: the forward pass runs in eval mode",
}
CUDA_ONLY = {"masked_softmax_fusion", "apply_rope_fusion"}
EVAL_ZERO = {"hidden_dropout", "attention_dropout"}
PARALLEL_ONLY_TP = "alignaudit runs Megatron with tensor parallelism only (tensor_model_parallel_size)"
MEGATRON_REFUSED: dict[str, str] = {
    "pipeline_model_parallel_size": PARALLEL_ONLY_TP,
    "context_parallel_size": PARALLEL_ONLY_TP,
    "expert_model_parallel_size": PARALLEL_ONLY_TP,
    "sequence_parallel": "alignaudit's tensor-parallel runs keep activations whole on every rank; sequence "
                         "parallelism (activations split along the sequence) is not implemented",
    "gradient_accumulation_fusion": "training only (fuses weight-gradient accumulation); no effect on a forward pass",
    "persist_layer_norm": "applies to apex/Transformer Engine LayerNorm; the local spec uses torch RMSNorm",
    "memory_efficient_layer_norm": "applies to apex/Transformer Engine LayerNorm; the local spec uses torch RMSNorm",
    "recompute_granularity": "activation recomputation is for the backward pass; no effect on a forward pass",
    "softmax_scale": "comes from the checkpoint (1/sqrt(head_dim)); overriding it changes the model",
    "fp32_residual_connection": "crashes the local spec (the fp32 residual meets bf16 linear weights in layer 0)",
    "layernorm_zero_centered_gamma": "changes how the checkpoint's norm weights are read",
}

# --- vLLM ------------------------------------------------------------------------------------------

VLLM_SET_BY_ALIGNAUDIT: dict[str, str] = {
    "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
    "max_tokens": "--max-new-tokens", "min_tokens": "--max-new-tokens (EOS is ignored, never masked)",
    "ignore_eos": "--max-new-tokens (EOS is always ignored)", "logprobs": "alignaudit (the sampled token's logprob)",
    "prompt_logprobs": "alignaudit (one per prompt token)", "n": "--prompts (one completion per prompt)",
    "detokenize": "alignaudit (token ids only)", "dtype": "--dtype / --infer-dtype", "model": "--model",
}
VLLM_REFUSED: dict[str, Callable[[Any, str], str | None]] = {
    "enable_prefix_caching": lambda v, mode: (
        "has no effect here: vLLM never reads the prefix cache for a request that asks for prompt logprobs "
        "(skip_reading_prefix_cache), and every alignaudit request does") if v else None,
    "skip_reading_prefix_cache": lambda v, mode: (
        "reading the prefix cache with prompt logprobs crashes vLLM 0.32 "
        "(KeyError in the scheduler)") if v is False else None,
    "logprobs_mode": lambda v, mode: (
        f"{v} are logits, not logprobs; the other engine computes logprobs" if v in ("raw_logits", "processed_logits")
        else "processed_logprobs apply to sampled tokens only (vLLM's prompt logprobs are always raw), so they "
             "need --mode rollout" if v == "processed_logprobs" and mode == "prompt" else None),
    "pipeline_parallel_size": lambda v, mode: "alignaudit runs vLLM on one process" if v not in (None, 1) else None,
    "data_parallel_size": lambda v, mode: "alignaudit runs vLLM on one process" if v not in (None, 1) else None,
    "hf_overrides": lambda v, mode: "set the lm_head dtype with --lm-head-dtype, for both engines"
    if isinstance(v, dict) and "head_dtype" in v else None,
}


def check_runs(train, infer, mode: str) -> None:
    """Refuse settings of either engine that would not take effect as recorded (see the module docstring).

    Args:
        train, infer: alignaudit.request.EngineRun (options, strict ops, device). mode: "prompt" or "rollout".
    Raises:
        InputError: the first refused setting: engine, name, reason, fix.
    """
    for role, run in (("train", train), ("infer", infer)):
        flag = f"--{role}-opt"
        if run.engine == "megatron":
            _check_megatron(run.settings, flag)
        elif run.engine == "vllm":
            _check_vllm(run.settings, mode, role, flag)
    if processed_logprobs(infer) and "logprobs" in infer.settings.strict_ops:
        raise InputError("--strict logprobs covers vLLM's raw_logprobs (Sampler.compute_logprobs); with "
                         "logprobs_mode=processed_logprobs vLLM computes them inside its top-k/top-p sampler, which "
                         "the strict path does not replace: drop logprobs from --strict or the option")


def processed_logprobs(run) -> bool:
    """Whether ``run`` (the rollout engine) records processed logprobs (after temperature, top-k, top-p),
    which the training side must then replay."""
    return run.engine == "vllm" and run.settings.options.get("logprobs_mode") == "processed_logprobs"


def _json(value) -> str:
    import json

    return json.dumps(value)


def _check_megatron(settings, flag: str) -> None:
    for key, value in settings.options.items():
        if key in MEGATRON_CHECKPOINT_FIELDS:
            raise InputError(f"megatron option(s) {key} come from the checkpoint's config.json or --dtype; they cannot "
                             "be overridden")
        if key in MEGATRON_REFUSED:
            raise InputError(f"megatron {key}: {MEGATRON_REFUSED[key]}; drop {flag} {key}")
        if key not in MEGATRON_OPTIONS:
            raise InputError(f"megatron {key}: alignaudit does not know it to take effect in a forward pass, so it "
                             f"would be recorded without being measured; supported: {', '.join(MEGATRON_OPTIONS)}")
        if key in EVAL_ZERO and value:
            raise InputError(f"megatron {key}={_json(value)}: no effect, the forward pass runs in eval mode "
                             f"(dropout off); drop {flag} {key}")
        if key in CUDA_ONLY and value and settings.device != "cuda":
            raise InputError(f"megatron {key}=true needs a CUDA kernel (Megatron falls back silently on CPU); drop it "
                             "or use --device cuda")


def _check_vllm(settings, mode: str, role: str, flag: str) -> None:
    for key, value in settings.options.items():
        if key in VLLM_SET_BY_ALIGNAUDIT:
            raise InputError(f"vllm {key} is set by alignaudit; use {VLLM_SET_BY_ALIGNAUDIT[key]} "
                             f"instead of {flag} {key}")
        reason = VLLM_REFUSED.get(key, lambda v, m: None)(value, mode)
        if key == "logprobs_mode" and value == "processed_logprobs" and role == "train":
            reason = "the training side scores teacher-forced tokens, whose logprobs vLLM always computes raw"
        if reason:
            raise InputError(f"vllm {key}={_json(value)}: {reason}; drop {flag} {key}")


def check_vllm_sampling(options: dict, engine_fields: set[str], mode: str, role: str) -> None:
    """SamplingParams settings only act on sampled tokens: refused in prompt mode and on the training side.
    Runs in the option-check worker, which imports vLLM's EngineArgs to tell the two kinds apart.

    Raises:
        InputError: naming the setting.
    """
    flag = f"--{role}-opt"
    for key in options:
        if key not in engine_fields and (mode == "prompt" or role == "train"):
            raise InputError(f"vllm {key} is a sampling setting and has no effect on teacher-forced (prompt) logprobs; "
                             f"drop {flag} {key}")
