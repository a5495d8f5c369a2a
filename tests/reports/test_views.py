"""reports.views, what both renderers show, on tables computed by the real comparison code (no engines):
log2 ULP buckets against Python's int.bit_length, prompt ends, sections that appear only with their data, and
the terminal summary grouped the same way."""

from __future__ import annotations

import io
import re

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from alignaudit.comparison.token_diff import summarize
from alignaudit.reports.terminal import render_comparison
from alignaudit.reports.views import bucket_label, bucket_of, prompt_ends, readable, summary_sections, ulp_buckets
from helpers import tokens_of


def test_bucket_of_is_the_bit_length():
    values = [0, 1, 2, 3, 4, 7, 8, 255, 256, 2**20 - 1, 2**20, 2**31 - 1, 2**31, 2**40 + 5]
    assert bucket_of(np.array(values)).tolist() == [int(v).bit_length() for v in values]
    assert [bucket_label(k) for k in range(5)] == ["0", "1", "2-3", "4-7", "8-15"]
    assert bucket_label(13) == "4096-8191" and bucket_label(14) == "[2^13, 2^14)"


def test_ulp_buckets_count_finite_pairs_and_keep_nan_inf_apart():
    rng = np.random.default_rng(0)
    train = -rng.uniform(0.1, 20, 400).astype(np.float32)
    infer = train.copy()
    bits = infer.view(np.int32)
    bits[:300] += rng.integers(0, 5000, 300).astype(np.int32)  # finite ULP offsets 0..4999
    infer[300] = np.nan
    infer[301] = -np.inf
    tokens = tokens_of(train, infer)
    buckets, special = ulp_buckets(tokens)
    finite = tokens[tokens["pair_class"] <= 1]["ulp"].tolist()
    expected = np.bincount([int(u).bit_length() for u in finite])
    assert [b["count"] for b in buckets] == expected.tolist() and len(buckets) == 14  # 4096 <= max < 8192: k = 13
    assert special == {"NaN mismatch": 1, "Inf mismatch": 1}
    assert sum(b["count"] for b in buckets) + 2 == len(tokens)
    for b in buckets:
        inside = [u for u in finite if b["lo"] <= u <= b["hi"]]
        assert len(inside) == b["count"]


def test_prompt_ends_are_the_first_generated_positions():
    generated = np.r_[np.zeros(3, bool), np.ones(2, bool), np.zeros(1, bool), np.ones(4, bool)]
    tokens = tokens_of(-np.ones(10), -np.ones(10), generated)
    assert prompt_ends(tokens) == {0: 4, 1: 2}  # seq 0: positions 1..5, generated from 4; seq 1: 1..5, from 2
    assert prompt_ends(tokens_of(-np.ones(4), -np.ones(4))) == {}


def test_sections_appear_only_with_their_data():
    tokens = tokens_of(-np.linspace(1, 2, 8), -np.linspace(1, 2, 8) - 1e-3)
    summary = summarize(tokens)
    titles = [s.title for s in summary_sections(summary)]
    assert titles == ["Alignment", "RL impact", "Importance weights"]  # IS diagnostics: every comparison
    summary["vocab"] = {"kl_train_infer": 1e-4, "tv_max": 0.5, "top_5_agreement": {"mean": 0.9}}
    summary["importance"] = {"ess_fraction": 0.99, "weight_max": 1.2}
    sections = {s.title: s for s in summary_sections(summary)}
    assert list(sections) == ["Alignment", "RL impact", "Importance weights", "Distribution (full vocabulary)"]
    rows = {label: text for label, text, _ in sections["Distribution (full vocabulary)"].rows}
    assert rows == {"KL train infer": "1.000e-04", "TV max": "0.5", "Top 5 agreement: Mean": "0.9"}
    assert [r[0] for r in sections["Importance weights"].rows] == ["ESS fraction", "Weight max"]
    assert readable("kl_k3_mean") == "KL k3 mean"
    routed = {
        **summary,
        "routing": [
            {"layer": 0, "tokens": 10, "rerouted": 2, "agreement": 0.8},
            {"layer": 1, "tokens": 10, "rerouted": 0, "agreement": 1.0},
        ],
    }
    rows = {s.title: s for s in summary_sections(routed)}["Routing (MoE)"].rows
    assert rows == [
        ("layer 0", "2 of 10 positions rerouted (80.0% agree)", "routing.0"),
        ("layer 1", "0 of 10 positions rerouted (100.0% agree)", "routing.1"),
    ]
    unread = {s.title: s for s in summary_sections({**summary, "routing_note": "compiled MoE"})}["Routing (MoE)"]
    assert unread.rows == [] and unread.note == "not read: compiled MoE"
    no_rows = {k: v for k, v in summary.items() if k != "vocab"}
    one_side = {
        s.title: s
        for s in summary_sections({**no_rows, "vocab_note": "only the train capture holds full-vocabulary rows"})
    }["Distribution (full vocabulary)"]
    assert one_side.rows == [] and one_side.note == "not compared: only the train capture holds full-vocabulary rows"


