"""One reading of every JSON a user hands alignaudit (inputs/values.parse_json), from each entry point: a prompt file,
a rollout file, an engine option, a baseline verdict and a checkpoint's config.json. An object with a repeated key
is refused, never read as its last value; JSON nested too deeply or an integer too long for Python is an input
error, not a crash (RecursionError, ValueError)."""

from __future__ import annotations

import json
import shutil

import pytest

from alignaudit.comparison.gate import read_baseline
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import load_spec
from alignaudit.inputs.prompts import load_prompts
from alignaudit.inputs.request import parse_options
from alignaudit.inputs.rollouts import read_rollouts
from alignaudit.inputs.values import parse_json
from helpers import FIXTURE

REPEATED = '{"token_ids": [5, 6], "token_ids": [7, 8]}'
DEEP = "[" * 100_000 + "]" * 100_000
LONG = '{"token_ids": [' + "9" * 5000 + "]}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (REPEATED, "key 'token_ids' appears twice"),
        (DEEP, "JSON nested too deeply"),
        (LONG, "not readable JSON"),
        ("{", "not valid JSON"),
    ],
)
def test_parse_json_refuses_what_it_cannot_read_one_way(text, says):
    with pytest.raises(InputError, match=f"^here: {says}"):
        parse_json(text, "here")
    assert parse_json('{"a": {"a": 1}}', "here") == {"a": {"a": 1}}  # one key per object: nested repeats are fine


def test_every_entry_point_reads_json_one_way(tiny_spec, tmp_path):
    prompts = tmp_path / "p.jsonl"
    for text in (REPEATED, DEEP, LONG):
        prompts.write_text(text + "\n")
        with pytest.raises(InputError, match=r"p.jsonl:1: "):
            load_prompts(tiny_spec, prompts)
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text(
        '{"token_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-1.0, -2.0], "logprobs": [-1.0, -1.0]}\n'
    )
    with pytest.raises(InputError, match="r.jsonl:1: key 'logprobs' appears twice"):
        read_rollouts(rollouts, tiny_spec.vocab_size)
    with pytest.raises(InputError, match="option stop_token_ids: key 'a' appears twice"):
        parse_options(['stop_token_ids={"a": 1, "a": 2}'])
    assert parse_options(["enforce_eager=true", "model=/ckpt/x", f"x={'[' * 5000}"])["model"] == "/ckpt/x"
    with pytest.raises(InputError, match="option n: not readable JSON"):
        parse_options(["n=" + "1" * 5000])
    baseline = tmp_path / "verdict.json"
    baseline.write_text('{"mismatches": 9, "ulp_max": 1, "max_abs_diff": 0.0, "mismatches": 0}')
    with pytest.raises(InputError, match="key 'mismatches' appears twice"):
        read_baseline(baseline)
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(config.replace("{", '{"num_hidden_layers": 99,', 1))
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] != 99  # json.loads keeps the last
    with pytest.raises(InputError, match="key 'num_hidden_layers' appears twice"):
        load_spec(model)
