"""rl's held-out evaluation (``--eval-prompts FILE``, ``--eval-every K``): the rollout engine answers prompts the
policy never trains on, greedily, and the run's reward scores the answers.

When: before step 1 (``step`` 0, the starting weights), after every K-th step, and after the last step run (K 0: only
the first and the last). Each evaluation follows that step's weight sync, so it scores the weights the next rollout
samples from. How: one completion per prompt at temperature 0 (greedy: top-k and top-p off), at most the rollout's
``max_new_tokens``, EOS as the rollout treats it; no logprob is compared (the policy's alignment is the steps'
business). Scored by the run's reward with the step number; under ``--reward task``, ``accuracy`` is the fraction of
answers that are right (reward 1.0: alignaudit.rl.task).

Records: eval.parquet, one row per evaluation (comparison.held_out.SUMMARY_COLUMNS), rewritten after each;
eval/step-NNNNN.parquet, one row per prompt (comparison.held_out.ROW_COLUMNS); both sealed in run.json and checked
by every reader (comparison.held_out.check_table). The prompts come from ``--eval-prompts`` (JSONL columns reach a
user's reward as the training prompts' do) or, under ``--reward task``, the task's held-out questions
(alignaudit.rl.task.held_out_pairs), which no training question is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from alignaudit.capture.rundir import EVAL, EVAL_DIR, EVAL_ROWS
from alignaudit.comparison.held_out import SUMMARY_COLUMNS, due, summarize
from alignaudit.errors import InputError
from alignaudit.inputs.prompts import TokenBatch


@dataclass(frozen=True)
class HeldOut:
    """The held-out prompts and when they are scored.

    Attributes:
        batch: the prompts (token ids; ``columns`` from a JSONL file). every: evaluate after every ``every``-th step
        (0: only before the first and after the last). overlap: how many of them are also training prompts, by
        ``overlap_by`` ("token ids", or under the task "question": the same operands however the ids spell them),
        recorded and warned about: a score on prompts the policy trains on is not held out. accuracy: score
        ``accuracy`` too (the task's reward: right answers get 1.0).
    """

    batch: TokenBatch
    every: int
    overlap: int
    accuracy: bool
    overlap_by: str = "token ids"

    def due(self, step: int, last: int) -> bool:
        """Whether to evaluate after ``step`` of a run whose last step is ``last`` (0: before step 1)."""
        return due(step, self.every, last)

    def record(self) -> dict:
        """run.json's ``eval``: the source, count and digest of the prompts, the schedule, the overlap."""
        return {
            "source": self.batch.source,
            "prompts": len(self.batch.sequences),
            "digest": self.batch.digest(),
            "every": self.every,
            "overlap_with_training": self.overlap,
            "overlap_by": self.overlap_by,
            "greedy": True,
        }


def held_out(batch: TokenBatch | None, every: int, training: TokenBatch, task: bool, question=None) -> HeldOut | None:
    """The HeldOut of an rl run, or None where neither prompts nor a schedule was given. ``question``: token ids ->
    what a prompt asks (the task's operands), to count overlap by; None: by the token ids themselves.

    Raises:
        InputError: a schedule (``every`` > 0, checked by RLSettings.check) without prompts (``batch`` None).
    """
    if batch is None:
        if every:
            raise InputError(
                f"--eval-every {every} scores held-out prompts, and none were given: add --eval-prompts "
                "FILE, or use --reward task (its own held-out questions)"
            )
        return None
    key = question or tuple
    trained = {key(seq) for seq in training.sequences}
    overlap = sum(key(seq) in trained for seq in batch.sequences)
    return HeldOut(batch, every, overlap, task, "question" if question else "token ids")


class Evaluations:
    """A run's evaluations, in order (nothing to do where ``held`` is None).

    Args:
        held: the prompts and schedule. rollout: the rollout engine's Session (its "rollout" call). sampling: the
            run's rollout settings (Sampling.to_dict()), made greedy here. reward: alignaudit.rl.reward.RunReward.
        out: the run directory. on_eval: called with each summary row.
    """

    def __init__(self, held: HeldOut | None, rollout, sampling: dict, reward, out: Path, on_eval=None):
        self.held, self.rollout, self.sampling, self.reward, self.out = held, rollout, sampling, reward, out
        self.on_eval = on_eval or (lambda row: None)
        self.rows: list[dict] = []

    def after(self, step: int, last: int) -> None:
        """Evaluate after ``step`` (0: before the first) where HeldOut.due says so; eval.parquet rewritten."""
        if self.held is None or not self.held.due(step, last):
            return
        self.rows.append(evaluate(step, self.held, self.rollout, self.sampling, self.reward, self.out))
        write_table(self.rows, self.out)
        self.on_eval(self.rows[-1])

    @property
    def table(self) -> pd.DataFrame | None:
        """eval.parquet's table so far, or None where the run evaluates nothing."""
        return summary_table(self.rows) if self.held is not None else None


def evaluate(step: int, held: HeldOut, rollout, sampling: dict, reward, out: Path) -> dict:
    """Score the held-out prompts with the weights the rollout engine holds now (Evaluations' arguments): writes
    eval/step-NNNNN.parquet (comparison.held_out.ROW_COLUMNS) and returns the summary row (SUMMARY_COLUMNS);
    ``completion`` is the text ``reward.decode`` gives, empty where the checkpoint has no tokenizer."""
    started = time.perf_counter()
    prompts = [list(p) for p in held.batch.sequences]
    greedy = {**sampling, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "group_size": 1}
    rolled = rollout.call("rollout", prompts=prompts, sampling=greedy)
    sequences = rolled["sequences"]
    completions = [s[len(p) :] for s, p in zip(sequences, prompts, strict=True)]
    columns = {name: list(values) for name, values in held.batch.columns.items()}
    when = "before step 1" if step == 0 else f"after step {step}"
    rewards = reward(prompts, completions, step, columns, f"the held-out evaluation {when}")
    rows = pd.DataFrame(
        {
            "step": np.full(len(prompts), step, dtype=np.int64),
            "prompt": np.arange(len(prompts), dtype=np.int64),
            "prompt_ids": prompts,
            "completion_ids": completions,
            "completion": [reward.decode(c) if reward.decode else "" for c in completions],
            "reward": np.asarray(rewards, dtype=np.float64),
            "correct": [r == 1.0 for r in rewards] if held.accuracy else [None] * len(prompts),
        }
    )
    (out / EVAL_DIR).mkdir(exist_ok=True)
    rows.to_parquet(out / EVAL_DIR / EVAL_ROWS.format(step=step), index=False)
    return summarize(rows, sampling["max_new_tokens"], held.accuracy) | {
        "seconds": round(time.perf_counter() - started, 3)
    }


def summary_table(rows: list[dict]) -> pd.DataFrame:
    """The summaries so far as eval.parquet holds them (SUMMARY_COLUMNS, in order; no accuracy as NaN)."""
    table = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
    table["accuracy"] = table["accuracy"].astype("float64")  # None (no accuracy) as NaN, a float column either way
    return table


def write_table(rows: list[dict], out: Path) -> pd.DataFrame:
    """eval.parquet from the summaries so far (``summary_table``); returns the table."""
    table = summary_table(rows)
    table.to_parquet(out / EVAL, index=False)
    return table