@pytest.mark.parametrize("mismatch", [True, False])
def test_terminal_summary_is_grouped(mismatch):
    train = -np.linspace(1, 2, 8)
    tokens = tokens_of(train, train - (1e-3 if mismatch else 0))
    summary = summarize(tokens)
    out = io.StringIO()
    render_comparison(Console(file=out, width=160), summary, tokens)
    text = out.getvalue()
    assert text.index("Alignment") < text.index("RL impact") and "Distribution" not in text
    shown = "  ".join(
        f"{k if k < 2 else f'2^{k - 1}'}: {b['count']}" for k, b in enumerate(ulp_buckets(tokens)[0]) if b["count"]
    )
    assert shown in text
    assert ("BITWISE IDENTICAL" in text) != mismatch
    # the importance diagnostics briefly: 6 rows and a pointer to the rest, the fractions as the summary holds them
    imp = summary["importance"]
    section = text[text.index("Importance weights") :]
    assert re.search(rf"tokens truncated, ratio > 2 \(all\) +│ {imp['token_tis_fraction']:.2%}", section)
    assert re.search(
        rf"sequences masked, geometric mean outside \[0.999, 1.001\] +│ "
        rf"{imp['geo_mask_fraction']:.2%}",
        section,
    )
    assert "KL k1 / k3" in section and "every diagnostic: summary.json's importance" in section
    assert "TIS weight mean" not in text and "chi" not in text.lower()


def test_rl_page_groups_every_importance_column_into_named_panels():
    """An rl step record's 31 is_* columns (comparison/importance.FIELDS) land in 8 named panels, not one panel
    each; a column no panel names still gets its own (nothing the steps hold is left out)."""

    from alignaudit.comparison.importance import FIELDS
    from alignaudit.reports.html.rl import panels

    steps = pd.DataFrame(
        {
            "step": [0, 1],
            "mismatches": [3, 0],
            "prob_diff_max": [0.1, 0.0],
            "prob_diff_mean": [0.01, 0.0],
            **{f"is_{f}": [1.0, 1.0] for f in FIELDS},
            "something_new": [1.0, 2.0],
        }
    )
    chosen = panels(steps)
    titles = [title for title, _, _ in chosen]
    is_panels = [cols for title, cols, _ in chosen if title.startswith("IS:") or title.startswith("log-perplexity")]
    assert sorted(c for cols in is_panels for c in cols) == sorted(f"is_{f}" for f in FIELDS)
    assert len(is_panels) == 8
    assert "|p_train - p_rollout| max / mean" in titles and titles[-1] == "something_new"


def test_a_long_engine_option_is_shortened_in_labels_but_not_lost():
    """2000 stop token ids (the H200 shaped rollout) once filled 30 lines of the terminal title; the label shows the
    list's ends and length, and a short option whole."""
    from alignaudit.reports.views import side_label

    side = {
        "engine": "vllm",
        "dtype": "bf16",
        "device": "cuda",
        "strict": "all",
        "tensor_parallel_size": 2,
        "options": {"stop_token_ids": list(range(1000, 3000)), "enforce_eager": True, "note": "x" * 100},
    }
    assert side_label(side) == (
        "vllm (bf16, cuda, strict all, TP=2, stop_token_ids=[1000, ..., 2999] (2000 items), "
        f"enforce_eager=True, note={'x' * 54}…)"
    )
    assert side_label({"engine": "hf"}) == "hf"
