"""The addition task: fixtures/qwen3-tiny-trained learned it, ``alignaudit rl --reward task`` rewards it.

A question is ``"{a}+{b}="`` with a, b in [0, 100) (fixtures/corpus.txt's tokenizer spells every digit, ``+`` and
``=`` as one token each), its answer the decimal digits of a + b, then EOS. Verifiable from the token ids alone:

    reward 1.0   the completion is the answer's digits, then EOS;
           0.1   a well-formed wrong answer: one to three digits, then EOS (the format term, so that a policy
                 that stops rambling is told so before it adds correctly);
           0.0   anything else (no EOS within the completion, or other tokens).
"""

from __future__ import annotations

import random
import re

from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import eos_ids

QUESTION = re.compile(r"(\d{1,2})\+(\d{1,2})=$")
FORMAT_REWARD = 0.1
DEFAULT_QUESTIONS = 8


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)


def operands(rng: random.Random) -> tuple[int, int]:
    """One question's operands, each uniform in [0, 100)."""
    return rng.randrange(100), rng.randrange(100)


def questions(n: int, seed: int) -> list[str]:
    """``n`` questions drawn with Python's ``random.Random(seed)`` (the trained fixture's held-out questions use
    seeds its training script never draws from: fixtures/train_task_fixture.py)."""
    rng = random.Random(seed)
    return [question(*operands(rng)) for _ in range(n)]


class TaskReward:
    """The task's reward of a completion, from token ids, with the model's own tokenizer.

    Args:
        model_dir: a checkpoint directory with a tokenizer (read from disk by reports.token_text.load_tokenizer)
            and config.json (its ``eos_token_id``: an id or a list of ids, each ending a completion); both read once.
    Raises:
        InputError: a checkpoint without a readable tokenizer; (``check_prompts``) a prompt that is not a question.
    """

    def __init__(self, model_dir: str):
        from alignaudit.reports.token_text import load_tokenizer

        self.tokenizer, why = load_tokenizer(model_dir)
        if self.tokenizer is None:
            raise InputError(f"--reward task decodes completions with the model's tokenizer, and {why}; use a "
                             "checkpoint with one, e.g. --model qwen3-tiny-trained")
        self.eos_ids = eos_ids(model_dir)

    def _decode(self, ids) -> str:
        from alignaudit.reports.token_text import decode

        return decode(self.tokenizer, ids)

    def operands(self, prompt_ids) -> tuple[int, int] | None:
        match = QUESTION.search(self._decode(prompt_ids))
        return (int(match.group(1)), int(match.group(2))) if match else None

    def check_prompts(self, prompts) -> None:
        """Refuse prompts (token id sequences) that do not end in a question."""
        for i, ids in enumerate(prompts):
            if self.operands(ids) is None:
                text = self._decode(ids)[-30:]
                shown = ascii(text) if text.isprintable() else f"token ids ending {list(ids)[-6:]}"
                raise InputError(f"--reward task scores addition questions such as '37+45='; prompt {i} ({shown}) is "
                                 "not one: drop --prompts / --random-prompts (rl then asks the task's own questions) "
                                 "or choose another --reward")

    def __call__(self, prompt_ids, completion_ids, step: int) -> float:
        ab = self.operands(prompt_ids)
        ids = list(completion_ids)
        if ab is None or not ids or ids[-1] not in self.eos_ids:
            return 0.0
        text = self._decode(ids[:-1])
        if text == answer(*ab):
            return 1.0
        return FORMAT_REWARD if re.fullmatch(r"\d{1,3}", text) else 0.0
