"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): q/k/v biases, no QK-norm, tied embeddings in the small sizes
(transformers/models/qwen2/modeling_qwen2.py: q/k/v_proj with bias=True, o_proj without). Sliding-window
attention is off in every released config (use_sliding_window false); alignaudit.inputs.capabilities refuses a
config that turns it on.
"""

from __future__ import annotations

from alignaudit.arch.dense import Architecture, Preset


def qwen2_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    max_window_layers: int,
    vocab_size: int = 151936,
    bos_token_id: int | None = 151643,
    eos_token_id: int | None = 151643,
) -> dict:
    """A Qwen2ForCausalLM ``config.json`` as published on the Hub for the Qwen2.5 base models (rope_theta
    1e6, eps 1e-6, bf16; head_dim = hidden_size / heads)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": max_window_layers,
        "model_type": "qwen2",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _preset(name: str, **shape) -> Preset:
    return Preset(name=name, hub_id=f"Qwen/{name}", config=qwen2_config(**shape))


ARCH = Architecture(
    name="Qwen2ForCausalLM",
    hf_prefix="Qwen2",
    qk_norm=False,
    qkv_bias=lambda config: True,
    presets=(
        _preset(
            "Qwen2.5-0.5B",
            hidden_size=896,
            intermediate_size=4864,
            num_layers=24,
            num_heads=14,
            num_kv_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            max_window_layers=24,
        ),
        _preset(
            "Qwen2.5-1.5B",
            hidden_size=1536,
            intermediate_size=8960,
            num_layers=28,
            num_heads=12,
            num_kv_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            max_window_layers=21,
        ),
        _preset(
            "Qwen2.5-7B",
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            tie_word_embeddings=False,
            max_position_embeddings=131072,
            max_window_layers=28,
            vocab_size=152064,
        ),
    ),
)
