"""Per-token logprob comparison of two captures and its summary. Pure: tables in, records out.

Sides are called ``train`` and ``infer`` because the RL quantities are defined that way: the importance
ratio is exp(lp_train - lp_infer), the rollout (inference) policy being the one tokens were sampled from.
For ``alignaudit diff A B``, A plays train and B plays infer.

RL impact metrics, for d = lp_train - lp_infer per token (computed in float64):
    importance ratio         r = exp(d), min and max
    clip fraction            fraction of tokens with r outside [1 - eps, 1 + eps] (PPO, Schulman et al. 2017)
    token_mult_prob_error    mean(exp(|d|)) (NeMo-RL, nemo_rl/algorithms/loss_functions.py)
    prob diff                |exp(lp_train) - exp(lp_infer)| max and mean (verl's rollout_probs_diff)
    KL (k3)                  mean(r - 1 - d), an unbiased, non-negative estimate of KL(infer || train)
                             from rollout samples (J. Schulman, "Approximating KL Divergence", 2020)
    mean signed diff         mean(d): a bias indicator (the other metrics are symmetric in sign)
NaN and Inf logprobs are counted per side (``nan_tokens``, ``inf_tokens``), never averaged in; so are values above
0, +inf included (``positive_tokens``): no log-probability is positive, so such a value is an engine's or a file's
error, which the gate never counts as aligned however equal its bits.
Importance-sampling diagnostics (truncated and masked IS at token, sequence and geometric level, ESS, KL, log-
perplexity) under ``importance``, with the thresholds they used: alignaudit.comparison.importance.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from alignaudit import numerics
from alignaudit.comparison.importance import summarize_importance
from alignaudit.comparison.summary import SideCounts, Summary, TokenSummary
from alignaudit.errors import InputError
from alignaudit.inputs.request import ISThresholds

ULP_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 3, "2-3"), (4, 15, "4-15"), (16, 255, "16-255"), (256, None, ">=256"))


def align_tokens(train: pd.DataFrame, infer: pd.DataFrame) -> pd.DataFrame:
    """Join two logprob tables (capture format 2) on (seq, pos); scored rows only (pos 0 has no logprob; against
    a rollout file's capture, which scores the sampled tokens only, those). NaN and Inf logprobs are kept: they are
    the engines' values.

    Raises:
        InputError: the tables do not hold the same sequences of token ids.
    """
    keys = ["seq", "pos"]
    a = train.sort_values(keys).reset_index(drop=True)
    b = infer.sort_values(keys).reset_index(drop=True)
    if len(a) != len(b) or not (a[keys + ["token_id"]].to_numpy() == b[keys + ["token_id"]].to_numpy()).all():
        raise InputError("the two captures were made on different token ids; capture both from the same prompts")
    scored_a, scored_b = a["scored"].to_numpy(dtype=bool), b["scored"].to_numpy(dtype=bool)
    generated = np.zeros(len(a), dtype=bool)
    for side in (a, b):
        if "generated" in side:
            generated |= side["generated"].to_numpy(dtype=bool)
    scored = scored_a & scored_b
    if not (scored_a == scored_b).all() and not any(
        _sampled_only(x, y, generated) for x, y in ((scored_a, scored_b), (scored_b, scored_a))
    ):
        raise InputError("the two captures disagree on which positions have a logprob; capture both again")
    return pd.DataFrame(
        {
            "seq": a["seq"].to_numpy()[scored],
            "pos": a["pos"].to_numpy()[scored],
            "token_id": a["token_id"].to_numpy()[scored],
            "generated": generated[scored],
            "lp_train": a["logprob"].to_numpy(dtype=np.float32)[scored],
            "lp_infer": b["logprob"].to_numpy(dtype=np.float32)[scored],
        }
    )


def _sampled_only(scored: np.ndarray, other: np.ndarray, generated: np.ndarray) -> bool:
    """Whether one side scores exactly the sampled tokens (a rollout file's capture) and the other scores at least
    those: then the comparison covers the sampled tokens, the only ones both have."""
    return bool(generated.any() and np.array_equal(scored, generated) and other[scored].all())


def compare_tokens(tokens: pd.DataFrame) -> pd.DataFrame:
    """Add per-token comparison columns to the output of ``align_tokens``.

    Columns added: ``diff`` (float64, lp_train - lp_infer), ``bitwise_equal`` (bool, fp32 bit patterns),
    ``ulp`` (int64, fp32 ULP distance, -1 for NaN/Inf mismatches), ``pair_class`` (int8, numerics.PairClass).
    """
    a = torch.from_numpy(tokens["lp_train"].to_numpy(dtype=np.float32).copy())
    b = torch.from_numpy(tokens["lp_infer"].to_numpy(dtype=np.float32).copy())
    out = tokens.copy()
    out["diff"] = a.double().numpy() - b.double().numpy()
    out["bitwise_equal"] = numerics.bitwise_equal(a, b).numpy()
    out["ulp"] = numerics.ulp_distance(a, b).numpy()
    out["pair_class"] = numerics.classify(a, b).numpy()
    return out


WORST_SEQUENCES = 20


def summarize(
    tokens: pd.DataFrame,
    clip_eps: float = 0.2,
    sequences: pd.DataFrame | None = None,
    importance: ISThresholds | None = None,
) -> Summary:
    """Summary record (alignaudit.comparison.summary.Summary) of a ``compare_tokens`` table: counts, ULP
    distribution, RL impact, IS diagnostics at ``importance``'s thresholds, and the ``WORST_SEQUENCES`` worst sequences
    (``sequences``, the ``per_sequence`` table, has them all); with rollout tokens, the same record for the generated
    tokens alone under ``generated``; with full-vocabulary columns (alignaudit.comparison.vocab.vocab_columns), their
    record under ``vocab``."""
    summary: Summary = {**summarize_tokens(tokens, clip_eps, importance)}
    sequences = per_sequence(tokens) if sequences is None else sequences
    summary["worst_sequences"] = _records(worst_sequences(sequences, WORST_SEQUENCES))
    if "generated" in tokens and tokens["generated"].any():
        summary["generated"] = summarize_tokens(tokens[tokens["generated"]], clip_eps, importance)
    if "vocab_tv" in tokens:  # compare --full-vocab: the columns of alignaudit.comparison.vocab
        from alignaudit.comparison.vocab import summarize_vocab

        summary["vocab"] = summarize_vocab(tokens)
    return summary


def summarize_tokens(tokens: pd.DataFrame, clip_eps: float, importance: ISThresholds | None = None) -> TokenSummary:
    """Counts, ULP distribution, NaN/Inf counts, RL impact and (``importance``: importance.summarize_importance at
    these thresholds, default ISThresholds()) IS diagnostics of a ``compare_tokens`` table (no per-sequence
    view). Raises InputError for an empty table or invalid thresholds."""
    n = len(tokens)
    if n == 0:
        raise InputError("no tokens to compare (every sequence needs at least 2 tokens)")
    mismatch = ~tokens["bitwise_equal"].to_numpy()
    cls = tokens["pair_class"].to_numpy()
    finite = cls <= numerics.PairClass.FINITE_DIFF
    ulp = tokens["ulp"].to_numpy()[finite]
    d = tokens["diff"].to_numpy()[finite]
    lp_t = tokens["lp_train"].to_numpy(dtype=np.float64)[finite]
    lp_i = tokens["lp_infer"].to_numpy(dtype=np.float64)[finite]
    ratio = np.exp(d)
    prob_diff = np.abs(np.exp(lp_t) - np.exp(lp_i))
    return {
        "tokens_compared": n,
        "sequences": int(tokens["seq"].nunique()),
        "mismatches": int(mismatch.sum()),
        "mismatch_fraction": float(mismatch.mean()),
        "nan_mismatches": int((cls == numerics.PairClass.NAN_MISMATCH).sum()),
        "inf_mismatches": int((cls == numerics.PairClass.INF_MISMATCH).sum()),
        "nan_tokens": _special_counts(tokens, np.isnan),
        "inf_tokens": _special_counts(tokens, np.isinf),
        "positive_tokens": _special_counts(tokens, lambda lp: lp > 0),
        "max_abs_diff": _max(np.abs(d)),
        "mean_abs_diff": _mean(np.abs(d)),
        "mean_diff": _mean(d),
        "ulp_max": int(ulp.max()) if len(ulp) else None,
        "ulp_median": float(np.median(ulp)) if len(ulp) else None,
        "ulp_p99": float(np.percentile(ulp, 99)) if len(ulp) else None,
        "ulp_histogram": ulp_histogram(ulp),
        "rl": {
            "clip_eps": clip_eps,
            "ratio_min": _min(ratio),
            "ratio_max": _max(ratio),
            "clip_fraction": _mean((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)),
            "token_mult_prob_error": _mean(np.exp(np.abs(d))),
            "prob_diff_max": _max(prob_diff),
            "prob_diff_mean": _mean(prob_diff),
            "kl_k3_mean": _mean(ratio - 1.0 - d),
        },
        "importance": summarize_importance(tokens, importance),
    }


def ulp_histogram(ulp: np.ndarray) -> dict[str, int]:
    """Counts of ULP distances in the ULP_BUCKETS ranges (inclusive)."""
    hist = {}
    for lo, hi, label in ULP_BUCKETS:
        inside = (ulp >= lo) & (ulp <= hi) if hi is not None else ulp >= lo
        hist[label] = int(inside.sum())
    return hist


def _special_counts(tokens: pd.DataFrame, test) -> SideCounts:
    """Tokens whose logprob passes ``test`` (NaN, Inf, > 0) on the train side, the infer side, and both."""
    t, i = test(tokens["lp_train"].to_numpy()), test(tokens["lp_infer"].to_numpy())
    return {"train": int(t.sum()), "infer": int(i.sum()), "both": int((t & i).sum())}


def per_sequence(tokens: pd.DataFrame) -> pd.DataFrame:
    """One row per sequence: seq, tokens, mismatches, first_mismatch_pos (-1 if all equal), nan_tokens (NaN
    on either side), ulp_max (-1 if no finite pair differs or matches), max_abs_diff (NaN if none finite).
    Vectorized: 10,000 sequences take milliseconds."""
    seq = tokens["seq"].to_numpy()
    bad = ~tokens["bitwise_equal"].to_numpy(dtype=bool)
    ulp = tokens["ulp"].to_numpy()
    frame = pd.DataFrame(
        {
            "seq": seq,
            "mismatch": bad,
            "bad_pos": np.where(bad, tokens["pos"].to_numpy(), np.iinfo(np.int32).max),
            "nan": np.isnan(tokens["lp_train"].to_numpy()) | np.isnan(tokens["lp_infer"].to_numpy()),
            "ulp": np.where(ulp >= 0, ulp, -1),
            "absdiff": np.where(ulp >= 0, np.abs(tokens["diff"].to_numpy()), np.nan),
        }
    )
    g = frame.groupby("seq", sort=True)
    out = pd.DataFrame(
        {
            "tokens": g.size(),
            "mismatches": g["mismatch"].sum().astype(np.int64),
            "first_mismatch_pos": g["bad_pos"].min(),
            "nan_tokens": g["nan"].sum().astype(np.int64),
            "ulp_max": g["ulp"].max().astype(np.int64),
            "max_abs_diff": g["absdiff"].max(),
        }
    ).reset_index()
    out.loc[out["mismatches"] == 0, "first_mismatch_pos"] = -1
    return out


def _records(table: pd.DataFrame) -> list[dict]:
    """Rows as JSON-ready dicts (numpy scalars to Python, NaN to None)."""
    return [
        {
            k: (None if isinstance(v, float) and np.isnan(v) else v.item() if hasattr(v, "item") else v)
            for k, v in row.items()
        }
        for row in table.to_dict("records")
    ]


def worst_sequences(table: pd.DataFrame, count: int) -> pd.DataFrame:
    """The ``count`` worst rows of a ``per_sequence`` table: NaN first, then most mismatches, largest ULP."""
    order = table.sort_values(["nan_tokens", "mismatches", "ulp_max", "seq"], ascending=[False, False, False, True])
    return order.head(count).reset_index(drop=True)


def _finite(x: np.ndarray) -> np.ndarray:
    return x[np.isfinite(x)]


def _max(x: np.ndarray) -> float | None:
    x = _finite(x)
    return float(x.max()) if len(x) else None


def _min(x: np.ndarray) -> float | None:
    x = _finite(x)
    return float(x.min()) if len(x) else None


def _mean(x: np.ndarray) -> float | None:
    x = _finite(x.astype(np.float64))
    return float(x.mean()) if len(x) else None


def is_bitwise_identical(summary: dict) -> bool:
    return summary["mismatches"] == 0 and summary["tokens_compared"] > 0
