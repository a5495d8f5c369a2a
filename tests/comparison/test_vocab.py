"""comparison/vocab.py on rows built in the test: every measure against a float64 computation written here in numpy,
the edge cases (zero probabilities, disjoint support, NaN rows, ties), and the summary record."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from alignaudit.comparison.vocab import TOP_K, position_divergence, summarize_vocab, vocab_columns
from helpers import vocab_reference as reference


def rows(seed: int, n: int, v: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(n, v, generator=g), -1)


def test_measures_equal_an_independent_float64_computation():
    a, b = rows(0, 9, 300, 3.0), rows(1, 9, 300, 3.0)
    b[:4] = a[:4] + 1e-3 * torch.randn(4, 300)  # some close pairs, some far apart
    got, want = position_divergence(a, b), reference(a.numpy(), b.numpy())
    for name in ("kl_train_infer", "kl_infer_train", "tv", "topk_overlap"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert np.array_equal(got["top1_agree"], want["top1_agree"]) and not got["nonfinite"].any()
    assert (got["kl_train_infer"] > 0).all() and (got["tv"] > 0).all()
    assert got["kl_train_infer"][4:].min() > 100 * got["kl_train_infer"][:4].max()  # far pairs diverge more


def test_identical_rows_give_exactly_zero_and_full_agreement():
    a = rows(2, 5, 64)
    got = position_divergence(a, a.clone())
    assert (got["kl_train_infer"] == 0).all() and (got["kl_infer_train"] == 0).all() and (got["tv"] == 0).all()
    assert got["top1_agree"].all() and (got["topk_overlap"] == 1).all()


def test_zero_probabilities_and_disjoint_support():
    """-inf entries (p = 0) add nothing to KL(p||q); where q = 0 < p, KL(p||q) is +inf and TV counts the mass."""
    a = torch.log_softmax(torch.tensor([[0.0, 0.0, float("-inf"), 1.0, 2.0, 3.0]]), -1)
    b = torch.log_softmax(torch.tensor([[0.0, float("-inf"), 0.0, 1.0, 2.0, 3.0]]), -1)
    got = position_divergence(a, b)
    assert got["kl_train_infer"][0] == np.inf and got["kl_infer_train"][0] == np.inf
    x = a.double().numpy()[0]
    p = np.exp(x - np.log(np.exp(x).sum()))
    assert got["tv"][0] == pytest.approx(p[1], rel=1e-12)  # the mass each side puts where the other puts none
    c = torch.log_softmax(torch.tensor([[0.0, float("-inf"), 0.5, 1.0, 2.0, 3.0]]), -1)
    finite = position_divergence(c, torch.log_softmax(torch.tensor([[0.0, 0.2, 0.5, 1.0, 2.0, 3.0]]), -1))
    assert np.isfinite(finite["kl_train_infer"][0]) and finite["kl_infer_train"][0] == np.inf


def test_nan_rows_are_nonfinite_never_averaged_and_ties_go_to_the_lower_id():
    a, b = rows(3, 3, 16), rows(4, 3, 16)
    a[1, 7] = float("nan")
    got = position_divergence(a, b)
    assert got["nonfinite"].tolist() == [False, True, False]
    assert np.isnan(got["kl_train_infer"][1]) and np.isnan(got["tv"][1]) and not got["top1_agree"][1]
    tie = torch.log_softmax(torch.tensor([[1.0, 5.0, 5.0, 0.0, 5.0, 0.0, 0.0]]), -1)
    other = torch.log_softmax(torch.tensor([[1.0, 0.0, 5.0, 0.0, 5.0, 5.0, 0.0]]), -1)
    got = position_divergence(tie, other, k=2)  # top-2: [1, 2] vs [2, 4]
    assert not got["top1_agree"][0] and got["topk_overlap"][0] == 0.5
    with pytest.raises(ValueError, match="k=8 outside 1..7"):
        position_divergence(tie, other, k=8)


def test_columns_and_summary_on_a_token_table():
    """Rows for two sequences of 4 and 3 tokens (3 and 2 scored positions); the token at pos p is scored by row p - 1,
    the summary's maxima point at the right (seq, pos), and the row-vs-logprob check catches a mismatch."""
    r = {0: rows(5, 3, 40), 1: rows(6, 2, 40)}
    s = {0: rows(7, 3, 40), 1: r[1].clone()}
    ids = {0: [3, 9, 11, 2], 1: [4, 5, 6]}
    table = pd.DataFrame(
        [
            {
                "seq": q,
                "pos": p,
                "token_id": ids[q][p],
                "lp_train": float(r[q][p - 1, ids[q][p]]),
                "lp_infer": float(s[q][p - 1, ids[q][p]]),
            }
            for q in (0, 1)
            for p in range(1, len(ids[q]))
        ]
    )
    table.loc[4, "lp_infer"] = np.float32(table.loc[4, "lp_infer"]) + np.float32(1e-3)  # not the row's entry
    out = vocab_columns(table, r.__getitem__, s.__getitem__)
    want = reference(r[0].numpy(), s[0].numpy())
    np.testing.assert_allclose(out["vocab_kl_train_infer"][:3], want["kl_train_infer"], rtol=1e-12)
    assert (out["vocab_kl_train_infer"][3:] == 0).all() and (out["vocab_tv"][3:] == 0).all()
    assert out["vocab_row_matches_train"].all() and out["vocab_row_matches_infer"].tolist() == [1, 1, 1, 1, 0]
    summary = summarize_vocab(out)
    i = int(np.argmax(want["tv"]))
    assert summary["tv"]["max_at"] == {"seq": 0, "pos": i + 1}
    assert summary["tv"]["max"] == pytest.approx(want["tv"][i], rel=1e-12)
    assert summary["kl_train_infer"]["mean"] == pytest.approx(want["kl_train_infer"].sum() / 5, rel=1e-12)
    assert summary["positions"] == 5 and summary["nonfinite_positions"] == 0 and summary["k"] == TOP_K
    assert summary["row_token_mismatches"] == {"train": 0, "infer": 1}
    assert summary["topk_overlap_min"] == want["topk_overlap"].min()
