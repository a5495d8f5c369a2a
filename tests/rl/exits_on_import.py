"""A reward module that exits as it is imported (a script's code at module level): rl must refuse it, not exit."""

import sys

sys.exit(0)


def reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)
