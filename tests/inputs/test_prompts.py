"""Prompt sources: every engine gets the same ids, and bad prompt files fail with a clear message."""

from __future__ import annotations

import dataclasses
import json

import pytest

from alignaudit.errors import InputError
from alignaudit.inputs.prompts import BUILTIN_PROMPTS, load_prompts


def test_builtin_prompts_tokenize_once(tiny_spec):
    batch = load_prompts(tiny_spec)
    assert len(batch.sequences) == len(BUILTIN_PROMPTS) and batch.source == "builtin"
    assert sorted(len(s) for s in batch.sequences) == sorted(set(len(s) for s in batch.sequences))  # lengths differ
    assert batch.digest() == load_prompts(tiny_spec).digest()


def test_jsonl_text_and_ids_and_plain_text(tiny_spec, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"text": "What is two plus two?"}) + "\n\n" + json.dumps({"token_ids": [5, 6, 7]}) + "\n")
    batch = load_prompts(tiny_spec, f)
    assert batch.sequences[1] == (5, 6, 7) and batch.texts == ("What is two plus two?", None)
    plain = tmp_path / "p.txt"
    plain.write_text("What is two plus two?\n")
    assert load_prompts(tiny_spec, plain).sequences[0] == batch.sequences[0]


def test_random_prompts_are_seeded(tiny_spec):
    a = load_prompts(tiny_spec, random_prompts=3, prompt_len=17, seed=1)
    assert [len(s) for s in a.sequences] == [17] * 3
    assert a.sequences == load_prompts(tiny_spec, random_prompts=3, prompt_len=17, seed=1).sequences
    assert a.sequences != load_prompts(tiny_spec, random_prompts=3, prompt_len=17, seed=2).sequences


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty"),
        ('{"token_ids": [1, 2, 512]}', "token id 512 outside the vocabulary"),
        ('{"token_ids": [1, 2, -1]}', "token id -1 outside the vocabulary"),
        ('{"token_ids": [1]}', "at least 2 tokens"),
        ('{"token_ids": [1, "a"]}', "list of integers"),
        ('{"prompt": "x"}', 'expected {"text"'),
        ('{"text": ', "not valid JSON"),
    ],
)
def test_bad_prompt_files(tiny_spec, tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(InputError, match=message):
        load_prompts(tiny_spec, f)


def test_too_long_and_conflicting_sources(tiny_spec, tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"token_ids": [1] * 1025}))
    with pytest.raises(InputError, match="longer than the model's max length 1024"):
        load_prompts(tiny_spec, f)
    with pytest.raises(InputError, match="not both"):
        load_prompts(tiny_spec, f, random_prompts=2)
    with pytest.raises(InputError, match="cannot read"):
        load_prompts(tiny_spec, tmp_path / "missing.txt")


def test_text_prompts_need_a_tokenizer(tiny_spec):
    bare = dataclasses.replace(tiny_spec, has_tokenizer=False)
    with pytest.raises(InputError, match="--random-prompts"):
        load_prompts(bare)
    assert len(load_prompts(bare, random_prompts=1, prompt_len=4).sequences) == 1
