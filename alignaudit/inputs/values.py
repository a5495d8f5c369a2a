"""The ranges of values every entry point takes, checked in one place: a file record (rescore), an API argument
(alignaudit.api), a trainer hook (integrations). Each check raises InputError naming where the value came from."""

from __future__ import annotations

import json

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
        raise InputError(
            f"{source}: every logprob is >= 0: these are negative log-likelihoods (-logprob), not logprobs; negate them"
        )
    row = next(i for i, lp in enumerate(logprobs) if bool((lp > 0).any()))
    j = int(torch.nonzero(logprobs[row] > 0)[0])
    raise InputError(
        f"{source}: {where[row]}: logprob {j} is {float(logprobs[row][j])!r}, above 0, which no log-probability is"
    )


def parse_json(text: str | bytes, source: str):
    """``text`` parsed as JSON, read one way only: an object with a repeated key is refused (json.loads would keep
    the last value silently), and nesting too deep for the parser or an integer too long for Python (over 4300
    digits) is an input error, not a crash.

    Args:
        source: where the text came from, for the message (``path:line``, an option).
    Raises:
        InputError: not JSON, a repeated key, too deep, or an integer too long; naming ``source``.
    """

    def unique(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise InputError(
                    f"{source}: key {key!r} appears twice in one object; which value is meant is ambiguous: keep one"
                )
            seen.add(key)
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise InputError(f"{source}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise InputError(f"{source}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer past sys.get_int_max_str_digits, or bytes that are not UTF-8
        raise InputError(f"{source}: not readable JSON ({str(e).splitlines()[0]})") from None


def check_weight(where: str, tensor) -> None:
    """Refuse a weight an engine cannot hold as given: not a tensor, a meta tensor (no values), a quantized or sparse
    one (torch's quantized and sparse layouts: byte views of them crash the process, and no engine loads them as
    weights), or one of a dtype that is no real floating point.

    Raises:
        InputError: naming ``where`` (e.g. ``weights['model.norm.weight']``) and what it is.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"{where} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_meta:
        raise InputError(f"{where} is a meta tensor (no values); give the weights themselves")
    if tensor.is_quantized or tensor.layout != torch.strided:
        kind = "quantized" if tensor.is_quantized else f"{tensor.layout} (sparse)"
        raise InputError(f"{where} is {kind}; give the dense weights in a floating dtype (bf16, fp16, fp32)")
    if not tensor.is_floating_point():
        raise InputError(f"{where} is {tensor.dtype}; give the values in a floating dtype (bf16, fp16, fp32)")
