"""GRPO's pieces, pure: a verifiable toy reward, group-normalized advantages, the clipped policy loss.

Reward (``even_token_reward``): the fraction of a completion's tokens whose id is even. It is computed from
the token ids alone (deterministic, verifiable, no model), every completion earns between 0 and 1, and a
policy can raise it by moving probability mass to half of the vocabulary, which even the tiny fixture
does within tens of steps, so the reward curve moves.

Advantages (``group_advantages``): GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1.2): each of the G
completions of one prompt gets (r_i - mean(r)) / (std(r) + eps) over its group (population std, eps 1e-6);
a group whose rewards are all equal gets 0.

Loss (``clipped_policy_loss``): the PPO clipped surrogate (Schulman et al. 2017) per generated token, with
the importance ratio r = exp(lp_train - lp_rollout) of the trainer's logprobs (with gradient) against the
rollout engine's recorded logprobs, averaged over all generated tokens of the batch ("token-mean", as verl's
default loss_agg_mode); no KL penalty (beta = 0, as DAPO). On policy and aligned, r is exactly 1 and the
loss gradient is the plain policy gradient; any train/rollout mismatch shows up as r != 1 here first.
"""

from __future__ import annotations

import torch


def even_token_reward(completion: list[int]) -> float:
    """Fraction of ``completion``'s token ids that are even (0 for an empty completion)."""
    return sum(1 for t in completion if t % 2 == 0) / len(completion) if completion else 0.0


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


def clipped_policy_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                        clip_eps: float) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate over generated tokens.

    Args:
        logprobs: fp32 [T], the trainer's logprobs of the T generated tokens of the batch (with gradient).
        rollout_logprobs: fp32 [T], the rollout engine's logprobs of the same tokens.
        advantages: fp32 [T], each token's completion advantage.
        clip_eps: PPO epsilon (the ratio is clipped to [1 - eps, 1 + eps]).
    Returns:
        (scalar loss, {"clip_fraction": fraction of tokens where the clipped term was taken}).
    """
    ratio = torch.exp(logprobs - rollout_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped).mean()
    taken = (clipped < unclipped).float().mean()
    return loss, {"clip_fraction": float(taken)}
