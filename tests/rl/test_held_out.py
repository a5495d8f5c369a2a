"""rl as users run it: a dataset drawn from step by step, their own reward with the dataset's columns, and a held-out
score (alignaudit.rl.evaluation, alignaudit.rl.task's split, alignaudit.comparison.held_out).

Chain: the addition task's 10,000 questions split once into 9,000 training and 1,000 held-out ones (pinned below, the
same on every machine: Python's Mersenne Twister); a JSONL prompt file's other keys become columns that reach a user's
reward by name, as TRL passes a dataset's columns; 20 strict GRPO steps on the trained fixture draw 8 fresh training
questions a step and score 32 held-out ones greedily before step 1 and after steps 10 and 20: every token bitwise
equal at every step, eval.parquet's numbers those its rows give, the user's reward (reading the ``answer`` column)
equal to the task's own on every held-out answer. Refused before any engine starts: a schedule without held-out
prompts, a negative one, a held-out prompt that is not a question under the task, a column named as a reward argument,
a reward that needs a column the prompts lack.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_task import TRAINED

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE, InputError
from alignaudit.rl.task import HELD_OUT_SIZE, PAIRS, QUESTION, TaskReward, answer, questions, split_of, split_pairs
from helpers import one_line_error

REWARDS = Path(__file__).with_name("user_rewards.py")


def _operands(text: str) -> tuple[int, int]:
    a, b = QUESTION.search(text).groups()
    return int(a), int(b)


def test_the_task_split_is_fixed_disjoint_and_drawn_from_one_side():
    train, held = split_pairs("train"), split_pairs("held_out")
    assert len(held) == HELD_OUT_SIZE == 1000 and len(train) == PAIRS - 1000 and not set(train) & set(held)
    assert questions(3, 0, "held_out") == ["85+52=", "39+8=", "76+12="]  # Python's random, the same everywhere
    assert all(split_of(*_operands(q)) == "held_out" for q in questions(200, 5, "held_out"))
    assert all(split_of(*_operands(q)) == "train" for q in questions(200, 5))
    every = questions(0, 3)
    assert len(every) == len(set(every)) == 9000
    with pytest.raises(InputError, match="held_out set holds 1000 questions"):
        questions(1001, 0, "held_out")


def test_a_jsonl_prompt_files_other_keys_are_columns(tmp_path):
    from alignaudit.inputs.checkpoint import resolve_model
    from alignaudit.inputs.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "1+2=", "answer": "3", "level": 1}\n{"text": "4+5=", "answer": "9"}\n')
    batch = load_prompts(resolve_model("qwen3-tiny-trained"), path)
    assert batch.columns == {"answer": ("3", "9"), "level": (1, None)}  # a missing key is None, as datasets reads it
    bare = tmp_path / "q.jsonl"
    bare.write_text('{"text": "1+2="}\n{"text": "4+5="}\n')
    assert load_prompts(resolve_model("qwen3-tiny-trained"), bare).digest() == batch.digest()  # the ids only


def test_the_schedule_and_the_check_of_eval_parquet():
    """Evaluations follow step 0, every K-th step and the last run (a --max-seconds stop included); a table whose
    numbers its rows do not give, or whose steps the schedule does not, is refused."""
    from alignaudit.comparison.held_out import check_table, due, summarize

    assert [s for s in range(21) if due(s, 10, 20)] == [0, 10, 20]
    assert [s for s in range(8) if due(s, 5, 7)] == [0, 5, 7]  # stopped after step 7
    assert [s for s in range(4) if due(s, 0, 3)] == [0, 3]
    rows = {
        s: pd.DataFrame(
            {
                "step": [s, s],
                "prompt": [0, 1],
                "prompt_ids": [[1, 2], [3, 4]],
                "completion_ids": [[5, 0], [6, 7, 8]],
                "completion": ["", ""],
                "reward": [1.0, 0.1 * s],
                "correct": [True, False],
            }
        )
        for s in (0, 2)
    }
    from alignaudit.inputs.prompts import TokenBatch

    digest = TokenBatch(((1, 2), (3, 4))).digest()
    record = {"eval": {"every": 2, "prompts": 2, "digest": digest}, "rollout": {"max_new_tokens": 3}}
    table = pd.DataFrame([summarize(rows[s], 3, True) | {"seconds": 0.1} for s in (0, 2)])
    assert table["reward_mean"].tolist() == [0.5, 0.6] and table["completions_ended_early"].tolist() == [1, 1]
    check_table(table, rows.get, record, 2, Path("eval.parquet"))
    with pytest.raises(InputError, match="reward_mean 0.7 after step 2, 0.6 from its rows"):
        check_table(table.assign(reward_mean=[0.5, 0.7]), rows.get, record, 2, Path("eval.parquet"))
    with pytest.raises(InputError, match=r"after steps \[0, 2\], not \[0, 2, 3\]"):
        check_table(table, rows.get, record, 3, Path("eval.parquet"))
    rows[2].at[1, "prompt_ids"] = [3, 5]  # another prompt's row
    with pytest.raises(InputError, match="after step 2 holds other prompts than the 2 run.json names"):
        check_table(table, rows.get, record, 2, Path("eval.parquet"))


def test_a_users_reward_gets_copies_and_any_callable_and_its_errors_name_the_call():
    """The function may change its arguments: the caller's lists stay as they were. A callable object, a partial and
    a builtin are rewards too (run.json names the file where there is one). What it raises, and what it returns
    wrong, is an input error naming the function and the call."""
    from alignaudit.rl.user_reward import UserReward
    from helpers import FIXTURE

    prompts, completions, columns = [[1, 2]], [[3, 4]], {"answer": ["7"]}
    assert UserReward(f"{REWARDS}:mutating", str(FIXTURE))(prompts, completions, 1, columns) == [0.5]
    assert prompts == [[1, 2]] and completions == [[3, 4]] and columns == {"answer": ["7"]}
    for name in ("SCORER", "PARTIAL"):
        reward = UserReward(f"{REWARDS}:{name}", str(FIXTURE))
        assert reward.record()["file"] == str(REWARDS) and len(reward([[1, 2]], [[4, 6]], 1)) == 1
    assert UserReward("math:fsum", str(FIXTURE)).record() == {"function": "math:fsum", "file": None, "sha256": None}
    with pytest.raises(InputError, match=r"raised KeyError: 'answer' \(the held-out evaluation after step 3\)"):
        UserReward(f"{REWARDS}:raising", str(FIXTURE))([[1]], [[2]], 3, None, "the held-out evaluation after step 3")


def test_overlap_is_counted_by_question_under_the_task():
    """Under the task a held-out prompt that asks a training question is not held out, however its ids spell it."""
    from alignaudit.inputs.checkpoint import resolve_model
    from alignaudit.inputs.prompts import text_batch
    from alignaudit.rl.evaluation import held_out

    spec = resolve_model("qwen3-tiny-trained")
    training = text_batch(spec, ["37+45=", "1+2="], "train")
    held = text_batch(spec, [" 37+45=", "3+4="], "held")  # a leading space: other ids, the same question
    assert held.sequences[0] not in training.sequences
    assert held_out(held, 0, training, task=False).overlap == 0
    by_question = held_out(held, 0, training, task=True, question=TaskReward(str(TRAINED)).operands)
    assert (by_question.overlap, by_question.overlap_by) == (1, "question")


def _question_file(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": q, "answer": answer(*_operands(q))}) + "\n" for q in texts))
    return path


@pytest.mark.engines
def test_twenty_strict_steps_on_fresh_questions_with_a_users_reward_and_a_held_out_score(tmp_path):
    train = _question_file(tmp_path / "train.jsonl", questions(160, 11))
    held = _question_file(tmp_path / "held.jsonl", questions(32, 11, "held_out"))
    out = tmp_path / "rl"
    assert (
        cli.main(
            [
                "rl",
                "--model",
                "qwen3-tiny-trained",
                "--strict",
                "--steps",
                "20",
                "--prompts",
                str(train),
                "--prompts-per-step",
                "8",
                "--reward",
                f"{REWARDS}:addition",
                "--eval-prompts",
                str(held),
                "--eval-every",
                "10",
                "--no-token-rows",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps["mismatches"] == 0).all() and steps["sync_bit_equal"].all() and (steps["weights_changed"] > 0).all()
    assert steps["prompts_digest"].nunique() == 20 and steps["epoch"].eq(1).all()  # 160 questions, 8 fresh a step
    evals = pd.read_parquet(out / "eval.parquet")
    assert evals["step"].tolist() == [0, 10, 20] and (evals["prompts"] == 32).all()
    assert evals["accuracy"].isna().all()  # a user's reward: no notion of a right answer
    task = TaskReward(str(TRAINED))
    for step in evals["step"]:
        rows = pd.read_parquet(out / "eval" / f"step-{step:05d}.parquet")
        by_task = [task(p, c, step) for p, c in zip(rows["prompt_ids"], rows["completion_ids"], strict=True)]
        assert rows["reward"].tolist() == by_task  # the answer column reached the function, prompt by prompt
        assert evals.loc[evals["step"] == step, "reward_mean"].item() == pytest.approx(sum(by_task) / 32, abs=1e-12)
    record = json.loads((out / "run.json").read_text())
    assert record["eval"]["overlap_with_training"] == 0 and record["eval"]["source"] == str(held)
    assert cli.main(["gate", str(out)]) == EXIT_OK


@pytest.mark.engines
def test_the_tasks_own_training_and_held_out_questions_never_meet(tmp_path):
    out = tmp_path / "rl"
    assert (
        cli.main(
            [
                "rl",
                "--model",
                "qwen3-tiny-trained",
                "--reward",
                "task",
                "--strict",
                "--steps",
                "1",
                "--prompts-per-step",
                "4",
                "--group-size",
                "2",
                "--eval-every",
                "1",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    record = json.loads((out / "run.json").read_text())
    assert record["prompts"]["sequences"] == 9000 and record["eval"]["prompts"] == 64
    from alignaudit.inputs.checkpoint import resolve_model
    from alignaudit.inputs.prompts import text_batch
    from alignaudit.rl.step_prompts import StepPrompts, prompts_digest

    drawn = [questions(0, 0)[i] for i in StepPrompts(9000, 4, 0).next()[0]]  # the step's 4, as the loop draws them
    assert all(split_of(*_operands(q)) == "train" for q in drawn)
    ids = text_batch(resolve_model("qwen3-tiny-trained"), drawn, "drawn").sequences
    assert pd.read_parquet(out / "steps.parquet")["prompts_digest"].tolist() == [prompts_digest(ids)]
    task = TaskReward(str(TRAINED))
    evals = pd.read_parquet(out / "eval.parquet")
    assert evals["step"].tolist() == [0, 1]
    for step in (0, 1):
        rows = pd.read_parquet(out / "eval" / f"step-{step:05d}.parquet")
        asked = [task.operands(ids) for ids in rows["prompt_ids"]]
        assert all(split_of(*ab) == "held_out" for ab in asked) and len(set(asked)) == 64
        assert evals.loc[evals["step"] == step, "accuracy"].item() == rows["correct"].mean()
        assert rows["correct"].tolist() == [r == 1.0 for r in rows["reward"]]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eval-every", "5"], "--eval-every 5 scores held-out prompts, and none were given"),
        (
            ["--reward", "task", "--model", "qwen3-tiny-trained", "--eval-every", "-1"],
            "--eval-every -1: a number of steps",
        ),
        (
            ["--reward", "task", "--model", "qwen3-tiny-trained", "--eval-prompts", "{words}"],
            "--eval-prompts prompt 0 ('hello there') is not one",
        ),
        (
            [
                "--reward",
                f"{REWARDS}:even_fraction",
                "--model",
                "qwen3-tiny-trained",
                "--eval-prompts",
                "{step_column}",
            ],
            "the column 'step' has the name of an argument",
        ),
        (["--eval-prompts", "{missing}"], "cannot read prompt file"),
        (
            ["--reward", f"{REWARDS}:addition", "--model", "qwen3-tiny-trained"],  # built-in prompts: no answer column
            "addition cannot take TRL's reward arguments (missing a required argument: 'answer')",
        ),
        (
            ["--eval-prompts", "{plain}", "--eval-every", "5", "--steps", "5"],
            "--eval-every 5 with --steps 5: no evaluation falls between",
        ),
        (["--random-prompts", "3", "--prompts-per-step", "3"], "every step would take all of them, as 0 does"),
        (["--reward", f"{Path(__file__).with_name('exits_on_import.py')}:reward"], "called sys.exit(0)"),
        (["--eval-prompts", "{long}"], "--eval-prompts {long}: prompt 0 has 1100 tokens"),
    ],
)
def test_held_out_settings_that_cannot_take_effect_are_refused_before_any_engine(capsys, tmp_path, argv, message):
    files = {
        "words": tmp_path / "words.txt",
        "step_column": tmp_path / "s.jsonl",
        "missing": tmp_path / "none.jsonl",
        "long": tmp_path / "long.jsonl",
        "plain": tmp_path / "plain.txt",
    }
    files["plain"].write_text("1+2=\n")
    files["words"].write_text("hello there\n")
    files["long"].write_text(json.dumps({"token_ids": [5] * 1100}) + "\n")
    files["step_column"].write_text('{"text": "1+2=", "step": 3}\n')
    out = tmp_path / "o"
    named = {k: str(v) for k, v in files.items()}
    argv, message = [a.format(**named) for a in argv], message.format(**named)
    assert message in one_line_error(capsys, ["rl", *argv, "--out", str(out)], EXIT_USAGE)
    assert not (out / "run.json").exists()


def test_a_reward_file_changed_between_two_runs_runs_as_changed_and_is_recorded_as_run(tmp_path):
    """One process, two runs (alignaudit.api.rl): the reward file's code that runs is the code whose sha256 run.json
    records. Async rewards are awaited and bools read as 0 / 1, as TRL does; a reward too large to normalize, a
    partial that cannot take the call, and sys.exit inside the call are input errors."""
    import asyncio
    import functools
    import hashlib

    from alignaudit.rl.user_reward import UserReward, reward_name
    from helpers import FIXTURE

    path = tmp_path / "r.py"
    for value in (0.25, 0.75):
        path.write_text(f"def f(prompts, completions, **kwargs):\n    return [{value}] * len(completions)\n")
        reward = UserReward(f"{path}:f", str(FIXTURE))
        assert reward([[1]], [[2]], 1) == [value]
        assert reward.record()["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    async def later(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [True, False]

    assert UserReward(later, str(FIXTURE))([[1], [1]], [[2], [3]], 1) == [1.0, 0.0]
    with pytest.raises(InputError, match="must be a finite number of magnitude at most 1e\\+100"):
        UserReward(lambda prompts, completions, **k: [1.7e308], str(FIXTURE))([[1]], [[2]], 1)
    with pytest.raises(InputError, match="partial cannot take TRL's reward arguments"):
        UserReward(functools.partial(lambda a, b: 0, 1), str(FIXTURE)).check_call((), "prompts")
    with pytest.raises(InputError, match=r"called sys.exit\(3\) \(step 2\)"):
        UserReward(lambda **k: __import__("sys").exit(3), str(FIXTURE))([[1]], [[2]], 2, None, "step 2")

    @functools.wraps(later)
    def wrapped(*args, **kwargs):
        return later(*args, **kwargs)

    assert reward_name(wrapped).endswith(".later") and UserReward(wrapped, str(FIXTURE)).record()["file"] == __file__
