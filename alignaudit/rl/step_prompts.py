"""Which prompts each step of ``alignaudit rl`` takes (--prompts-per-step: a seeded shuffle, epoch after epoch), and
the digest of a step's prompts that steps.parquet records."""

from __future__ import annotations

import json

from alignaudit.errors import InputError


class StepPrompts:
    """Which of ``count`` prompts each step takes (their indices): all of them every step (``per_step`` 0), or
    ``per_step`` of them a step in the order of a shuffle seeded by ``seed`` (Python's random.Random), a new shuffle
    each epoch, an epoch's last step taking the rest of it and the next epoch's first ones where the count does not
    divide them.

    Raises:
        InputError: per_step above the number of prompts.
    """

    def __init__(self, count: int, per_step: int, seed: int):
        import random

        self.count, self.rng = count, random.Random(seed)
        self.check(per_step, count)
        self.per_step = per_step or count
        self.order: list[int] = []
        self.epoch = 0

    @staticmethod
    def check(per_step: int, count: int) -> None:
        """Raises InputError where ``per_step`` exceeds the ``count`` of prompts, or equals it (every step would take
        every prompt, as 0 does: the setting would change nothing); rl_request calls it before any engine starts."""
        if per_step > count:
            raise InputError(f"--prompts-per-step {per_step}: there are {count} prompts; draw at most that many a step")
        if per_step == count > 0:
            raise InputError(
                f"--prompts-per-step {per_step}: there are {count} prompts, so every step would take all "
                "of them, as 0 does; draw fewer a step, or drop --prompts-per-step"
            )

    def _refill(self) -> None:
        if not self.order:
            order = list(range(self.count))
            if self.per_step < self.count:
                self.rng.shuffle(order)
            self.order, self.epoch = order, self.epoch + 1

    def peek(self) -> list[int]:
        """The next step's prompts, without drawing them."""
        self._refill()
        return self.order[: self.per_step]

    def next(self) -> tuple[list[int], int]:
        """(this step's prompts, the epoch they are drawn in, from 1)."""
        chosen: list[int] = []
        while len(chosen) < self.per_step:
            self._refill()
            take = min(self.per_step - len(chosen), len(self.order))
            chosen += self.order[:take]
            self.order = self.order[take:]
        return chosen, self.epoch


def prompts_digest(prompts) -> str:
    """sha256 of a step's prompts (their token ids, in order): steps.parquet's ``prompts_digest``."""
    import hashlib

    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()
