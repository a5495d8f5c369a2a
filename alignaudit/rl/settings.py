"""The settings of ``alignaudit rl``'s loop (alignaudit.rl.loop; the engines' are in the Request), and the checks
that refuse what the loop cannot run with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from alignaudit.errors import InputError
from alignaudit.rl.reward import REWARD_NAMES
from alignaudit.rl.user_reward import is_user_reward


@dataclass(frozen=True)
class RLSettings:
    """The loop's own settings (the engines' are in the Request).

    Attributes:
        steps: GRPO steps (>= 1). lr: Adam learning rate (>= 0; 0 = the sync control). group_size:
        completions per prompt (>= 2). clip_grad: max global grad norm. token_rows: write per-token rows.
        reward: a name in grpo.REWARDS, "task" (alignaudit.rl.task: the addition task's correctness), or a user's
        function as MODULE:FUNCTION (alignaudit.rl.user_reward: TRL's reward-function convention), or
        (alignaudit.api.rl) the function itself.
        kl_coef: weight of the k3 KL to the starting weights (alignaudit.training.losses.kl_k3; 0: none).
        log_to: where else every step row goes (alignaudit.rl.export.SINKS: "tensorboard", "wandb").
        full_vocab: per step, the full-vocabulary divergence of the trainer's rescoring rows from the rollout
        engine's decode rows at every generated token (comparison.vocab.step_columns). keep_vocab_rows: keep those
        rows in vocab/ (4 x V bytes per generated token per side; otherwise deleted after each step).
        sleep_level: vLLM's sleep level between steps (0: none). max_seconds: stop after the step during which
        this many seconds (wall clock, from run_rl's start, the engines' start-up included) have passed, and close
        the run as a finished one, run.json ``stopped`` saying so (0: run every step); the engines' shutdown comes
        after it, so a hard deadline needs that margin too. prompts_per_step: draw this many of the prompts each step
        (StepPrompts: a seeded shuffle, epoch after epoch; 0: every prompt every step). eval_every: score the held-out
        prompts after every this many steps (alignaudit.rl.evaluation; 0: before the first and after the last only,
        where there are held-out prompts). eval_prompts: the --eval-prompts file (None: none, or the task's own).
    """

    steps: int = 10
    lr: float = 1e-4
    group_size: int = 4
    clip_grad: float = 1.0
    token_rows: bool = True
    reward: str | Callable = "rotating-hash"
    kl_coef: float = 0.0
    log_to: tuple[str, ...] = ()
    full_vocab: bool = False
    keep_vocab_rows: bool = False
    sleep_level: int = 0
    max_seconds: float = 0.0
    prompts_per_step: int = 0
    eval_every: int = 0
    eval_prompts: str | None = None

    def check(self) -> None:
        """Raises InputError for a setting the loop cannot run with (a --log-to library not installed included)."""
        from alignaudit.rl.export import check_sinks

        check_sinks(tuple(self.log_to))
        if self.keep_vocab_rows and not self.full_vocab:
            raise InputError(
                "--keep-vocab-rows keeps the rows --full-vocab records; add --full-vocab or drop --keep-vocab-rows"
            )
        if self.steps < 1:
            raise InputError(f"--steps {self.steps}: run at least one step")
        if (
            isinstance(self.prompts_per_step, bool)
            or not isinstance(self.prompts_per_step, int)
            or self.prompts_per_step < 0
        ):
            raise InputError(
                f"--prompts-per-step {self.prompts_per_step!r}: a count of prompts >= 1 (0: all of them every step)"
            )
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise InputError(
                f"--eval-every {self.eval_every!r}: a number of steps >= 1 (0: evaluate only before the "
                "first step and after the last)"
            )
        if self.sleep_level not in (0, 1):
            raise InputError(
                f"--sleep-level {self.sleep_level}: 1 (weights to host memory, KV cache freed) or 0 (no "
                "sleep); level 2 (weights discarded) is not built yet"
            )
        if self.group_size < 2:
            raise InputError(f"--group-size {self.group_size}: GRPO normalizes rewards within a group; use 2 or more")
        if not is_user_reward(self.reward) and self.reward not in REWARD_NAMES:
            raise InputError(
                f"--reward {self.reward}: not a reward; choose one of {', '.join(REWARD_NAMES)}, or "
                "your own function as MODULE:FUNCTION (rewards.py:my_reward)"
            )
        if not (self.kl_coef >= 0 and math.isfinite(self.kl_coef)):
            raise InputError(f"--kl-coef {self.kl_coef}: the KL weight must be finite and >= 0 (0: no KL term)")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise InputError(
                f"--lr {self.lr}: the learning rate must be finite and >= 0 (0 keeps the weights: the sync control)"
            )
        if not (self.max_seconds >= 0 and math.isfinite(self.max_seconds)):
            raise InputError(f"--max-seconds {self.max_seconds:g}: a time in seconds, finite and >= 0 (0: no limit)")
        if self.kl_coef > 0 and self.lr == 0:
            raise InputError(
                f"--kl-coef {self.kl_coef} with --lr 0: the weights never leave the reference, so the KL "
                f"term is 0 at every step; drop --kl-coef for the sync control"
            )
