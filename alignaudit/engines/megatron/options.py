"""Megatron-Core options: which TransformerConfig fields a user may pass (an allowlist) and why the others are
refused, checked before any engine starts.

    MEGATRON_OPTIONS     the TransformerConfig fields alignaudit knows to take effect in a forward pass
                         (TransformerConfig has ~240 fields, most of them for training, parallelism or kernels this
                         path never runs); MEGATRON_REFUSED says why common others are refused
    MEGATRON_CHECKPOINT_FIELDS  derived from the checkpoint or --dtype (adapter.py), never overridden
docs/cli.md lists the same tables for users.
"""

from __future__ import annotations

import json

from alignaudit.errors import InputError

# TransformerConfig fields alignaudit derives from the checkpoint or --dtype (engines/megatron/adapter.py).
MEGATRON_CHECKPOINT_FIELDS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "normalization",
        "layernorm_epsilon",
        "gated_linear_unit",
        "activation_func",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "bf16",
        "fp16",
        "params_dtype",
        "pipeline_dtype",
    }
)
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


def check_options(settings, flag: str) -> None:
    """Refuse a TransformerConfig field that comes from the checkpoint, that alignaudit does not know to take
    effect in a forward pass, or that cannot take effect here (see the tables above). ``flag``: --train-opt or
    --infer-opt.

    Raises:
        InputError: the option, the reason and the fix.
    """
    for key, value in settings.options.items():
        if key in MEGATRON_CHECKPOINT_FIELDS:
            raise InputError(
                f"megatron option(s) {key} come from the checkpoint's config.json or --dtype; they cannot be overridden"
            )
        if key in MEGATRON_REFUSED:
            raise InputError(f"megatron {key}: {MEGATRON_REFUSED[key]}; drop {flag} {key}")
        if key not in MEGATRON_OPTIONS:
            raise InputError(
                f"megatron {key}: alignaudit does not know it to take effect in a forward pass, so it "
                f"would be recorded without being measured; supported: {', '.join(MEGATRON_OPTIONS)}"
            )
        if key in EVAL_ZERO and value:
            raise InputError(
                f"megatron {key}={json.dumps(value)}: no effect, the forward pass runs in eval mode "
                f"(dropout off); drop {flag} {key}"
            )
        if key in CUDA_ONLY and value and settings.device != "cuda":
            raise InputError(
                f"megatron {key}=true needs a CUDA kernel (Megatron falls back silently on CPU); drop it "
                "or use --device cuda"
            )
