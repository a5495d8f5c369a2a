"""summary.json's schema (alignaudit.comparison.summary) holds what is written: summarize's own record on a real token
table, and every ``summary["key"] = ...`` in alignaudit (read with ast, so a new field cannot skip the schema)."""

from __future__ import annotations

import ast
import typing

import numpy as np
import pandas as pd

from alignaudit.comparison.summary import RLImpact, SideCounts, Summary, TokenSummary
from alignaudit.comparison.token_diff import compare_tokens, summarize
from helpers import ROOT


def _tokens(generated: np.ndarray) -> pd.DataFrame:
    n = len(generated)
    return compare_tokens(pd.DataFrame({
        "seq": np.repeat([0, 1], n // 2).astype(np.int32), "pos": np.tile(np.arange(1, n // 2 + 1), 2),
        "token_id": np.zeros(n, dtype=np.int32), "generated": generated,
        "lp_train": np.linspace(-3, -1, n).astype(np.float32),
        "lp_infer": np.linspace(-3.5, -0.5, n).astype(np.float32),
    }))


def test_summarize_writes_exactly_the_schema():
    summary = summarize(_tokens(np.array([False, True, True, False, True, True])))
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
            if (isinstance(node, ast.Assign) and isinstance(target := node.targets[0], ast.Subscript)
                    and isinstance(target.value, ast.Name) and target.value.id == "summary"
                    and isinstance(target.slice, ast.Constant)):
                written.add(target.slice.value)
    assert {"routing", "routing_replay", "sides", "worst_sequences"} <= written  # the reader sees the writers
    assert written <= set(typing.get_type_hints(Summary))
