"""What every function of the API checks its arguments with: the CLI's own checks (alignaudit.pipelines.requests),
their messages spelled with the API's argument names."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

from alignaudit.errors import InputError

API_NAMES = ("ops", "device='cuda'")  # how this module's user spells the strict ops and a CUDA device


def settings(dtype: str, device: str, ops: str, exp: str | None, spec, seed: int = 0):
    """EngineSettings for a strict model of ``spec`` built in this process for the caller's trainer, validated
    as the CLI validates them (the kernel switches as for a run that trains)."""
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.inputs.strict_ops import (
        check_kernel_switches,
        check_strict_exp,
        format_strict,
        parse_strict,
    )
    from alignaudit.pipelines.requests import check_dtype, resolve_device

    device = resolve_device(device)
    strict = parse_strict(ops, option="ops")
    if not strict:
        raise InputError(
            f"ops {ops!r} selects no strict op, so the model would not be strict; pass 'all' or a comma "
            "list of alignaudit.inputs.strict_ops.STRICT_OPS"
        )
    check_kernel_switches(strict, bool(spec.num_experts), True, device, API_NAMES)
    return EngineSettings(
        check_dtype(dtype),
        device,
        seed,
        {},
        strict=format_strict(strict),
        strict_exp=check_strict_exp(exp, strict, device, ("exp", *API_NAMES)),
    )


def check_number(name: str, value, expected: str = "a number") -> None:
    """Refuse a value that is not a real number (bool, str, None, ...). Raises InputError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} {value!r}: {expected}")
    try:
        float(value)
    except OverflowError:
        raise InputError(f"{name} {value!r:.40}: {expected} a float can hold") from None


def spec_of(model: str | Path, random_weights: bool, seed: int = 0):
    from alignaudit.inputs.checkpoint import resolve_model

    return resolve_model(str(model), random_weights=random_weights, seed=seed)


# CLI flags whose compare() argument is not the flag's own name with underscores
FLAG_ARGUMENTS = {
    "--train-opt": "train_options",
    "--infer-opt": "infer_options",
    "--ignore-eos": "stop_at_eos=False",
    "--no-prompt-logprobs": "prompt_logprobs=False",
}


@contextmanager
def argument_names(function):
    """Re-raise the request builder's InputError (written for the CLI) with ``function``'s argument names in place of
    the CLI's flags: ``--max-new-tokens`` -> ``max_new_tokens``, ``--infer-opt`` -> ``infer_options``."""
    import inspect

    try:
        yield
    except InputError as e:
        names = set(inspect.signature(function).parameters)

        def spell(match: re.Match) -> str:
            flag = match.group(0)
            name = flag[2:].replace("-", "_")
            return FLAG_ARGUMENTS.get(flag, name if name in names else flag)

        raise InputError(re.sub(r"--[a-z][a-z0-9-]*", spell, str(e))) from e
