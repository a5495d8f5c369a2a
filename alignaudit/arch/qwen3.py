"""Qwen3 dense (Qwen3ForCausalLM): QK-norm, no biases (transformers/models/qwen3/modeling_qwen3.py).

``attention_bias: true`` would give q/k/v biases in vLLM and Megatron but an o_proj bias as well in
transformers; alignaudit.inputs.capabilities refuses that combination for hf.
"""

from __future__ import annotations

from alignaudit.arch.dense import Architecture, Preset


def qwen3_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    tie_word_embeddings: bool,
    head_dim: int = 128,
    vocab_size: int = 151936,
    max_position_embeddings: int = 40960,
    bos_token_id: int | None = 151643,
    eos_token_id: int | None = 151645,
) -> dict:
    """A Qwen3ForCausalLM ``config.json`` as published on the Hub (rope_theta 1e6, eps 1e-6, bf16)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _preset(name: str, **shape) -> Preset:
    return Preset(name=name, hub_id=f"Qwen/{name}", config=qwen3_config(**shape))


ARCH = Architecture(
    name="Qwen3ForCausalLM",
    hf_prefix="Qwen3",
    qk_norm=True,
    qkv_bias=lambda config: bool(config.get("attention_bias", False)),
    presets=(
        _preset(
            "Qwen3-0.6B",
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            tie_word_embeddings=True,
        ),
        _preset(
            "Qwen3-1.7B",
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            tie_word_embeddings=True,
        ),
        _preset(
            "Qwen3-4B",
            hidden_size=2560,
            intermediate_size=9728,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            tie_word_embeddings=True,
        ),
        _preset(
            "Qwen3-8B",
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            tie_word_embeddings=False,
        ),
        _preset(
            "Qwen3-14B",
            hidden_size=5120,
            intermediate_size=17408,
            num_layers=40,
            num_heads=40,
            num_kv_heads=8,
            tie_word_embeddings=False,
        ),
        _preset(
            "Qwen3-32B",
            hidden_size=5120,
            intermediate_size=25600,
            num_layers=64,
            num_heads=64,
            num_kv_heads=8,
            tie_word_embeddings=False,
        ),
    ),
)
