"""What every engine adapter implements of a checkpoint, and what a mixture-of-experts model cannot run yet:
consulted before any engine starts, so a setting takes effect or is refused.

    CHECKPOINT_FEATURES  config.json fields that change the math, and the values every engine implements
    ENGINE_FEATURES      features some engines implement and others implement with other math
    MOE_REFUSED          what alignaudit does not run for MoE models yet, and why
Each raises InputError with one line naming the setting, the reason and the fix. The rules of one engine
(its options, its tensor-parallel sizes) sit in that engine's folder (alignaudit.engines.<name>), and
alignaudit.engines.checks applies them to a comparison's two engines. docs/cli.md lists the same tables.
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
    Feature(
        "rope_scaling",
        lambda v: not v or (isinstance(v, dict) and v.get("rope_type", v.get("type")) in ("default", "llama3")),
        "plain RoPE, or llama3 rope scaling on Llama (alignaudit.arch)",
    ),
    Feature("mlp_bias", lambda v: not v, "MLPs without bias (mlp_bias false)"),
)


# Features some engine adapters implement and others implement differently: (name, whether a spec has it,
# engines that implement the checkpoint's meaning, why the others do not).
ENGINE_FEATURES: tuple[tuple[str, Callable[[Any], bool], frozenset[str], str], ...] = (
    (
        "attention_bias",
        lambda spec: spec.architecture == "Qwen3ForCausalLM" and spec.attention_bias,
        frozenset({"megatron", "vllm"}),
        "transformers' Qwen3 adds a bias to o_proj as well when attention_bias is true (modeling_qwen3.py), vLLM's "
        "and Megatron's Qwen3 put biases on q/k/v only: the engines would run different models",
    ),
    (
        "rope_scaling",
        lambda spec: bool(spec.rope_llama3) and tuple(spec.rope_llama3[1:]) != (1.0, 4.0, 8192),
        frozenset({"hf", "vllm"}),
        "Megatron's llama3 rope scaling fixes low_freq_factor 1, high_freq_factor 4 and "
        "original_max_position_embeddings 8192 (megatron/core/models/common/embeddings/rotary_pos_embedding.py); this "
        "checkpoint sets others",
    ),
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
                    raise InputError(
                        f"{spec.name}: {attribute} is not supported with {engine}: {why}; compare "
                        f"{' and '.join(sorted(implemented))}"
                    )


# What alignaudit does not run for mixture-of-experts models yet (alignaudit.arch.qwen3_moe), and why.
MOE_REFUSED: dict[str, str] = {
    "alignaudit rl": "the weight sync maps dense MLPs only; run rl on a dense model",
    "tensor parallelism": "expert weights are not sharded by alignaudit; run MoE models at tensor parallel size 1",
}


def refuse_moe(spec, what: str, fix: str = "") -> None:
    """Refuse ``what`` (a MOE_REFUSED key) for a mixture-of-experts model. Raises InputError with the reason
    and, where given, ``fix`` (appended after a semicolon)."""
    if spec.num_experts:
        raise InputError(
            f"{what} for {spec.architecture} ({spec.name}) is not implemented: {MOE_REFUSED[what]}"
            + (f"; {fix}" if fix else "")
        )


def check_checkpoint_config(config: dict, source: str) -> None:
    """Refuse a config.json whose math some engine adapter does not implement.

    Raises:
        InputError: naming the field, its value and what is supported.
    """
    for feature in CHECKPOINT_FEATURES:
        value = config.get(feature.field)
        if not feature.supported(value):
            raise InputError(
                f"{source}: {feature.field}={value!r} is not implemented by every engine adapter; "
                f"alignaudit supports {feature.describe}"
            )
