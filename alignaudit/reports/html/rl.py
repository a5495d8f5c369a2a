"""The rl section: every per-step series of steps.parquet as curves over the steps, and the steps table; the held-out
evaluations of eval.parquet where the run made them."""

from __future__ import annotations

import math

import pandas as pd

from alignaudit.capture.rundir import EVAL, STEPS
from alignaudit.comparison.held_out import headline
from alignaudit.reports.html.page import Column, Page, table
from alignaudit.reports.html.runs import RunDir, read_table

STEP_COLUMNS = ("step",)
# Panels in reading order: (title, columns, log y). Columns a run lacks are skipped; numeric columns not
# named here get a panel each, so nothing the step records hold is left out.
PANELS = (
    ("mismatching tokens", ("mismatches",), False),
    ("mismatching fraction", ("mismatch_fraction",), False),
    ("max |lp_train - lp_rollout|", ("max_abs_diff",), True),
    ("max ULP", ("ulp_max",), False),
    ("importance ratio min / max", ("ratio_min", "ratio_max"), False),
    ("KL k3 and ratio outside clip", ("kl_k3", "clip_fraction"), False),
    (
        "KL over the whole vocabulary (exact, --full-vocab): train || rollout, rollout || train, mean and max",
        (
            "vocab_kl_train_infer_mean",
            "vocab_kl_infer_train_mean",
            "vocab_kl_train_infer_max",
            "vocab_kl_infer_train_max",
        ),
        False,
    ),
    ("total variation over the whole vocabulary, mean and max", ("vocab_tv_mean", "vocab_tv_max"), False),
    ("top-1 agreement and top-5 overlap of the two rows", ("vocab_top1_agreement", "vocab_top5_overlap"), False),
    ("rows with NaN or +inf; infinite KLs", ("vocab_nonfinite_positions", "vocab_infinite_kl"), False),
    ("token_mult_prob_error", ("token_mult_prob_error",), False),
    ("|p_train - p_rollout| max / mean", ("prob_diff_max", "prob_diff_mean"), False),
    (
        "IS: tokens truncated (TIS) / masked",
        ("is_token_tis_fraction", "is_token_tis_fraction_low", "is_token_mask_fraction"),
        False,
    ),
    (
        "IS: sequences truncated / masked",
        (
            "is_token_tis_seq_fraction",
            "is_token_mask_seq_fraction",
            "is_seq_tis_fraction",
            "is_seq_tis_fraction_low",
            "is_seq_mask_fraction",
            "is_geo_mask_fraction",
        ),
        False,
    ),
    (
        "IS: tokens inside truncated / masked sequences",
        ("is_seq_tis_token_fraction", "is_seq_mask_token_fraction", "is_geo_mask_token_fraction"),
        False,
    ),
    ("IS: effective sample size (fraction)", ("is_token_ess", "is_seq_ess"), False),
    (
        "IS: token ratio and TIS weight",
        ("is_token_ratio_min", "is_token_ratio_mean", "is_token_ratio_max", "is_token_tis_weight_mean"),
        False,
    ),
    (
        "IS: sequence and geometric ratio",
        ("is_seq_ratio_min", "is_seq_ratio_max", "is_seq_tis_weight_mean", "is_geo_ratio_min", "is_geo_ratio_max"),
        False,
    ),
    (
        "IS: KL (k1, k3 both ways) and chi-squared",
        ("is_kl_k1", "is_kl_k3", "is_kl_k3_train_rollout", "is_chi2_token", "is_chi2_seq"),
        False,
    ),
    (
        "log-perplexity, training / rollout / difference",
        ("is_training_log_ppl", "is_rollout_log_ppl", "is_log_ppl_diff"),
        False,
    ),
    ("mean d (signed)", ("mean_diff",), False),
    ("reward (mean)", ("reward_mean",), False),
    ("loss", ("loss",), False),
    ("KL to the starting weights (k3, --kl-coef)", ("kl_ref",), False),
    ("grad norm", ("grad_norm",), False),
    ("weights changed by the update (fraction of elements)", ("weights_changed_fraction",), False),
    ("max |delta w|", ("max_abs_dw",), False),
    ("train clip fraction", ("train_clip_fraction",), False),
    ("checks (1 = holds)", ("sync_bit_equal", "train_forward_equal"), False),
    ("sync problems", ("sync_tensors_differing", "sync_stale_packed", "sync_replicas_diverged"), False),
    ("NaN tokens", ("nan_tokens",), False),
    ("seconds per stage", ("rollout_s", "rescore_s", "vocab_s", "update_s", "sync_s", "seconds"), False),
)
SKIP = {"step", "tokens"}


