"""The numbers of rl's held-out evaluations (alignaudit.rl.evaluation), computed from their per-prompt rows: by the run
that writes eval.parquet and again by every reader that checks it (comparison.integrity.load_rl_run), so that a
page or a gate never shows an eval.parquet its rows do not give."""

from __future__ import annotations

import math
from pathlib import Path

from alignaudit.inputs.prompts import TokenBatch

SUMMARY_COLUMNS = (
    "step",
    "prompts",
    "reward_mean",
    "reward_std",
    "accuracy",
    "completion_len_mean",
    "completions_ended_early",
    "seconds",
)
ROW_COLUMNS = ("step", "prompt", "prompt_ids", "completion_ids", "completion", "reward", "correct")


def due(step: int, every: int, last: int) -> bool:
    """Whether a run evaluates after ``step`` (0: before step 1): the first, every ``every``-th (0: none between) and
    the ``last`` step run."""
    return step == 0 or step == last or (every > 0 and step % every == 0)


def headline(table) -> str:
    """The column that says how the held-out prompts fare (eval.parquet's ``table``): ``accuracy`` where every
    evaluation has one (the task), else ``reward_mean``."""
    return "accuracy" if table["accuracy"].notna().all() else "reward_mean"


def summarize(rows, max_new_tokens: int, accuracy: bool) -> dict:
    """One evaluation's numbers from its rows (a pandas DataFrame of ROW_COLUMNS, one step): the prompts, the
    reward's mean and population std, the fraction of right answers (``correct``; None without ``accuracy``), the
    mean completion length in tokens and the completions that ended before ``max_new_tokens``."""
    lengths = rows["completion_ids"].map(len)
    return {
        "step": int(rows["step"].iloc[0]),
        "prompts": len(rows),
        "reward_mean": float(rows["reward"].mean()),
        "reward_std": float(rows["reward"].std(ddof=0)),
        "accuracy": float(rows["correct"].astype(bool).mean()) if accuracy else None,
        "completion_len_mean": float(lengths.mean()),
        "completions_ended_early": int((lengths < max_new_tokens).sum()),
    }


def check_table(table, rows_of, record: dict, ran: int, where: Path) -> None:
    """eval.parquet (``table``) against the run: one row per evaluation the schedule gives for ``ran`` steps, in
    order; each evaluation's per-prompt rows (``rows_of(step)``) hold the prompts run.json's ``eval.digest`` names,
    in order, and give its numbers, to a relative 1e-9 (another machine's float64 sums may round the last bits
    otherwise).

    Raises:
        InputError: naming the first step or number that differs.
    """
    from alignaudit.errors import InputError

    held = record["eval"]
    expected = [s for s in range(ran + 1) if due(s, int(held["every"]), ran)]
    if table["step"].tolist() != expected:
        raise InputError(
            f"{where} holds evaluations after steps {table['step'].tolist()}, not {expected}; the run "
            "directory was altered"
        )
    max_new = int(record["rollout"]["max_new_tokens"])
    for row in table.to_dict("records"):
        rows = rows_of(int(row["step"]))
        asked = TokenBatch(tuple(tuple(int(t) for t in ids) for ids in rows["prompt_ids"]))
        if (
            len(rows) != held["prompts"]
            or asked.digest() != held["digest"]
            or rows["prompt"].tolist() != list(range(len(rows)))
        ):
            raise InputError(
                f"{where}: the evaluation after step {row['step']} holds other prompts than the "
                f"{held['prompts']} run.json names (eval.digest); the run directory was altered"
            )
        for key, value in summarize(rows, max_new, row["accuracy"] == row["accuracy"]).items():
            recorded = row[key]
            same = (value is None and recorded != recorded) or (
                value is not None and math.isclose(float(recorded), float(value), rel_tol=1e-9, abs_tol=0.0)
            )
            if not same:
                raise InputError(
                    f"{where}: {key} {recorded} after step {row['step']}, {value} from its rows; the run "
                    "directory was altered"
                )
