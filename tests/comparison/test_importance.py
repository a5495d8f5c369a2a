"""Importance-sampling diagnostics (alignaudit.comparison.importance) on hand-made logprobs.

Expected values are computed here from the definitions (verl rollout_corr_helper.py, NeMo-RL loss_functions.py)
with ``math`` on the ratios chosen, not with the module's numpy path: two sequences whose token ratios are
r = (3, 1/4) and (1, 3/2, 4/5), so the product ratios are R = (3/4, 6/5) and the geometric means (3/4)^(1/2) and
(6/5)^(1/3).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alignaudit.comparison.importance import FIELDS, effective_sample_size, importance_diagnostics
from alignaudit.comparison.token_diff import compare_tokens, summarize, summarize_tokens
from alignaudit.errors import InputError
from alignaudit.inputs.request import ISThresholds

RATIOS = [3.0, 0.25, 1.0, 1.5, 0.8]
SEQ = np.array([0, 0, 1, 1, 1])
LP_INFER = np.full(5, -1.0)
LP_TRAIN = LP_INFER + np.log(RATIOS)


def diag(**thresholds) -> dict:
    return importance_diagnostics(SEQ, LP_TRAIN, LP_INFER, ISThresholds(**thresholds))


def test_token_level_truncation_masking_and_ess_by_hand():
    out = diag()  # C 2, mask [0.5, 5]
    assert out["tokens"] == 5 and out["sequences"] == 2
    assert out["tis_threshold"] == 2.0 and (out["mask_low"], out["mask_high"]) == (0.5, 5.0)
    w = [min(r, 2.0) for r in RATIOS]  # 2, 1/4, 1, 3/2, 4/5
    assert out["token_ratio_mean"] == pytest.approx(sum(RATIOS) / 5, rel=1e-14)
    assert out["token_ratio_min"] == pytest.approx(0.25, rel=1e-14)
    assert out["token_ratio_max"] == pytest.approx(3.0, rel=1e-14)
    assert out["token_tis_weight_mean"] == pytest.approx(sum(w) / 5, rel=1e-14)  # 1.11
    assert out["token_tis_fraction"] == 1 / 5  # 3 > 2
    assert out["token_tis_fraction_low"] == 1 / 5  # 1/4 < 1/2
    assert out["token_tis_seq_fraction"] == 1 / 2  # only sequence 0 holds a truncated token
    assert out["token_ess"] == pytest.approx((sum(w) / 5) ** 2 / (sum(x * x for x in w) / 5), rel=1e-14)
    assert out["token_ess"] == pytest.approx(1.2321 / 1.5905, rel=1e-12)
    assert out["token_mask_fraction"] == 1 / 5 and out["token_mask_seq_fraction"] == 1 / 2  # 1/4 < 0.5
    tight = diag(tis=1.1)
    assert tight["token_tis_fraction"] == 2 / 5 and tight["token_tis_fraction_low"] == 2 / 5  # 3, 1.5; 1/4, 0.8
    assert tight["token_tis_seq_fraction"] == 1.0


def test_sequence_level_product_ratio_by_hand():
    out = diag()
    assert out["seq_ratio_min"] == pytest.approx(0.75, rel=1e-14)
    assert out["seq_ratio_max"] == pytest.approx(1.2, rel=1e-14)
    assert out["seq_tis_fraction"] == 0.0 and out["seq_tis_fraction_low"] == 0.0 and out["seq_mask_fraction"] == 0.0
    # verl broadcasts the sequence weight to the sequence's tokens and averages over tokens
    assert out["seq_tis_weight_mean"] == pytest.approx((2 * 0.75 + 3 * 1.2) / 5, rel=1e-14)
    assert out["seq_ess"] == pytest.approx(1.02**2 / ((2 * 0.75**2 + 3 * 1.2**2) / 5), rel=1e-12)
    tight = diag(tis=1.1, mask_low=0.8, mask_high=1.1)
    assert tight["seq_tis_fraction"] == 1 / 2 and tight["seq_tis_token_fraction"] == 3 / 5  # 1.2 > 1.1
    assert tight["seq_tis_fraction_low"] == 1 / 2  # 0.75 < 1/1.1
    assert tight["seq_mask_fraction"] == 1.0 and tight["seq_mask_token_fraction"] == 1.0  # 0.75 and 1.2 outside


def test_geometric_mean_mask_by_hand():
    out = diag()  # [0.999, 1.001]: both sequences are far outside
    assert out["geo_ratio_min"] == pytest.approx(math.sqrt(0.75), rel=1e-14)
    assert out["geo_ratio_max"] == pytest.approx(1.2 ** (1 / 3), rel=1e-14)
    assert out["geo_mask_fraction"] == 1.0 and out["geo_mask_token_fraction"] == 1.0
    wide = diag(geo_mask_low=0.9, geo_mask_high=1.1)  # sqrt(0.75) = 0.866 is out, 1.0627 in
    assert wide["geo_mask_fraction"] == 1 / 2 and wide["geo_mask_token_fraction"] == 2 / 5


def test_kl_chi2_and_perplexity_by_hand():
    out = diag()
    logs = [math.log(r) for r in RATIOS]
    assert out["kl_k1"] == pytest.approx(-sum(logs) / 5, rel=1e-12)  # verl's kl: mean(lp_rollout - lp_train)
    assert out["kl_k1"] == pytest.approx(-math.log(0.9) / 5, rel=1e-12)
    assert out["kl_k3"] == pytest.approx(sum(r - 1 - x for r, x in zip(RATIOS, logs, strict=True)) / 5, rel=1e-12)
    reverse = sum(1 / r - 1 + x for r, x in zip(RATIOS, logs, strict=True)) / 5
    assert out["kl_k3_train_rollout"] == pytest.approx(reverse, rel=1e-12)
    assert out["chi2_token"] == pytest.approx(sum(r * r for r in RATIOS) / 5 - 1, rel=1e-12)
    assert out["chi2_seq"] == pytest.approx((0.75**2 + 1.2**2) / 2 - 1, rel=1e-9)
    assert out["rollout_log_ppl"] == 1.0
    per_seq_train = [-1 + math.log(0.75) / 2, -1 + math.log(1.2) / 3]
    assert out["training_log_ppl"] == pytest.approx(-sum(per_seq_train) / 2, rel=1e-14)
    assert out["log_ppl_diff"] == pytest.approx(sum(-1 - m for m in per_seq_train) / 2, rel=1e-12)


def test_sequences_need_not_be_contiguous_and_non_finite_tokens_are_left_out():
    order = np.array([2, 0, 4, 1, 3])
    out = importance_diagnostics(SEQ[order], LP_TRAIN[order], LP_INFER[order])
    for key in FIELDS:
        assert out[key] == pytest.approx(diag()[key], rel=1e-12), key
    nan = importance_diagnostics(np.append(SEQ, 1), np.append(LP_TRAIN, np.nan), np.append(LP_INFER, -1.0))
    assert nan["tokens"] == 5 and nan["seq_ratio_max"] == pytest.approx(1.2, rel=1e-14)
    empty = importance_diagnostics(np.array([0]), np.array([np.nan]), np.array([-1.0]))
    assert empty["tokens"] == 0 and all(empty[k] is None for k in FIELDS)


def test_identical_logprobs_give_ratios_of_exactly_one_and_nothing_truncated():
    lp = np.array([-0.3, -7.25, -1e-6, -30.0, -2.0], dtype=np.float32)
    out = importance_diagnostics(SEQ, lp, lp.copy())
    for key in FIELDS:
        if "ratio" in key or key.endswith("weight_mean") or key.endswith("_ess"):
            assert out[key] == 1.0, key
        elif "fraction" in key or key.startswith(("kl_", "chi2")) or key == "log_ppl_diff":
            assert out[key] == 0.0, key
    assert out["training_log_ppl"] == out["rollout_log_ppl"] > 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.floats(-12, 0), st.floats(-12, 0)), min_size=1, max_size=40),
    st.floats(1.01, 10),
    st.floats(0, 0.99),
    st.floats(1.01, 20),
)
def test_properties(rows, c, low, high):
    seq = np.array([r[0] for r in rows])
    lt, li = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    out = importance_diagnostics(seq, lt, li, ISThresholds(tis=c, mask_low=low, mask_high=high))
    for key in FIELDS:
        if "fraction" in key:
            assert 0.0 <= out[key] <= 1.0, key
    assert 0 < out["token_ess"] <= 1 + 1e-12 and 0 < out["seq_ess"] <= 1 + 1e-12
    assert out["token_tis_weight_mean"] <= min(c, out["token_ratio_mean"]) * (1 + 1e-12)
    assert out["kl_k3"] >= 0 and out["kl_k3_train_rollout"] >= 0 and out["chi2_token"] >= -1  # E[r^2] >= 0
    # a token truncated or masked puts its sequence among those flagged, and only then
    assert (out["token_tis_fraction"] > 0) == (out["token_tis_seq_fraction"] > 0)
    assert (out["token_mask_fraction"] > 0) == (out["token_mask_seq_fraction"] > 0)
    assert out["token_tis_fraction"] == pytest.approx(float(np.mean(np.exp(lt - li) > c)))
    # the product ratio of a one-token sequence is its token ratio: the levels agree there
    if len(set(seq.tolist())) == len(seq):
        assert out["seq_tis_fraction"] == pytest.approx(out["token_tis_fraction"])
        assert out["geo_ratio_max"] == pytest.approx(out["seq_ratio_max"], rel=1e-12)


def test_effective_sample_size():
    assert effective_sample_size(np.array([1.0, 1.0, 1.0])) == 1.0
    assert effective_sample_size(np.array([1.0, 0.0, 0.0, 0.0])) == 0.25  # one sample carries all the weight
    assert effective_sample_size(np.array([])) is None and effective_sample_size(np.zeros(3)) is None


@pytest.mark.parametrize(
    "thresholds, message",
    [
        (dict(tis=0.0), "--tis-threshold 0.0: the truncation C must be a finite number > 0"),
        (dict(tis=float("inf")), "--tis-threshold inf"),
        (dict(mask_low=2.0, mask_high=2.0), "--mask-low 2.0 --mask-high 2.0: the kept range needs 0 <= low < high"),
        (dict(mask_low=-0.1), "--mask-low -0.1"),
        (dict(geo_mask_low=1.01, geo_mask_high=1.0), "--geo-mask-low 1.01 --geo-mask-high 1.0"),
    ],
)
def test_invalid_thresholds_are_refused(thresholds, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        importance_diagnostics(SEQ, LP_TRAIN, LP_INFER, ISThresholds(**thresholds))


def test_bad_arrays_are_refused():
    with pytest.raises(InputError, match="three 1-D arrays of one length"):
        importance_diagnostics(SEQ, LP_TRAIN[:4], LP_INFER)
    with pytest.raises(InputError, match="sequence ids must be integers"):
        importance_diagnostics(SEQ.astype(float), LP_TRAIN, LP_INFER)


def _table(generated: np.ndarray) -> pd.DataFrame:
    n = len(generated)
    return compare_tokens(
        pd.DataFrame(
            {
                "seq": np.repeat([0, 1], n // 2).astype(np.int32),
                "pos": np.tile(np.arange(1, n // 2 + 1), 2),
                "token_id": np.zeros(n, dtype=np.int32),
                "generated": generated,
                "lp_train": np.linspace(-3, -1, n).astype(np.float32),
                "lp_infer": np.linspace(-3.5, -0.5, n).astype(np.float32),
            }
        )
    )


def test_the_summary_holds_the_diagnostics_of_the_generated_tokens_with_their_thresholds():
    generated = np.array([False, True, True, False, True, True])
    tokens = _table(generated)
    th = ISThresholds(tis=1.5, mask_low=0.9, mask_high=1.1, geo_mask_low=0.5, geo_mask_high=2.0)
    imp = summarize_tokens(tokens, 0.2, th)["importance"]
    gen = tokens[generated]
    expected = importance_diagnostics(gen["seq"].to_numpy(), gen["lp_train"].to_numpy(), gen["lp_infer"].to_numpy(), th)
    assert imp == {"scope": "generated", **expected}
    assert (imp["tis_threshold"], imp["mask_low"], imp["mask_high"], imp["geo_mask_low"], imp["geo_mask_high"]) == (
        1.5,
        0.9,
        1.1,
        0.5,
        2.0,
    )
    prompt = summarize(_table(np.zeros(6, dtype=bool)))["importance"]  # prompt mode: every scored token
    assert prompt["scope"] == "all" and prompt["tokens"] == 6 and prompt["tis_threshold"] == 2.0
