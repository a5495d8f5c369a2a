"""The reward an rl run scores completions with, as one callable for the steps and the held-out evaluation alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from alignaudit.rl.grpo import REWARDS
from alignaudit.rl.user_reward import UserReward, is_user_reward

REWARD_NAMES = (*REWARDS, "task")


@dataclass(frozen=True)
class RunReward:
    """``reward(prompt_ids, completion_ids, step, columns)`` -> one float per completion.

    Attributes:
        score: a UserReward (one call a step, ``columns`` passed by name), or a function of one completion
            ``(prompt_ids, completion_ids, step) -> float`` (grpo.REWARDS, alignaudit.rl.task.TaskReward), which
            ignores ``columns``. decode: token ids -> text with the checkpoint's tokenizer (special tokens kept), or
            None where the checkpoint has none.
    """

    score: Callable
    decode: Callable | None

    def __call__(
        self, prompts: list, completions: list, step: int, columns: dict[str, list], during: str = ""
    ) -> list[float]:
        """One reward per completion; ``during`` names the call in a user's function's errors (UserReward)."""
        if isinstance(self.score, UserReward):
            return self.score(prompts, completions, step, columns, during)
        return [self.score(p, c, step) for p, c in zip(prompts, completions, strict=True)]


def reward_function(name: str | Callable, spec) -> RunReward:
    """The RunReward of ``--reward name``: grpo.REWARDS (from each completion alone), "task"
    (alignaudit.rl.task.TaskReward with ``spec``'s tokenizer), or a user's MODULE:FUNCTION
    (alignaudit.rl.user_reward.UserReward). Raises InputError as TaskReward and UserReward do."""
    from alignaudit.reports.token_text import decode, load_tokenizer

    score: Callable
    if callable(name) or is_user_reward(name):  # callable(): a function is a user's reward, and str is left
        score = UserReward(name, spec.path)
    elif name == "task":
        from alignaudit.rl.task import TaskReward

        score = TaskReward(spec.path)
    else:
        by_completion = REWARDS[name]

        def completion_score(prompt, completion, step):
            return by_completion(completion, step)

        score = completion_score

    tokenizer, _ = load_tokenizer(spec.path)
    return RunReward(score, (lambda ids: decode(tokenizer, ids)) if tokenizer is not None else None)
