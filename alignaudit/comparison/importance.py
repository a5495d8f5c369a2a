"""Importance-sampling (IS) diagnostics of a train/rollout logprob pair, as RL frameworks compute them. Pure.

Per generated token t of sequence i, with lp_train the trainer's recompute (old_logprobs) and lp_infer the rollout
engine's logprob, d = lp_train - lp_infer (float64) and the token ratio r = exp(d) = pi_train / pi_rollout.
Per sequence: s_i = sum_t d (the log of the product ratio R_i = prod_t r = exp(s_i)) and the geometric mean
g_i = exp(mean_t d). The three levels, the corrections applied at each, and what this module reports of them:

    token TIS      w = min(r, C): mean, fraction of tokens with r > C (r < 1/C), of sequences holding one, ESS
    sequence TIS   W_i = min(R_i, C): the same, over sequences (and the tokens they hold)
    token mask     IcePop: r outside [low, high] zeroed: fraction of tokens, of sequences holding one
    sequence mask  R_i outside [low, high]: fraction of sequences, of their tokens
    geometric mask g_i outside [geo_low, geo_high] (NeMo-RL seq-mask-tis, verl Geo-RS): sequences, tokens
    KL             k1 = mean(lp_infer - lp_train), k3 = mean(r - 1 - d), both estimating KL(rollout || train)
                   from rollout samples; k3 of KL(train || rollout) = mean(1/r - 1 + d); chi^2 token and sequence
    perplexity     log-perplexity per sequence -mean_t lp, averaged over sequences, each side, and their difference

Sources (read 2026-12-02; docs/rl-metrics.md maps every number to the frameworks' metric names):
    verl  verl/trainer/ppo/rollout_corr_helper.py (verl-project/verl 1dda039): compute_rollout_correction_weights,
          compute_is_metrics (rollout_is_mean/max/min, rollout_is_ratio_fraction_high/low, rollout_is_seq_*,
          rollout_is_eff_sample_size), compute_rollout_rejection_mask (rollout_rs_*_masked_fraction,
          rollout_rs_*_seq_masked_fraction), compute_offpolicy_metrics (kl, k3_kl, training_log_ppl,
          rollout_log_ppl, log_ppl_diff, chi2_token, chi2_seq); verl/trainer/config/algorithm.py
          (RolloutCorrectionConfig: rollout_is_threshold 2.0, presets 0.5_5.0 IcePop and 0.999_1.001 Geo-RS).
    NeMo-RL  nemo_rl/algorithms/loss/loss_functions.py (NVIDIA-NeMo/RL 7ea279a): ClippedPGLossFn,
          truncated_importance_sampling_type "tis" | "icepop" | "seq-mask-tis" with
          truncated_importance_sampling_ratio(_min), is_oob_ratio, token_mult_prob_error, gen_kl_error,
          policy_kl_error, sampling_importance_ratio; nemo_rl/algorithms/utils.py calculate_kl.

Differences from the frameworks, on purpose: ESS is mean(w)^2 / mean(w^2) (verl adds 1e-8 to the mean, so its
ESS of all-equal weights is 1 - 2e-8, ours exactly 1); verl's k1 rejection compares -log r, the log of the
*inverse* ratio, with its bounds (identical to ours for bounds with low = 1/high); k3 is computed as
expm1(d) - d, the frameworks' exp(d) - 1 - d without its cancellation (at |d| = 1e-8 that form is rounding
noise). Like verl, weights exponentiate the log ratio clamped to [-20, 20] (its SAFETY_BOUND); fractions at
sequence level compare in log space, as verl does. Tokens whose logprob is NaN or infinite on either side are
left out (``tokens`` counts those used).
"""

from __future__ import annotations

import math

import numpy as np

from alignaudit.errors import InputError
from alignaudit.inputs.request import ISThresholds

SAFETY_BOUND = 20.0  # verl's clamp of the log ratio before exp (rollout_corr_helper.SAFETY_BOUND)

