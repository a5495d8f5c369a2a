"""alignaudit's strict Megatron layers for trainers that build their own GPTModel from a layer spec: slime and miles
(``--spec alignaudit.integrations.megatron_spec.strict_spec``: a function of (args, config, vp_stage), which their
model provider calls and passes on as GPTModel's ``transformer_layer_spec``; slime/backends/megatron_utils/
model_provider.py). docs/frameworks.md "slime and miles" says what it makes strict and what stays the trainer's.

    --spec alignaudit.integrations.megatron_spec.strict_spec --position-embedding-type none --transformer-impl local

Strict in the spec (alignaudit.engines.megatron.strict.strict_block_spec, all ops): every layer's input and pre-MLP
RMSNorm and q/k norms, QKV/output/MLP linears, SwiGLU, rope (rotated inside the strict core attention, at each
token's index in its sequence, so GPTModel's own rope must be off: ``position_embedding_type`` "none") and attention
(packed THD batches by their cu_seqlens, or [s, b] batches by their padding mask), and the final norm. Outside the
spec, hence the trainer's own: the embedding lookup (a gather, exact), GPTModel's output layer (the LM head product)
and the trainer's log-softmax of the logits.
"""

from __future__ import annotations

from alignaudit.errors import InputError
from alignaudit.inputs.strict_ops import STRICT_OPS

# Megatron's llama3 rope scaling (``--use-rope-scaling``): factor from ``--rope-scaling-factor``, the rest fixed in
# megatron/core/models/common/embeddings/rope_utils.py (low 1, high 4, original 8192 positions).
MEGATRON_LLAMA3 = (1.0, 4.0, 8192)


def strict_spec(args, config, vp_stage: int | None = None):
    """The strict block spec for slime's / miles' ``--spec`` (module docstring).

    Args:
        args: the trainer's Megatron arguments (argparse.Namespace: num_experts, multi_latent_attention,
            position_embedding_type, rotary_base, qk_layernorm, normalization, use_rope_scaling,
            rope_scaling_factor, attention_dropout, hidden_dropout are read).
        config: the TransformerConfig the model is built with (num_layers, parallel sizes).
        vp_stage: the virtual pipeline stage; the strict model is one pipeline stage, so only None or 0.
    Returns:
        megatron.core.transformer.transformer_block.TransformerBlockSubmodules: config.num_layers strict layers and
        the strict final RMSNorm.
    Raises:
        InputError: a setting under which the spec would not compute what alignaudit's strict Megatron computes
            (MoE, multi-latent attention, GPTModel's own rope, a norm other than RMSNorm, dropout, pipeline,
            context, expert or sequence parallelism), naming it and the fix.
    """
    from alignaudit.engines.megatron.strict import check_parallelism, strict_block_spec

    def arg(name, default=None):
        return getattr(args, name, default)

    refusals = [
        (
            bool(arg("num_experts")),
            f"num_experts={arg('num_experts')}: the strict MoE layer is swapped in by "
            "alignaudit's StrictGPTModel, not by a spec; dense models only",
        ),
        (
            bool(arg("multi_latent_attention")),
            "multi_latent_attention: the strict attention is grouped-query attention",
        ),
        (
            arg("position_embedding_type", "rope") != "none",
            f"position_embedding_type="
            f"{arg('position_embedding_type', 'rope')!r}: the strict core attention rotates q and k itself, and "
            "GPTModel would rotate them a second time; pass --position-embedding-type none (rope stays on, strict)",
        ),
        (
            arg("normalization", "RMSNorm") != "RMSNorm",
            f"normalization={arg('normalization')!r}: the strict norm is RMSNorm",
        ),
        (vp_stage not in (None, 0), f"vp_stage={vp_stage}: the strict model is one pipeline stage"),
        (
            bool(arg("attention_dropout", 0.0)) or bool(arg("hidden_dropout", 0.0)),
            "attention_dropout / hidden_dropout > 0: the rollout engine computes without dropout; pass 0 for both",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise InputError(f"alignaudit strict_spec: {why}")
    try:
        check_parallelism(config)
    except ValueError as e:
        raise InputError(f"alignaudit strict_spec: {str(e).removeprefix('StrictGPTModel: ')}") from None
    llama3 = (float(arg("rope_scaling_factor", 8.0)), *MEGATRON_LLAMA3) if arg("use_rope_scaling") else None
    return strict_block_spec(
        config.num_layers,
        frozenset(STRICT_OPS),
        float(arg("rotary_base", 10000)),
        bool(arg("qk_layernorm", False)),
        llama3,
    )
