"""GRPO's pieces on the loop's side, pure: verifiable toy rewards and group-normalized advantages (the loss the
trainer computes is alignaudit.training.losses).

Rewards (``REWARDS``), computed from a completion's token ids and the step alone (deterministic, verifiable,
no model), each between 0 and 1:
    rotating-hash  the mean over the completion's tokens of a score per token id in [0, 1) drawn from a table
                   that changes every ``ROTATION`` steps (SplitMix64 of the id and the period: Steele, Lea and
                   Flood 2014, "Fast splittable pseudorandom number generators"). Within a period the policy
                   climbs toward that period's high-scoring tokens; across periods the targets are unrelated,
                   so the reward keeps moving. It delays the collapse onto one completion, it does not prevent
                   it (fixture, lr 1e-3: first zero gradient at step 36 instead of 19); the KL term does
                   (``kl_k3``, alignaudit.training.losses). The default.
    token-hash     one fixed table: Knuth's multiplicative hash, (id * 2654435761 mod 2**32) / 2**32 (Knuth,
                   TAOCP vol. 3, 6.4). On random weights it collapses
                   the policy: Qwen3-1.7B shape, lr 1e-6, 8 prompts x 4 completions x 64 tokens, the
                   reward rose 0.50 -> 0.90 and from step 76 (strict) / 107 (default) every completion of a
                   group was the same, the advantages 0 and the gradient 0 (H200, 2026-12-01).
    even           the fraction of token ids that are even: satisfied fully by moving the mass to half of the
                   vocabulary (every completion scored 1.0 by step 3 at lr 1e-4, Qwen3-1.7B shape, H200).

Advantages (``group_advantages``): GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1.2): each of the G
completions of one prompt gets (r_i - mean(r)) / (std(r) + eps) over its group (population std, eps 1e-6);
a group whose rewards are all equal gets 0.
"""

from __future__ import annotations

import torch

ROTATION = 10  # steps per rotating-hash table
_MASK = (1 << 64) - 1


def token_score(token: int, period: int) -> float:
    """Score in [0, 1) of ``token`` in table ``period``: the top 53 bits of SplitMix64's output for the
    state token + (period + 1) * 0x9E3779B97F4A7C15 (mod 2**64)."""
    z = (token + (period + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) / 2**53


def rotating_hash_reward(completion: list[int], step: int) -> float:
    """Mean ``token_score`` of ``completion`` in the table of step ``step`` (1-based): table (step - 1) //
    ROTATION. 0 for an empty completion."""
    period = (step - 1) // ROTATION
    return sum(token_score(t, period) for t in completion) / len(completion) if completion else 0.0


def token_hash_reward(completion: list[int], step: int) -> float:
    """Mean of (id * 2654435761 mod 2**32) / 2**32 over ``completion``'s token ids, whatever the step (0 for
    an empty completion)."""
    return sum((t * 2654435761) % 2**32 for t in completion) / (2**32 * len(completion)) if completion else 0.0


def even_token_reward(completion: list[int], step: int) -> float:
    """Fraction of ``completion``'s token ids that are even (0 for an empty completion)."""
    return sum(1 for t in completion if t % 2 == 0) / len(completion) if completion else 0.0


REWARDS = {"rotating-hash": rotating_hash_reward, "token-hash": token_hash_reward, "even": even_token_reward}


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """GRPO advantages of rewards laid out as consecutive groups of ``group_size`` completions per prompt.

    Raises:
        ValueError: the number of rewards is not a multiple of the group size.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    mean, std = r.mean(dim=1, keepdim=True), r.std(dim=1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1).tolist()
