"""The GRPO loss the trainer computes, inside its worker (alignaudit.training.trainer).

Loss (``clipped_policy_loss``): the PPO clipped surrogate (Schulman et al. 2017) per generated token, with
the importance ratio r = exp(lp_train - lp_rollout) of the trainer's logprobs (with gradient) against the
rollout engine's recorded logprobs, averaged over all generated tokens of the batch ("token-mean", as verl's
default loss_agg_mode); no KL penalty by default (beta = 0, as DAPO); with beta > 0 the trainer adds beta times
the mean ``kl_k3`` to the starting weights (GRPO's own form). On policy and aligned, r is exactly 1 and the
loss gradient is the plain policy gradient; any train/rollout mismatch shows up as r != 1 here first.
"""

from __future__ import annotations

import torch


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) on tokens sampled from the policy: exp(r) - r - 1 with
    r = lp_ref - lp (Schulman 2020, "Approximating KL divergence"; GRPO's KL term, Shao et al. 2024 eq. 4;
    verl's ``low_var_kl``). fp32 [T] in, [T] out, >= 0, differentiable in ``logprobs``. Its gradient is
    non-zero wherever the policy's logprob differs from the reference's, also when every completion of a
    group got the same reward, which is what keeps a long run from stalling once the policy has collapsed."""
    r = reference_logprobs - logprobs
    return torch.exp(r) - r - 1


def clipped_policy_loss(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, dict]:
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