FIELDS = (
    "token_ratio_mean",
    "token_ratio_min",
    "token_ratio_max",
    "token_tis_weight_mean",
    "token_tis_fraction",
    "token_tis_fraction_low",
    "token_tis_seq_fraction",
    "token_ess",
    "token_mask_fraction",
    "token_mask_seq_fraction",
    "seq_ratio_min",
    "seq_ratio_max",
    "seq_tis_weight_mean",
    "seq_tis_fraction",
    "seq_tis_fraction_low",
    "seq_tis_token_fraction",
    "seq_ess",
    "seq_mask_fraction",
    "seq_mask_token_fraction",
    "geo_ratio_min",
    "geo_ratio_max",
    "geo_mask_fraction",
    "geo_mask_token_fraction",
    "kl_k1",
    "kl_k3",
    "kl_k3_train_rollout",
    "chi2_token",
    "chi2_seq",
    "training_log_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
)


def importance_diagnostics(seq, lp_train, lp_infer, thresholds: ISThresholds | None = None) -> dict:
    """IS diagnostics of per-token logprobs grouped by sequence (see the module docstring for every formula).

    Args:
        seq: [tokens] integer sequence ids (any order; tokens of one sequence need not be adjacent).
        lp_train, lp_infer: [tokens] logprobs (nats, any float dtype; computed in float64) of the trainer and of
            the rollout engine for the same tokens.
        thresholds: C, the token/sequence mask range and the geometric mask range (default ISThresholds()).

    Returns:
        {"tokens", "sequences" (counts used), the thresholds, and every name in FIELDS}: Python floats; fractions
        in [0, 1]; ratios dimensionless; KL and log-perplexities in nats. With no finite token, the FIELDS are None.

    Raises:
        InputError: arrays not 1-D or of different lengths, non-integer sequence ids, thresholds invalid.
    """
    th = (thresholds or ISThresholds()).check()
    seq, lt, li = np.asarray(seq), np.asarray(lp_train, dtype=np.float64), np.asarray(lp_infer, dtype=np.float64)
    if not (seq.ndim == lt.ndim == li.ndim == 1 and len(seq) == len(lt) == len(li)):
        raise InputError(
            f"importance diagnostics need three 1-D arrays of one length, got shapes {seq.shape}, "
            f"{lt.shape}, {li.shape}"
        )
    if len(seq) and not np.issubdtype(seq.dtype, np.integer):
        raise InputError(f"sequence ids must be integers, got {seq.dtype}")
    finite = np.isfinite(lt) & np.isfinite(li)
    seq, lt, li = seq[finite], lt[finite], li[finite]
    record = {
        "tokens": int(len(seq)),
        "sequences": int(len(np.unique(seq))),
        "tis_threshold": float(th.tis),
        "mask_low": float(th.mask_low),
        "mask_high": float(th.mask_high),
        "geo_mask_low": float(th.geo_mask_low),
        "geo_mask_high": float(th.geo_mask_high),
    }
    if len(seq) == 0:
        return {**record, **dict.fromkeys(FIELDS)}
    _, inv, count = np.unique(seq, return_inverse=True, return_counts=True)
    n = len(seq)

    def per_seq(x: np.ndarray) -> np.ndarray:  # sum over each sequence's tokens
        return np.bincount(inv, weights=x.astype(np.float64), minlength=len(count))

    def seq_any(x: np.ndarray) -> np.ndarray:
        return per_seq(x) > 0

    def token_share(seq_flag: np.ndarray) -> float:  # fraction of tokens in the flagged sequences
        return float(count[seq_flag].sum() / n)

    d = lt - li
    with np.errstate(over="ignore"):
        r = np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND))
        c = th.tis
        # token level (verl rollout_is="token"; NeMo-RL "tis" with ratio_min 0, "icepop")
        w = np.minimum(r, c)
        above, below = r > c, r < 1.0 / c
        kept = (r >= th.mask_low) & (r <= th.mask_high)
        # sequence level, product form (verl rollout_is="sequence"; NeMo-RL sequence_level_importance_ratios)
        s = per_seq(d)
        s_safe = np.clip(s, -SAFETY_BOUND, SAFETY_BOUND)
        big_r = np.exp(s_safe)
        big_w = np.minimum(big_r, c)
        seq_above, seq_below = s > math.log(c), s < math.log(1.0 / c)
        seq_kept = (big_r >= th.mask_low) & (big_r <= th.mask_high)
        # geometric mean per sequence (NeMo-RL seq-mask-tis; verl seq_mean_k1)
        geo = np.exp(s / count)
        geo_kept = (geo >= th.geo_mask_low) & (geo <= th.geo_mask_high)
        token_w_big = big_w[inv]  # verl broadcasts the sequence weight to its tokens and averages over tokens
        mean_lt, mean_li = per_seq(lt) / count, per_seq(li) / count
        values = {
            "token_ratio_mean": np.mean(r),
            "token_ratio_min": np.min(r),
            "token_ratio_max": np.max(r),
            "token_tis_weight_mean": np.mean(w),
            "token_tis_fraction": np.mean(above),
            "token_tis_fraction_low": np.mean(below),
            "token_tis_seq_fraction": np.mean(seq_any(above)),
            "token_ess": effective_sample_size(w),
            "token_mask_fraction": np.mean(~kept),
            "token_mask_seq_fraction": np.mean(seq_any(~kept)),
            "seq_ratio_min": np.exp(np.min(s)),
            "seq_ratio_max": np.exp(min(np.max(s), SAFETY_BOUND)),
            "seq_tis_weight_mean": np.mean(token_w_big),
            "seq_tis_fraction": np.mean(seq_above),
            "seq_tis_fraction_low": np.mean(seq_below),
            "seq_tis_token_fraction": token_share(seq_above),
            "seq_ess": effective_sample_size(token_w_big),
            "seq_mask_fraction": np.mean(~seq_kept),
            "seq_mask_token_fraction": token_share(~seq_kept),
            "geo_ratio_min": np.min(geo),
            "geo_ratio_max": np.max(geo),
            "geo_mask_fraction": np.mean(~geo_kept),
            "geo_mask_token_fraction": token_share(~geo_kept),
            "kl_k1": np.mean(li - lt),
            "kl_k3": np.mean(np.expm1(d) - d),
            "kl_k3_train_rollout": np.mean(np.expm1(-d) + d),
            "chi2_token": np.mean(r * r) - 1.0,
            "chi2_seq": np.mean(np.exp(2.0 * s_safe)) - 1.0,
            "training_log_ppl": np.mean(-mean_lt),
            "rollout_log_ppl": np.mean(-mean_li),
            "log_ppl_diff": np.mean(mean_li - mean_lt),
        }
    return {**record, **{k: _number(values[k]) for k in FIELDS}}


def effective_sample_size(weights: np.ndarray) -> float | None:
    """Kish's effective sample size as a fraction of the sample, mean(w)^2 / mean(w^2), in (0, 1] for weights >= 0
    not all 0 (1: all equal). verl's rollout_is_eff_sample_size is 1 / mean((w / (mean(w) + 1e-8))^2), the same
    up to its 1e-8. None for no weights or all zero."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0:
        return None
    second = np.mean(w * w)
    return float(np.mean(w) ** 2 / second) if second > 0 else None


def summarize_importance(tokens, thresholds: ISThresholds | None = None) -> dict:
    """``importance_diagnostics`` of a compare_tokens table (columns seq, lp_train, lp_infer, optional generated):
    over the generated tokens when the table has any (the tokens an RL loss sees), else over all its tokens;
    ``scope`` says which."""
    scope = "all"
    if "generated" in tokens and tokens["generated"].any():
        tokens, scope = tokens[tokens["generated"].to_numpy(dtype=bool)], "generated"
    out = importance_diagnostics(
        tokens["seq"].to_numpy(), tokens["lp_train"].to_numpy(), tokens["lp_infer"].to_numpy(), thresholds
    )
    return {"scope": scope, **out}


def _number(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None
