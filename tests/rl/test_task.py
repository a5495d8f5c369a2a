"""The trained fixture (fixtures/qwen3-tiny-trained) and the addition task's reward (alignaudit.rl.task).

Chain: the fixture is qwen3-tiny trained on the task by fixtures/train_task_fixture.py, so its distributions are
peaked and it answers part of the questions. Strict rollouts of a model that has learned something stay bitwise
aligned with the trainer, and `alignaudit rl --reward task` on it raises the task reward while every step keeps 0
mismatching tokens and every sync bit-equal: alignment that holds while a policy really learns. The reward is a
pure function of token ids, checked here on hand-made completions.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, InputError
from alignaudit.inputs.checkpoint import fixtures_dir
from alignaudit.rl.task import FORMAT_REWARD, TaskReward, questions

TRAINED = fixtures_dir() / "qwen3-tiny-trained"
EOS = 0  # config.json eos_token_id


def ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TRAINED / "tokenizer.json")).encode(text).ids


def test_the_task_reward_of_hand_made_completions():
    reward = TaskReward(str(TRAINED))
    prompt = ids("37+45=")
    assert reward(prompt, ids("82") + [EOS], 1) == 1.0
    assert reward(prompt, ids("81") + [EOS], 1) == FORMAT_REWARD  # well-formed, wrong
    assert reward(prompt, ids("82"), 1) == 0.0  # no EOS: the answer never ended
    assert reward(prompt, ids("82+") + [EOS], 1) == 0.0 and reward(prompt, [EOS], 1) == 0.0
    assert reward(ids("What is two plus two?"), ids("4") + [EOS], 1) == 0.0
    assert questions(3, 0) == questions(3, 0) and len(set(questions(50, 0))) > 40  # seeded, varied
    with pytest.raises(InputError, match="prompt 1 .* is not one"):
        reward.check_prompts([ids("1+2="), ids("hello")])


@pytest.mark.engines
def test_the_trained_fixture_is_peaked_and_its_strict_rollout_is_bitwise_aligned(tmp_path):
    facts = json.loads((TRAINED / "training.json").read_text())
    assert 0.3 < facts["greedy_accuracy"] < 0.9  # part of the task, not all of it
    assert facts["median_sampled_token_probability_t1"] > 0.5
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compare",
                "--model",
                "qwen3-tiny-trained",
                "--strict",
                "--mode",
                "rollout",
                "--ignore-eos",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mismatches"] == 0 and summary["tokens_compared"] == 4 * 32
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert tokens.loc[tokens["generated"], "lp_infer"].mean() > -2.0  # the random fixture's average: -10.5


@pytest.mark.engines
def test_rl_on_the_task_raises_the_reward_with_every_step_aligned(tmp_path):
    out = tmp_path / "rl"
    assert (
        cli.main(
            [
                "rl",
                "--model",
                "qwen3-tiny-trained",
                "--reward",
                "task",
                "--steps",
                "20",
                "--strict",
                "--no-token-rows",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    s = pd.read_parquet(out / "steps.parquet")
    assert (s["mismatches"] == 0).all() and s["sync_bit_equal"].all() and (s["weights_changed"] > 0).all()
    assert s["reward_mean"].iloc[-5:].mean() > s["reward_mean"].iloc[:2].mean() + 0.2  # 0.58 -> 1.00 (AMD EPYC)
    assert (s["completions_ended_early"] == 32).all()  # 8 questions x 4: every answer ended at EOS
    record = json.loads((out / "run.json").read_text())
    assert record["prompts"]["source"] == "task(addition, training set: 8 questions, seed 0)"
