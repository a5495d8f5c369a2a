"""Where the canonical ops live in a Megatron-Core GPTModel built with the local layer spec.

Tensors are [tokens, batch, ...]; linears return (output, bias). ``linear_qkv`` groups q/k/v per query
group (layouts.py); ``linear_fc1`` is [gate | up]. RoPE is a function applied inside SelfAttention.forward,
so q_rope/k_rope are read as core_attention's inputs; the residual adds are bias-dropout-add functions,
so attn_residual is read as pre_mlp_layernorm's input and mlp_residual as the layer's output.
(megatron/core/transformer/attention.py, transformer_layer.py, mlp.py in megatron-core 0.16.)
An MoELayer (Qwen3 MoE) returns (output, bias) like the MLP: the moe op. Its TopKRouter computes the logits
in ``gating`` (a method, wrapped for the capture) and returns (probs, routing_map [seq * batch, experts]);
the strict layer's ``strict_router`` returns (logits, expert ids, weights) on [seq * batch, hidden]
(transformer/moe/moe_layer.py, router.py).
"""

from __future__ import annotations

from alignaudit.engines.taps import SEQ_FIRST, Blocks, GroupedQKV, HookPoint, Hooks, Routing, Same, Tap, read_flattened


def install(gpt, tap: Tap) -> Hooks:
    """Register every canonical op of ``gpt`` (an unwrapped GPTModel) on ``tap``; close the result to undo.

    At tensor-parallel size > 1 the column-parallel outputs (the grouped QKV, per-head q/k norms, rope and
    attention, [gate | up], the activation, the vocab-parallel logits) hold this rank's shard: their hook
    points say how they are split, and ``tap.gather`` reassembles them from every rank in rank order. The
    row-parallel outputs (o_proj, down_proj) are whole after Megatron's reduction, as are norms and adds.
    """
    from megatron.core import parallel_state

    hooks = Hooks()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        tap.gather = _gather
    points = [HookPoint(gpt.embedding, Same("embed"), None, SEQ_FIRST)]
    for i, layer in enumerate(gpt.decoder.layers):
        attn, mlp = layer.self_attention, layer.mlp
        points += [
            HookPoint(layer.input_layernorm, Same("input_norm"), i, SEQ_FIRST),
            HookPoint(attn.linear_qkv, GroupedQKV(), i, SEQ_FIRST, index=0, sharded="features"),
            *(
                [
                    HookPoint(attn.q_layernorm, Same("q_norm"), i, SEQ_FIRST, sharded="features"),
                    HookPoint(attn.k_layernorm, Same("k_norm"), i, SEQ_FIRST, sharded="features"),
                ]
                if attn.q_layernorm is not None
                else []
            ),  # QK-norm (Qwen3) only
            *_rope_points(attn.core_attention, i),
            HookPoint(attn.core_attention, Same("attn"), i, SEQ_FIRST, sharded="features"),
            HookPoint(attn.linear_proj, Same("o_proj"), i, SEQ_FIRST, index=0),
            HookPoint(layer.pre_mlp_layernorm, Same("attn_residual"), i, SEQ_FIRST, when="pre"),
            HookPoint(layer.pre_mlp_layernorm, Same("post_attn_norm"), i, SEQ_FIRST),
            *_mlp_points(hooks, tap, mlp, i),
            HookPoint(layer, Same("mlp_residual"), i, SEQ_FIRST, index=0),
        ]
    points += [
        HookPoint(gpt.decoder.final_layernorm, Same("final_norm"), None, SEQ_FIRST),
        HookPoint(gpt.output_layer, Same("logits"), None, SEQ_FIRST, index=0, sharded="features"),
    ]
    for p in points:
        hooks.add(tap, p)
    return hooks


def _mlp_points(hooks: Hooks, tap: Tap, mlp, layer: int) -> list[HookPoint]:
    """The dense MLP's hook points, or an MoE layer's (router and routing read, the output replaceable)."""
    if not hasattr(mlp, "router"):
        return [
            HookPoint(mlp.linear_fc1, Blocks(("gate_proj", "up_proj")), layer, SEQ_FIRST, index=0, sharded="glu"),
            HookPoint(mlp.linear_fc2, Same("act"), layer, SEQ_FIRST, when="pre", sharded="features"),
            HookPoint(mlp.linear_fc2, Same("down_proj"), layer, SEQ_FIRST, index=0),
        ]
    strict = getattr(mlp, "strict_router", None)
    if strict is not None:
        read_flattened(hooks, tap, mlp, strict, layer, SEQ_FIRST, {0: Same("router"), 1: Routing()})
    else:
        router = mlp.router
        gating = router.gating

        def read_logits(input):
            logits = gating(input)
            tap(logits.reshape(*input.shape[:-1], -1), Same("router"), layer, SEQ_FIRST)
            return logits

        hooks.patch(router, "gating", read_logits)
        read_flattened(hooks, tap, mlp, router, layer, SEQ_FIRST, {1: Routing()})
    return [HookPoint(mlp, Same("moe"), layer, SEQ_FIRST, index=0)]


def _gather(x, sharded: str):
    """This rank's shard [tokens, batch, shard, ...] -> the whole tensor: every rank's shard along axis 2
    (query groups, heads or features; each rank holds a contiguous block), in rank order; for SwiGLU's fc1
    ([gate shard | up shard] on each rank) the gate shards, then the up shards."""
    import torch
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    if sharded == "glu":
        halves = [p.chunk(2, dim=2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=2)
    return torch.cat(parts, dim=2)


def _rope_points(core_attention, layer: int) -> list[HookPoint]:
    """q_rope/k_rope: core_attention's inputs, or the strict core attention's own rope modules."""
    if getattr(core_attention, "q_rope", None) is not None:  # alignaudit.engines.megatron.strict.StrictCoreAttention
        return [
            HookPoint(core_attention.q_rope, Same("q_rope"), layer, SEQ_FIRST, sharded="features"),
            HookPoint(core_attention.k_rope, Same("k_rope"), layer, SEQ_FIRST, sharded="features"),
        ]
    return [
        HookPoint(core_attention, Same("q_rope"), layer, SEQ_FIRST, when="pre", index=0, sharded="features"),
        HookPoint(core_attention, Same("k_rope"), layer, SEQ_FIRST, when="pre", index=1, sharded="features"),
    ]
