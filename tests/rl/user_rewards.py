"""Reward functions written the way TRL users write them (trl/trainer/grpo_trainer.py calls each with prompts,
completions and keyword arguments), for tests/rl/test_user_reward.py."""


def even_fraction(prompts, completions, **kwargs):
    """The fraction of even token ids of each completion; checks that TRL's arguments arrive as TRL passes them."""
    assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
    assert len(prompts) == len(completions) == len(kwargs["completion_ids"]) == len(kwargs["prompt_ids"])
    assert isinstance(kwargs["step"], int)
    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in kwargs["completion_ids"]]


def one_short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def not_a_number(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def no_keywords(prompts, completions):
    return [0.0] * len(completions)


NOT_CALLABLE = 3


def addition(prompts, completions, answer, completion_ids, **kwargs):
    """The addition task's reward as a TRL user writes one for a dataset with an ``answer`` column: 1.0 for the answer
    then EOS (id 0 in the fixture's tokenizer), 0.1 for another number of at most three digits then EOS, else 0."""
    import re

    rewards = []
    for text, expected, ids in zip(completions, answer, completion_ids, strict=True):
        ended = bool(ids) and ids[-1] == 0
        rewards.append(1.0 if ended and text == expected else 0.1 if ended and re.fullmatch(r"\d{1,3}", text) else 0.0)
    return rewards


def mutating(prompts, completions, prompt_ids, completion_ids, **kwargs):
    """Changes every argument it is given, then rewards 0.5: what the run records must not change with it."""
    for ids in (*prompt_ids, *completion_ids):
        ids.clear()
    for values in kwargs.values():
        if isinstance(values, list):
            values.clear()
    return [0.5] * len(completions)


def raising(prompts, completions, **kwargs):
    raise KeyError("answer")


class Scorer:
    """A callable object, as reward classes are written."""

    def __call__(self, prompts, completions, **kwargs):
        return [1.0] * len(completions)


SCORER = Scorer()
PARTIAL = __import__("functools").partial(even_fraction)
