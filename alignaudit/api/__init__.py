"""alignaudit's Python API: what a user script or a training loop calls (docs/api.md).

    strict_megatron_model(model)   a Megatron-Core GPTModel with every op strict, weights from an HF checkpoint
    strict_hf_model(model)         a transformers model with the strict module swap
    token_logprobs(model, ...)     per-token logprobs of token ids under either model (the trainer's side)
    compare(model, ...)            a whole comparison, as ``alignaudit compare`` runs it -> Comparison
    rl(model, ..., reward=fn)      GRPO steps with the alignment checked at each, as ``alignaudit rl`` runs them,
                                   the reward a Python function if you like -> RLRun
    mismatch_metrics(train, rollout)    the metrics of one RL step's logprobs, as compare reports them
    verify_weight_sync(trainer, rollout)  the weights sent against what the rollout engine computes with -> WeightSync
    load_vllm_weights(llm, weights)       a weight sync into a running vLLM, its post-load repacking included
    vllm_weights(llm)                     the weights a running vLLM holds, in HF names
    verify_strict_vllm(llm)               that a running vLLM computes with the strict kernels, read back

Every argument either takes effect or raises alignaudit.errors.InputError (one line naming it and the fix)
before any engine starts; the checks are the CLI's own, from the typer-free request builder both call
(alignaudit.pipelines.requests).
"""

from __future__ import annotations

from alignaudit.api.metrics import mismatch_metrics
from alignaudit.api.models import strict_hf_model, strict_megatron_model, token_logprobs
from alignaudit.api.runs import Comparison, RLRun, compare, rl
from alignaudit.api.vllm_weights import (
    WeightSync,
    keep_vllm_weights,
    load_vllm_weights,
    verify_strict_vllm,
    verify_weight_sync,
    vllm_weights,
)

__all__ = [
    "Comparison",
    "RLRun",
    "WeightSync",
    "compare",
    "keep_vllm_weights",
    "load_vllm_weights",
    "mismatch_metrics",
    "rl",
    "strict_hf_model",
    "strict_megatron_model",
    "token_logprobs",
    "verify_strict_vllm",
    "verify_weight_sync",
    "vllm_weights",
]
