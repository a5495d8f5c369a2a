"""What a strict vLLM must compute with, read back from its layers (alignaudit.engines.vllm.weights): the check
alignaudit's own vLLM engine and StrictGRPOTrainer (TRL's colocated vLLM) both run once the model is built."""

from __future__ import annotations

import pytest

from alignaudit.engines.vllm.weights import check_strict_kernels
from alignaudit.errors import EngineError

STRICT = {
    "attention_impls": {"StrictCPUAttentionImpl": "portable"},
    "linear_methods": ["UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"],
    "strict_ops": ["attention", "linear", "logprobs", "rmsnorm", "rope", "silu"],
}


def test_strict_layers_pass_and_others_name_what_computes():
    check_strict_kernels(STRICT, frozenset({"attention", "linear"}))
    stock = {**STRICT, "attention_impls": {"FlashAttentionImpl": None, "StrictFlashAttentionImpl": "portable"}}
    with pytest.raises(EngineError, match="computes attention with FlashAttentionImpl:"):
        check_strict_kernels(stock, frozenset({"attention"}))
    check_strict_kernels(stock, frozenset({"linear", "rmsnorm"}))  # attention not asked for: its backend is vLLM's
    fp8 = {**STRICT, "linear_methods": ["Fp8LinearMethod", "UnquantizedEmbeddingMethod"]}
    with pytest.raises(EngineError, match="computes products with Fp8LinearMethod, "):
        check_strict_kernels(fp8, frozenset({"linear"}))
    check_strict_kernels(fp8, frozenset({"attention"}))


def test_ops_not_applied_when_the_model_was_built_are_named():
    partial = {**STRICT, "strict_ops": ["attention", "linear"]}
    check_strict_kernels(partial, frozenset({"attention"}))
    with pytest.raises(EngineError, match="not applied when vLLM built this model: logprobs, rmsnorm; set"):
        check_strict_kernels(partial, frozenset({"attention", "rmsnorm", "logprobs"}))
