"""Where the canonical ops live in a transformers dense decoder (Qwen3ForCausalLM, Qwen2ForCausalLM,
LlamaForCausalLM: transformers/models/{qwen3,qwen2,llama}/modeling_*.py; the same module names in each),
and Qwen3MoeForCausalLM, whose MLP is a Qwen3MoeSparseMoeBlock: its router (``gate``, or the strict path's
``strict_router``) sees the tokens flattened to [batch * tokens, hidden] and returns (logits, weights, expert
ids) (logits, expert ids, weights under --strict); the block's output is the moe op.

Tensors are [batch, tokens, ...]. RoPE is a module-level function (``apply_rotary_pos_emb``), patched for
the duration of the capture; its outputs are [batch, heads, tokens, head_dim]. The residual adds are
inline code: attn_residual is read as post_attention_layernorm's input, mlp_residual as the decoder
layer's output.
"""

from __future__ import annotations

import sys

from alignaudit.engines.taps import (
    BATCH_FIRST,
    CURRENT_LAYER,
    Axes,
    HookPoint,
    Hooks,
    Routing,
    Same,
    Tap,
    read_flattened,
)

HEADS_FIRST = Axes(0, 2)  # [batch, heads, tokens, head_dim]


def install(model, tap: Tap) -> Hooks:
    """Register every canonical op of ``model`` on ``tap``; close the result to undo."""
    hooks = Hooks()
    core = model.model
    points = [HookPoint(core.embed_tokens, Same("embed"), None, BATCH_FIRST)]
    for i, layer in enumerate(core.layers):
        attn, mlp = layer.self_attn, layer.mlp
        hooks.raw(layer, lambda module, args, i=i: setattr(tap, "layer", i), pre=True)
        points += [
            HookPoint(layer.input_layernorm, Same("input_norm"), i, BATCH_FIRST),
            HookPoint(attn.q_proj, Same("q_proj"), i, BATCH_FIRST),
            HookPoint(attn.k_proj, Same("k_proj"), i, BATCH_FIRST),
            HookPoint(attn.v_proj, Same("v_proj"), i, BATCH_FIRST),
            *(
                [
                    HookPoint(attn.q_norm, Same("q_norm"), i, BATCH_FIRST),
                    HookPoint(attn.k_norm, Same("k_norm"), i, BATCH_FIRST),
                ]
                if hasattr(attn, "q_norm")
                else []
            ),
            *(
                [
                    HookPoint(attn.q_rope, Same("q_rope"), i, BATCH_FIRST),
                    HookPoint(attn.k_rope, Same("k_rope"), i, BATCH_FIRST),
                ]
                if getattr(attn, "strict_rope", False)
                else []
            ),  # strict rope (alignaudit.engines.hf.strict) is a module
            HookPoint(attn.o_proj, Same("attn"), i, BATCH_FIRST, when="pre"),
            HookPoint(attn.o_proj, Same("o_proj"), i, BATCH_FIRST),
            HookPoint(layer.post_attention_layernorm, Same("attn_residual"), i, BATCH_FIRST, when="pre"),
            HookPoint(layer.post_attention_layernorm, Same("post_attn_norm"), i, BATCH_FIRST),
            *_mlp_points(hooks, tap, mlp, i),
            HookPoint(layer, Same("mlp_residual"), i, BATCH_FIRST),
        ]
    points += [
        HookPoint(core.norm, Same("final_norm"), None, BATCH_FIRST),
        HookPoint(model.lm_head, Same("logits"), None, BATCH_FIRST),
    ]
    for p in points:
        hooks.add(tap, p)

    modeling = sys.modules[type(model).__module__]
    original = modeling.apply_rotary_pos_emb

    def rope(q, k, *args, **kwargs):
        q, k = original(q, k, *args, **kwargs)
        q = _or(tap(q, Same("q_rope"), CURRENT_LAYER, HEADS_FIRST), q)
        k = _or(tap(k, Same("k_rope"), CURRENT_LAYER, HEADS_FIRST), k)
        return q, k

    hooks.patch(modeling, "apply_rotary_pos_emb", rope)
    return hooks


def _mlp_points(hooks: Hooks, tap: Tap, mlp, layer: int) -> list[HookPoint]:
    """The dense MLP's hook points, or an MoE block's (router and routing read from its router's output)."""
    if hasattr(mlp, "experts"):
        strict = getattr(mlp, "strict_router", None)
        routing_index = 1 if strict is not None else 2
        read_flattened(
            hooks, tap, mlp, strict or mlp.gate, layer, BATCH_FIRST, {0: Same("router"), routing_index: Routing()}
        )
        return [HookPoint(mlp, Same("moe"), layer, BATCH_FIRST)]
    return [
        HookPoint(mlp.gate_proj, Same("gate_proj"), layer, BATCH_FIRST),
        HookPoint(mlp.up_proj, Same("up_proj"), layer, BATCH_FIRST),
        HookPoint(mlp.down_proj, Same("act"), layer, BATCH_FIRST, when="pre"),
        HookPoint(mlp.down_proj, Same("down_proj"), layer, BATCH_FIRST),
    ]


def _or(new, old):
    return old if new is None else new
