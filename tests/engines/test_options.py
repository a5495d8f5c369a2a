"""Engine option values against the engines' declared field types (alignaudit.engines.base)."""

from __future__ import annotations

import typing

import pytest

from alignaudit.engines.base import reject_unknown, reject_wrong_types, value_fits
from alignaudit.errors import EXIT_USAGE, InputError
from alignaudit.inputs.request import parse_options
from helpers import one_line_error


@pytest.mark.parametrize(
    "value, annotation, fits",
    [
        (True, bool, True),
        (1, bool, False),
        ("maybe", bool, False),
        (4, int, True),
        (True, int, False),
        (4.0, int, False),
        ("abc", int | None, False),
        (None, int | None, True),
        (4, float, True),
        (0.5, float, True),
        (False, float, False),
        ("eager", str, True),
        (3, str, False),
        ("raw_logprobs", typing.Literal["raw_logits", "raw_logprobs"], True),
        ("foo", typing.Literal["raw_logits", "raw_logprobs"], False),
        (4, typing.Optional[int], True),
        ({"custom_ops": ["none"]}, dict, None),  # not a type this check understands: the engine judges it
        ({"custom_ops": ["none"]}, dict | None, None),
        ("x", typing.Callable, None),
    ],
)
def test_value_fits(value, annotation, fits):
    assert value_fits(value, annotation) is fits


def test_options_parse_as_json_then_fit():
    options = parse_options(["enforce_eager=true", "max_num_seqs=8", "temperature=0.5", 'mode="4"'])
    reject_wrong_types(
        "vllm", options, {"enforce_eager": bool, "max_num_seqs": int | None, "temperature": float, "mode": str}
    )
    with pytest.raises(InputError, match=r"option max_num_seqs='abc': vllm expects an integer or null"):
        reject_wrong_types("vllm", parse_options(["max_num_seqs=abc"]), {"max_num_seqs": int | None})


def test_unknown_key_suggests_the_nearest_name():
    with pytest.raises(InputError, match=r"max_num_seqz \(did you mean max_num_seqs\?\)"):
        reject_unknown("vllm", {"max_num_seqz": 4}, {"max_num_seqs", "max_model_len"}, "see docs")


def test_wrong_type_on_megatron_fails_before_any_engine_runs(capsys, tmp_path):
    """A non-empty string would be truthy inside TransformerConfig: it must be refused, not recorded."""
    out = tmp_path / "run"
    err = one_line_error(capsys, ["compare", "--train-opt", "deterministic_mode=maybe", "--out", str(out)], EXIT_USAGE)
    assert "option deterministic_mode='maybe': megatron expects true or false" in err
    assert not out.exists()
