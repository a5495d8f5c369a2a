"""Llama 3.1 / 3.2 (LlamaForCausalLM): no biases, no QK-norm, "llama3" rope scaling, tied embeddings in
the 1B and 3B sizes (transformers/models/llama/modeling_llama.py).

llama3 rope scaling rescales the rotary frequencies once (Meta's llama-models reference, and
transformers' ``_compute_llama3_parameters``): with wavelength w = 2 pi / f of each frequency f,
    w < original / high_freq_factor   f unchanged
    w > original / low_freq_factor    f / factor
    otherwise                         (1 - s) f / factor + s f,  s = (original / w - low) / (high - low)
alignaudit_kernels.rope_tables computes that in float64 for the strict path. ``attention_bias`` and
``mlp_bias`` (biases on every projection in transformers' Llama) are refused (alignaudit.inputs.capabilities).
"""

from __future__ import annotations

from alignaudit.arch.dense import Architecture, Preset


def llama3_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    rope_factor: float,
    vocab_size: int = 128256,
    max_position_embeddings: int = 131072,
    bos_token_id: int | None = 128000,
    eos_token_id: int | None = 128001,
) -> dict:
    """A LlamaForCausalLM ``config.json`` as published on the Hub for Llama 3.1 / 3.2 base models
    (rope_theta 5e5 with llama3 scaling, eps 1e-5, bf16)."""
    return {
        "architectures": ["LlamaForCausalLM"],
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
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": rope_factor,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _preset(name: str, **shape) -> Preset:
    return Preset(name=name, hub_id=f"meta-llama/{name}", config=llama3_config(**shape))


ARCH = Architecture(
    name="LlamaForCausalLM",
    hf_prefix="Llama",
    qk_norm=False,
    qkv_bias=lambda config: bool(config.get("attention_bias", False)),
    rope_types=("default", "llama3"),
    refused=(
        (
            "attention_bias",
            "transformers and vLLM then add an o_proj bias as well, Megatron's add_qkv_bias "
            "does not: the engines would run different models",
        ),
        ("mlp_bias", "Megatron's SwiGLU MLP has no bias option that matches transformers' gate/up/down biases"),
    ),
    presets=(
        _preset(
            "Llama-3.2-1B",
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
            rope_factor=32.0,
        ),
        _preset(
            "Llama-3.2-3B",
            hidden_size=3072,
            intermediate_size=8192,
            num_layers=28,
            num_heads=24,
            num_kv_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            rope_factor=32.0,
        ),
        _preset(
            "Llama-3.1-8B",
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
            rope_factor=8.0,
        ),
    ),
)
