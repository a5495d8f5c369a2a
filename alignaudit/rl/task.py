"""The addition task: fixtures/qwen3-tiny-trained learned it, ``alignaudit rl --reward task`` rewards it.

A question is ``"{a}+{b}="`` with a, b in [0, 100) (fixtures/corpus.txt's tokenizer spells every digit, ``+`` and
``=`` as one token each), its answer the decimal digits of a + b, then EOS. Verifiable from the token ids alone:

    reward 1.0   the completion is the answer's digits, then EOS;
           0.1   a well-formed wrong answer: one to three digits, then EOS (the format term, so that a policy
                 that stops rambling is told so before it adds correctly);
           0.0   anything else (no EOS within the completion, or other tokens).

The 10,000 questions are split once, for every run alike: HELD_OUT_PAIRS (1,000 of them, a sample seeded by
SPLIT_SEED) are the held-out set rl evaluates on (``--eval-every``), the other 9,000 the training set its rollouts
draw from; ``questions`` draws from one side only, so the two never meet.
"""

from __future__ import annotations

import functools
import random
import re

from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import eos_ids

QUESTION = re.compile(r"(\d{1,2})\+(\d{1,2})=$")
FORMAT_REWARD = 0.1
DEFAULT_QUESTIONS = 8  # rl --reward task without --prompts-per-step: the same 8 questions every step
EVAL_QUESTIONS = 64  # rl --reward task --eval-every K without --eval-prompts: this many held-out questions
PAIRS = 100 * 100  # (a, b) with a, b in [0, 100), numbered a * 100 + b
HELD_OUT_SIZE, SPLIT_SEED = 1000, 20261207
SPLITS = ("train", "held_out")


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    return str(a + b)


def operands(rng: random.Random) -> tuple[int, int]:
    """One question's operands, each uniform in [0, 100)."""
    return rng.randrange(100), rng.randrange(100)


@functools.cache
def held_out_pairs() -> frozenset[int]:
    """The held-out questions' pairs (a * 100 + b): HELD_OUT_SIZE of the PAIRS, ``random.Random(SPLIT_SEED).sample``
    (Python's Mersenne Twister, the same on every machine and Python 3 version)."""
    return frozenset(random.Random(SPLIT_SEED).sample(range(PAIRS), HELD_OUT_SIZE))


def split_of(a: int, b: int) -> str:
    """ "held_out" or "train": the side of the split the question a+b= is on."""
    return "held_out" if a * 100 + b in held_out_pairs() else "train"


def split_pairs(split: str) -> list[int]:
    """Every pair of ``split`` ("train": 9,000, "held_out": 1,000), ascending. Raises ValueError for another name."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: one of {SPLITS}")
    held = held_out_pairs()
    return [p for p in range(PAIRS) if (p in held) == (split == "held_out")]


def questions(n: int, seed: int, split: str = "train") -> list[str]:
    """``n`` distinct questions of ``split``, a sample drawn with Python's ``random.Random(seed)``; ``n`` 0: all of
    them, in that seed's shuffled order. (The trained fixture learned the task from every pair:
    fixtures/train_task_fixture.py; the split is rl's, between its training and held-out questions.)

    Raises:
        InputError: more questions asked than ``split`` holds."""
    pairs = split_pairs(split)
    if n > len(pairs):
        raise InputError(f"the task's {split} set holds {len(pairs)} questions; ask for at most that many")
    return [question(*divmod(p, 100)) for p in random.Random(seed).sample(pairs, n or len(pairs))]


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
            raise InputError(
                f"--reward task decodes completions with the model's tokenizer, and {why}; use a "
                "checkpoint with one, e.g. --model qwen3-tiny-trained"
            )
        self.eos_ids = eos_ids(model_dir)

    def _decode(self, ids) -> str:
        from alignaudit.reports.token_text import decode

        return decode(self.tokenizer, ids)

    def operands(self, prompt_ids) -> tuple[int, int] | None:
        match = QUESTION.search(self._decode(prompt_ids))
        return (int(match.group(1)), int(match.group(2))) if match else None

    def check_prompts(self, prompts, held_out: bool = False) -> None:
        """Refuse prompts (token id sequences) that do not end in a question (``held_out``: rl's --eval-prompts)."""
        for i, ids in enumerate(prompts):
            if self.operands(ids) is None:
                text = self._decode(ids)[-30:]
                shown = ascii(text) if text.isprintable() else f"token ids ending {list(ids)[-6:]}"
                what, fix = (
                    (
                        "--eval-prompts prompt",
                        "give a file of questions, or drop --eval-prompts (--eval-every "
                        "then scores the task's own held-out questions)",
                    )
                    if held_out
                    else (
                        "prompt",
                        "drop --prompts / --random-prompts (rl then asks the task's own questions) or "
                        "choose another --reward",
                    )
                )
                raise InputError(
                    f"--reward task scores addition questions such as '37+45='; {what} {i} ({shown}) is not one: {fix}"
                )

    def __call__(self, prompt_ids, completion_ids, step: int) -> float:
        ab = self.operands(prompt_ids)
        ids = list(completion_ids)
        if ab is None or not ids or ids[-1] not in self.eos_ids:
            return 0.0
        text = self._decode(ids[:-1])
        if text == answer(*ab):
            return 1.0
        return FORMAT_REWARD if re.fullmatch(r"\d{1,3}", text) else 0.0
