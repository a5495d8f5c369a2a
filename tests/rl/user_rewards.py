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
