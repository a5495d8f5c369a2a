"""summary.json's schema in one place: what comparison/token_diff.summarize writes and what pipeline.diff_captures
adds, read by reports/views.py, comparison/gate.py, api.Comparison and rl/loop. docs/output.md gives each field's
formula. tests/comparison/test_summary.py holds the writers to these keys (every ``summary["key"] = ...`` in
alignaudit, and summarize's own record).
"""

from __future__ import annotations

from typing import TypedDict


class SideCounts(TypedDict):
    """Tokens whose logprob passes a test (NaN, Inf, > 0) on the train side, the infer side, and both."""

    train: int
    infer: int
    both: int


class RLImpact(TypedDict):
    """What the logprob differences d = lp_train - lp_infer do to an RL update (finite pairs; None where none)."""

    clip_eps: float
    ratio_min: float | None
    ratio_max: float | None
    clip_fraction: float | None
    token_mult_prob_error: float | None
    prob_diff_max: float | None
    prob_diff_mean: float | None
    kl_k3_mean: float | None


class TokenSummary(TypedDict):
    """summarize_tokens' record of one token table (all compared tokens, or the generated ones alone)."""

    tokens_compared: int
    sequences: int
    mismatches: int
    mismatch_fraction: float
    nan_mismatches: int
    inf_mismatches: int
    nan_tokens: SideCounts
    inf_tokens: SideCounts
    positive_tokens: SideCounts
    max_abs_diff: float | None
    mean_abs_diff: float | None
    mean_diff: float | None
    ulp_max: int | None
    ulp_median: float | None
    ulp_p99: float | None
    ulp_histogram: dict[str, int]
    rl: RLImpact
    importance: dict  # comparison/importance.summarize_importance (docs/rl-metrics.md)


class Summary(TokenSummary, total=False):
    """summary.json: TokenSummary of every compared token, and where they apply the records below."""

    worst_sequences: list[dict]  # the WORST_SEQUENCES worst rows of the per-sequence table
    generated: TokenSummary  # rollout mode: the generated tokens alone
    vocab: dict  # --full-vocab: comparison/vocab.summarize_vocab
    vocab_note: str  # one capture holds full-vocabulary rows, the other not
    attention_note: str  # the two captures' strict attention ran different kernels (pipelines.runs.attention_note)
    routing: list[dict]  # MoE: per layer, tokens rerouted between the engines
    routing_note: str  # MoE: why the routing was not read
    routing_replay: dict  # --replay-routing: own routing -> replayed, pipeline.routing_replay_record
    repeats: dict  # --repeat: per side, comparison/repeat.summarize_repeats
    model: str
    sides: dict  # per role: engine, settings and the capture's digest
