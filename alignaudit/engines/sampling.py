"""The trainer's replay of the rollout's sampling transform: temperature, then top-k, then top-p.

RL trainers score the rollout's tokens under the distribution the rollout sampled from: verl and NeMo-RL
divide the logits by the rollout temperature before the log-softmax, and some apply the same top-k/top-p
truncation. vLLM's ``processed_logprobs`` are that distribution's logprobs, so a trainer that replays it
computes the same quantity. The order and arithmetic follow vLLM 0.32 (CPU path):
    temperature  logits.float() / T, one IEEE fp32 division per element (vllm/v1/sample/sampler.py,
                 Sampler.apply_temperature)
    top-k        logits below the k-th largest value set to -inf; ties at the k-th value are kept
                 (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_only)
    top-p        ascending sort, softmax, cumulative sum; entries whose cumulative probability is
                 <= 1 - p set to -inf, the largest always kept (apply_top_k_top_p_pytorch)
Top-p's boundary depends on how the softmax and the cumulative sum round: where a token sits exactly at
the boundary, an engine that rounds differently can keep a different set.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling transform of ``logits`` [..., V] (any float dtype), in fp32.

    Returns:
        fp32 tensor of the same shape: logits / temperature with the truncated entries at -inf.
    Raises:
        ValueError: temperature <= 0, top_k < 0, or top_p outside (0, 1].
    """
    if not temperature > 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"bad sampling transform: temperature={temperature}, top_k={top_k}, top_p={top_p}")
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        order = x.sort(dim=-1, descending=False)
        cumulative = order.values.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False  # at least one token
        x = x.scatter(-1, order.indices, order.values.masked_fill(drop, float("-inf")))
    return x


def generated_rows(prompt_length: int, length: int) -> slice:
    """Rows of a sequence's next-token logits ([length - 1, V]) that predict generated tokens: position
    t's logits predict token t + 1, so rows prompt_length - 1 .. length - 2."""
    return slice(prompt_length - 1, length - 1)