def panels(steps: pd.DataFrame) -> list[tuple[str, list[str], bool]]:
    """The PANELS this table has columns for, then one panel per other numeric or boolean column."""
    out, used = [], set(SKIP)
    for title, columns, log in PANELS:
        present = [c for c in columns if c in steps]
        used |= set(columns)
        if present:
            out.append((title, present, log))
    for column in steps.columns:
        if column not in used and (
            pd.api.types.is_numeric_dtype(steps[column]) or pd.api.types.is_bool_dtype(steps[column])
        ):
            out.append((column, [column], False))
    return out


def steps_figure(steps: pd.DataFrame):
    """A grid of small plots over the steps, two per row, one per panel."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    chosen = panels(steps)
    rows = math.ceil(len(chosen) / 2)
    fig = make_subplots(
        rows=rows,
        cols=2,
        subplot_titles=[t for t, _, _ in chosen],
        vertical_spacing=min(0.3 / rows, 0.08),
        horizontal_spacing=0.08,
    )
    x = steps["step"].tolist()
    for k, (_title, columns, log) in enumerate(chosen):
        row, col = k // 2 + 1, k % 2 + 1
        for column in columns:
            y = steps[column].astype(float)
            if log:
                y = y.where(y > 0)  # 0 (aligned) has no place on a log axis: a gap
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=[None if v != v else v for v in y],
                    mode="lines+markers",
                    name=column,
                    legendgroup=column,
                    showlegend=len(columns) > 1,
                    marker=dict(size=5),
                    hovertemplate=f"step %{{x}}<br>{column} %{{y:.6g}}<extra></extra>",
                ),
                row=row,
                col=col,
            )
        if log:
            fig.update_yaxes(type="log", row=row, col=col)
        fig.update_xaxes(title_text="step" if k >= len(chosen) - 2 else None, row=row, col=col)
    fig.update_xaxes(tick0=1, dtick=max(1, math.ceil(len(steps) / 10)))  # whole steps only
    fig.update_layout(height=260 * rows + 80, legend=dict(orientation="h", y=-0.03))
    return fig


def vocab_note(steps: pd.DataFrame) -> str:
    """rl --full-vocab, in one sentence: the exact KL(train || rollout) over the whole vocabulary (per-step means:
    their mean and the largest per-token max), and the lowest per-step top-1 agreement."""
    kl, top1 = steps["vocab_kl_train_infer_mean"], steps["vocab_top1_agreement"]
    return (
        f"Full vocabulary (--full-vocab, exact over every entry): KL(train || rollout) per step {kl.mean():.3g} "
        f"nats on average, largest at one token {steps['vocab_kl_train_infer_max'].max():.3g}; top-1 agreement "
        f"at least {top1.min():.4g}."
    )


def rl_section(page: Page, run: RunDir) -> pd.DataFrame:
    """Add the per-step curves and table of an rl run; returns the steps table.

    Raises:
        InputError: steps.parquet unreadable or without a ``step`` column, or empty.
    """
    from alignaudit.errors import InputError

    steps = read_table(run.path / STEPS, STEP_COLUMNS).sort_values("step").reset_index(drop=True)
    if steps.empty:
        raise InputError(f"{run.path / STEPS} holds no steps; the run stopped before its first step: run it again")
    page.heading("RL steps", anchor="rl")
    if "mismatches" in steps:
        bad = int((steps["mismatches"] > 0).sum())
        unsynced = int((~steps["sync_bit_equal"].astype(bool)).sum()) if "sync_bit_equal" in steps else 0
        page.banner(
            f"{bad} of {len(steps)} steps with mismatching tokens; {unsynced} weight syncs not bit-equal",
            bad == 0 and unsynced == 0,
        )
    record = run.record or {}
    stopped = record.get("stopped")
    if stopped:
        page.note(
            f"Stopped after step {stopped['after_step']} of {record['rl']['steps']} asked: --max-seconds "
            f"{record['rl']['max_seconds']:g} had passed ({stopped['elapsed_s']:g} s)."
        )
    if "vocab_kl_train_infer_mean" in steps:
        page.note(vocab_note(steps))
    page.figure(steps_figure(steps), "rl-steps")
    page.heading("Steps (steps.parquet)", level=3)
    columns = [
        Column(c, c, text=not pd.api.types.is_numeric_dtype(steps[c]) and not pd.api.types.is_bool_dtype(steps[c]))
        for c in steps.columns
        if c != "weights_digest"
    ]
    rows = steps.to_dict("records")
    if "weights_digest" in steps:
        columns.append(Column("weights", "weights", text=True))
        rows = [{**r, "weights": str(r["weights_digest"])[:12]} for r in rows]
    page.add(table(rows, columns, table_id="steps"))
    held = (run.record or {}).get("eval")
    if held:
        eval_section(page, read_table(run.path / EVAL, ("step", "reward_mean", "accuracy")), held)
    return steps


def _overlap_note(overlap: int, by: str) -> str:
    """What the page says of held-out prompts that are also training prompts (compared by ``by``: "token ids", or
    under the task "question", its operands)."""
    if by == "question":
        return (
            "None of them asks a training question."
            if overlap == 0
            else f"{overlap} of them ask training questions: their score is not held out."
        )
    return (
        "None of them has the token ids of a training prompt."
        if overlap == 0
        else f"{overlap} of them have the token ids of training prompts: their score is not held out."
    )


def eval_section(page: Page, evals: pd.DataFrame, held: dict) -> None:
    """The held-out evaluations (rl --eval-prompts / --eval-every; ``held`` run.json's ``eval``): where the prompts
    came from and whether any is also a training prompt, the greedy reward and accuracy over the steps, the table."""
    import plotly.graph_objects as go

    page.heading("Held-out evaluation (eval.parquet)", anchor="eval")
    overlap = held["overlap_with_training"]
    every = held["every"]
    when = (
        "after every step"
        if every == 1
        else f"after every {every} steps and after the last"
        if every
        else "and after the last step"
    )
    page.note(
        f"{held['prompts']} prompts from {held['source']}, answered greedily (temperature 0, one completion "
        f"each) by the rollout engine before step 1 (step 0), {when}, and scored by the run's reward. "
        + _overlap_note(overlap, held.get("overlap_by", "token ids"))
    )
    if len(evals) > 1:
        first, last = evals.iloc[0], evals.iloc[-1]
        measure = headline(evals)
        page.note(
            f"Held-out {measure.replace('_mean', '')}: {first[measure]:.4g} before step 1, {last[measure]:.4g} "
            f"after step {int(last['step'])}."
        )
    fig = go.Figure()
    for column in ("reward_mean", "accuracy"):
        if evals[column].notna().any():
            fig.add_trace(
                go.Scatter(
                    x=evals["step"].tolist(),
                    y=evals[column].astype(float).tolist(),
                    mode="lines+markers",
                    name=column,
                    hovertemplate=f"after step %{{x}}<br>{column} %{{y:.4g}}<extra></extra>",
                )
            )
    fig.update_layout(height=320, xaxis_title="after step", yaxis_title="held-out (greedy)")
    fig.update_xaxes(tick0=0, dtick=max(1, math.ceil(int(evals["step"].max()) / 10)))  # whole steps only
    page.figure(fig, "rl-eval")
    columns = [Column(c, c) for c in evals.columns]
    page.add(table(evals.to_dict("records"), columns, table_id="eval"))
