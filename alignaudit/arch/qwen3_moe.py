"""Qwen3 MoE (Qwen3MoeForCausalLM): the Qwen3 attention (QK-norm) with a mixture-of-experts MLP in every
layer (transformers/models/qwen3_moe/modeling_qwen3_moe.py).

Routing per token: router logits = x @ W_gate^T ([num_experts]), softmax in fp32, the top
``num_experts_per_tok`` experts, their probabilities renormalized to sum to 1 when ``norm_topk_prob``;
the layer output is the probability-weighted sum of the chosen experts' SwiGLU outputs. A one-ULP
difference in a router logit can change which experts a token goes to.

What runs today: every engine's own (default) MoE, compared at the logprob level (compare, capture/diff,
gate) and op by op (bisect: router logits, routing, MoE output; alignaudit.capture.ops.MOE_OPS), and under --strict
the strict MoE layer (alignaudit_kernels.route + combine_experts) in megatron, hf and vLLM (its CPU backend, and
CUDA eager or inside its CUDA graphs). rl and tensor parallelism are refused for MoE models before any engine
starts (alignaudit.inputs.capabilities.MOE_REFUSED).
"""

from __future__ import annotations

from alignaudit.arch.dense import Architecture, Preset
from alignaudit.arch.qwen3 import qwen3_config


def qwen3_moe_config(
    *, num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int, norm_topk_prob: bool = True, **shape
) -> dict:
    """A Qwen3MoeForCausalLM ``config.json`` as published on the Hub: Qwen3's fields plus the MoE ones
    (every layer sparse: decoder_sparse_step 1, no mlp_only_layers; router aux loss off at inference)."""
    config = qwen3_config(**shape)
    config.update(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": moe_intermediate_size,
            "norm_topk_prob": norm_topk_prob,
            "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    )
    return config


ARCH = Architecture(
    name="Qwen3MoeForCausalLM",
    hf_prefix="Qwen3Moe",
    qk_norm=True,
    qkv_bias=lambda config: False,
    moe=True,
    refused=(
        ("attention_bias", "transformers' Qwen3 MoE adds an o_proj bias as well, vLLM's and Megatron's do not"),
        (
            "mlp_only_layers",
            "alignaudit maps every layer to an MoE layer; dense layers between them are not implemented",
        ),
    ),
    required=(("decoder_sparse_step", 1, "alignaudit maps every layer to an MoE layer"),),
    presets=(
        Preset(
            "Qwen3-30B-A3B",
            "Qwen/Qwen3-30B-A3B",
            qwen3_moe_config(
                hidden_size=2048,
                intermediate_size=6144,
                num_layers=48,
                num_heads=32,
                num_kv_heads=4,
                tie_word_embeddings=False,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
            ),
        ),
    ),
)
