"""The dense decoder Qwen3, Qwen2 and Llama share, and the ``Architecture`` record that tells them apart.

Per layer: input RMSNorm; q/k/v projections (biases where the architecture has them), per-head RMSNorm of
q and k (QK-norm, Qwen3 only), rotary embedding over the whole head (neox "rotate half"), grouped-query
attention, o_proj, residual add; post-attention RMSNorm, SwiGLU MLP (gate/up/down), residual add. Then a
final RMSNorm and the lm_head (tied to the embedding where the config says so). Tensor names follow the
Hugging Face checkpoints (transformers/models/{qwen3,qwen2,llama}/modeling_*.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    """A released checkpoint's shape: ``config`` is its config.json as published on the Hub."""

    name: str
    hub_id: str
    config: dict


@dataclass(frozen=True)
class Architecture:
    """What alignaudit needs to know about one architecture.

    Attributes:
        name: the config's ``architectures[0]``, e.g. "Qwen3ForCausalLM".
        hf_prefix: transformers' class-name prefix ("Qwen3" -> Qwen3RMSNorm, Qwen3MLP, Qwen3Attention).
        qk_norm: per-head RMSNorm of queries and keys before rope.
        qkv_bias: config -> whether q/k/v projections carry biases.
        rope_types: the ``rope_type`` values the engines implement alike (alignaudit refuses the rest).
        refused: (config field, why) pairs: a true value is refused, since some engine implements it otherwise.
        required: (config field, value, why): any other value is refused.
        moe: the MLP of every layer is a mixture of experts (a router and ``num_experts`` SwiGLU experts).
        presets: released shapes, for runs with random weights.
    """

    name: str
    hf_prefix: str
    qk_norm: bool
    qkv_bias: Callable[[dict], bool]
    rope_types: tuple[str, ...] = ("default",)
    refused: tuple[tuple[str, str], ...] = ()
    required: tuple[tuple[str, object, str], ...] = ()
    moe: bool = False
    presets: tuple[Preset, ...] = field(default=())

    def weight_shapes(self, config: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
        """(HF tensor name, shape, init kind) of every tensor ``config`` implies, in load order."""
        return dense_weight_shapes(config, qk_norm=self.qk_norm, qkv_bias=self.qkv_bias(config), moe=self.moe)


def dense_weight_shapes(
    config: dict, *, qk_norm: bool, qkv_bias: bool, moe: bool = False
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """Yield (HF parameter name, shape, init kind) for a decoder ``config``: every tensor the config implies,
    in the checkpoint's layout (an MoE layer's experts one by one, as the Hub stores them). Kinds: embed,
    linear, norm, bias (alignaudit.inputs.synth draws each kind at its own scale)."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh
    yield "model.embed_tokens.weight", (v, h), "embed"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), "norm"
        yield p + "self_attn.q_proj.weight", (nh * hd, h), "linear"
        yield p + "self_attn.k_proj.weight", (nkv * hd, h), "linear"
        yield p + "self_attn.v_proj.weight", (nkv * hd, h), "linear"
        if qkv_bias:
            yield p + "self_attn.q_proj.bias", (nh * hd,), "bias"
            yield p + "self_attn.k_proj.bias", (nkv * hd,), "bias"
            yield p + "self_attn.v_proj.bias", (nkv * hd,), "bias"
        if qk_norm:
            yield p + "self_attn.q_norm.weight", (hd,), "norm"
            yield p + "self_attn.k_norm.weight", (hd,), "norm"
        yield p + "self_attn.o_proj.weight", (h, nh * hd), "linear"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        if moe:
            experts, width = config["num_experts"], config["moe_intermediate_size"]
            yield p + "mlp.gate.weight", (experts, h), "linear"
            for j in range(experts):
                yield p + f"mlp.experts.{j}.gate_proj.weight", (width, h), "linear"
                yield p + f"mlp.experts.{j}.up_proj.weight", (width, h), "linear"
                yield p + f"mlp.experts.{j}.down_proj.weight", (h, width), "linear"
            continue
        yield p + "mlp.gate_proj.weight", (inter, h), "linear"
        yield p + "mlp.up_proj.weight", (inter, h), "linear"
        yield p + "mlp.down_proj.weight", (h, inter), "linear"
    yield "model.norm.weight", (h,), "norm"
    if not config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h), "embed"
