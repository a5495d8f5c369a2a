"""The ranges of values every entry point takes, checked in one place: a file record (rescore), an API argument
(alignaudit.api), a trainer hook (integrations). Each check raises InputError naming where the value came from."""

from __future__ import annotations

import torch

from alignaudit.errors import InputError


def check_logprob_signs(source: str, logprobs: list[torch.Tensor], where: list[str]) -> None:
    """Refuse logprobs above 0 (+inf included): no log-probability is, and two equal such values would otherwise be
    counted as an agreement. A set whose values are all >= 0 with some > 0 holds negative log-likelihoods (a loss
    dump), which the message says. NaN and -inf pass: they are an engine's results, counted apart by the comparison.

    Args:
        source: what held them, for the message (a file path, an API argument's name).
        logprobs: one fp32 tensor per sequence. where: each sequence's name in the message.
    Raises:
        InputError: naming the source, the sequence and the first offending value.
    """
    values = torch.cat(logprobs) if logprobs else torch.zeros(0)
    if not bool((values > 0).any()):
        return
    if bool((values >= 0).all()):
        raise InputError(f"{source}: every logprob is >= 0: these are negative log-likelihoods (-logprob), not "
                         "logprobs; negate them")
    row = next(i for i, lp in enumerate(logprobs) if bool((lp > 0).any()))
    j = int(torch.nonzero(logprobs[row] > 0)[0])
    raise InputError(f"{source}: {where[row]}: logprob {j} is {float(logprobs[row][j])!r}, above 0, which no "
                     "log-probability is")
