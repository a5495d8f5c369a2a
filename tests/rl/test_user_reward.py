"""rl --reward MODULE:FUNCTION: the user's reward function, called as TRL calls one (alignaudit.rl.user_reward).

A function from a file in tests/ (tests/rl/user_rewards.py: even_fraction, the fraction of even token ids of each
completion, asserting the arguments arrive as TRL passes them) rewards 2 strict GRPO steps on the fixture: every
token bitwise equal, each step's reward_mean the mean of the function's values over that step's completions
(recomputed from the token rows), run.json naming the function, its file and the file's sha256. Refused before any
engine starts: a module that cannot be imported, a missing or non-callable name, a function without TRL's keywords;
at the step, a wrong number of rewards or a non-finite one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE, InputError
from helpers import FIXTURE, one_line_error

pytestmark = pytest.mark.engines
REWARDS = Path(__file__).with_name("user_rewards.py")


def test_a_users_reward_function_rewards_strict_steps(tmp_path):
    out = tmp_path / "rl"
    assert (
        cli.main(
            [
                "rl",
                "--strict",
                "--steps",
                "2",
                "--lr",
                "1e-3",
                "--reward",
                f"{REWARDS}:even_fraction",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps["mismatches"] == 0).all() and steps["sync_bit_equal"].all()
    for step in steps["step"]:
        tokens = pd.read_parquet(out / "tokens" / f"step-{step:05d}.parquet")
        generated = tokens[tokens["generated"]]
        by_hand = generated.groupby("seq")["token_id"].apply(lambda ids: (ids % 2 == 0).mean()).mean()
        assert steps.loc[steps["step"] == step, "reward_mean"].item() == pytest.approx(by_hand, abs=1e-12)
    record = json.loads((out / "run.json").read_text())["reward_function"]
    assert record == {
        "function": f"{REWARDS}:even_fraction",
        "file": str(REWARDS),
        "sha256": hashlib.sha256(REWARDS.read_bytes()).hexdigest(),
    }


@pytest.mark.parametrize(
    "reward, message",
    [
        ("nowhere.py:f", "--reward nowhere.py:f: no file nowhere.py"),
        ("no_such_module_xyz:f", "importing no_such_module_xyz failed: ModuleNotFoundError"),
        (f"{REWARDS}:missing", "has no missing"),
        (f"{REWARDS}:NOT_CALLABLE", "NOT_CALLABLE is not a function but int 3"),
        (f"{REWARDS}:no_keywords", "no_keywords cannot take TRL's reward arguments"),
        (":f", "give MODULE:FUNCTION"),
    ],
)
def test_a_reward_that_cannot_be_called_is_refused_before_any_engine(capsys, tmp_path, reward, message):
    out = tmp_path / "o"
    assert message in one_line_error(capsys, ["rl", "--reward", reward, "--out", str(out)], EXIT_USAGE)
    assert not (out / "run.json").exists()


def test_a_reward_that_returns_no_reward_per_completion_is_an_input_error():
    from alignaudit.rl.user_reward import UserReward

    for name, message in (
        ("one_short", "returned 1 rewards for 2 completions"),
        ("not_a_number", "returned nan for completion 0; every reward must be a finite number"),
    ):
        reward = UserReward(f"{REWARDS}:{name}", str(FIXTURE))
        with pytest.raises(InputError, match=message):
            reward([[1, 2], [3]], [[4, 5], [6]], 1)
    assert UserReward(f"{REWARDS}:even_fraction", str(FIXTURE))([[1, 2], [3]], [[4, 5], [6]], 1) == [0.5, 1.0]


def test_prompts_are_drawn_step_by_step_epoch_after_epoch(tmp_path, capsys):
    """--prompts-per-step 2 of 6 random prompts over 4 strict steps: each step's prompts are 2 of them (read back from
    the token rows), the first 3 steps cover all 6 once (epoch 1), the 4th starts epoch 2; every token bitwise equal.
    More per step than prompts is refused before any engine starts."""
    out = tmp_path / "rl"
    assert (
        cli.main(
            [
                "rl",
                "--strict",
                "--steps",
                "4",
                "--lr",
                "1e-3",
                "--random-prompts",
                "6",
                "--prompt-len",
                "8",
                "--group-size",
                "2",
                "--prompts-per-step",
                "2",
                "--max-new-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps["mismatches"] == 0).all() and steps["epoch"].tolist() == [1, 1, 1, 2]
    assert steps["prompts_digest"].nunique() == 4
    from alignaudit.inputs.checkpoint import resolve_model
    from alignaudit.inputs.prompts import load_prompts
    from alignaudit.rl.step_prompts import prompts_digest

    pool = load_prompts(resolve_model("qwen3-tiny"), random_prompts=6, prompt_len=8, seed=0, reserve=4).sequences
    by_digest = {prompts_digest([a, b]): {a, b} for a in pool for b in pool if a != b}
    drawn = [by_digest[d] for d in steps["prompts_digest"]]  # each step: 2 distinct prompts of the 6
    assert set().union(*drawn[:3]) == set(pool)  # epoch 1: every prompt once
    for step in steps["step"]:  # 2 prompts x 2 completions a step
        assert pd.read_parquet(out / "tokens" / f"step-{step:05d}.parquet")["seq"].nunique() == 4
    err = one_line_error(
        capsys, ["rl", "--random-prompts", "3", "--prompts-per-step", "4", "--out", str(tmp_path / "o")], EXIT_USAGE
    )
    assert "--prompts-per-step 4: there are 3 prompts" in err
