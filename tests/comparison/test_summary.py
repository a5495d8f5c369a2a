"""summary.json's schema (alignaudit.comparison.summary) holds what is written: summarize's own record on a real token
table, and every ``summary["key"] = ...`` in alignaudit (read with ast, so a new field cannot skip the schema)."""

from __future__ import annotations

import ast
import typing

import numpy as np

from alignaudit.comparison.summary import RLImpact, SideCounts, Summary, TokenSummary
from alignaudit.comparison.token_diff import summarize
from helpers import ROOT, tokens_of


def test_summarize_writes_exactly_the_schema():
    summary = summarize(
        tokens_of(np.linspace(-3, -1, 6), np.linspace(-3.5, -0.5, 6), np.array([False, True, True, False, True, True]))
    )
    required = set(TokenSummary.__annotations__)
    assert set(summary) == required | {"worst_sequences", "generated"}
    assert set(summary) <= set(Summary.__annotations__) and Summary.__required_keys__ == frozenset(required)
    assert set(summary["generated"]) == required
    for record in (summary, summary["generated"]):
        assert set(record["rl"]) == set(RLImpact.__annotations__)
        assert set(record["nan_tokens"]) == set(SideCounts.__annotations__)
    assert summary["generated"]["tokens_compared"] == 4 and summary["tokens_compared"] == 6


def test_every_key_written_into_a_summary_is_in_the_schema():
    written = set()
    for file in (ROOT / "alignaudit").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if (
                isinstance(node, ast.Assign)
                and isinstance(target := node.targets[0], ast.Subscript)
                and isinstance(target.value, ast.Name)
                and target.value.id == "summary"
                and isinstance(target.slice, ast.Constant)
            ):
                written.add(target.slice.value)
    assert {"routing", "routing_replay", "sides", "worst_sequences"} <= written  # the reader sees the writers
    assert written <= set(typing.get_type_hints(Summary))


def test_captures_of_two_attention_kernels_say_so_in_the_verdict():
    """diff of a flash capture against a portable one: two algorithms, so the alignment section says why their bits
    differ; one kernel on both sides (or a side without strict attention, None) says nothing."""
    from alignaudit.pipelines.runs import attention_note
    from alignaudit.reports.views import summary_sections

    mixed = {"train": {"strict_attention": "flash"}, "infer": {"strict_attention": "portable"}}
    note = attention_note(mixed)
    assert note.startswith("strict attention ran the flash kernel in the train capture and the portable kernel")
    assert attention_note({"train": {"strict_attention": "flash"}, "infer": {"strict_attention": "flash"}}) is None
    assert attention_note({"train": {"strict_attention": "flash"}, "infer": {"strict_attention": None}}) is None
    from alignaudit.pipelines.runs import _attention_kernel

    # a capture made before the kernel was recorded: strict attention (an exp recorded) was the portable kernel
    assert _attention_kernel({"attention_exp": "portable"}) == "portable"
    assert _attention_kernel({"attention_exp": None}) is None
    assert _attention_kernel({"attention_exp": "portable", "attention_kernel": "flash"}) == "flash"
    alignment = summary_sections({"tokens_compared": 3, "mismatches": 3, "attention_note": note})[0]
    assert alignment.note == note
