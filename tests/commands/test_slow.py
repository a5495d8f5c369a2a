"""Real-shape runs, opt-in (pytest --run-slow): minutes each on 2 CPU cores.

Qwen3-0.6B's exact shape with random weights (28 layers, hidden 1024, GQA 16/8, head_dim 128, tied
embeddings, vocab 151936): Megatron-Core and vLLM disagree on every token by default and agree bit for bit
under --strict.
"""

from __future__ import annotations

import json

import pytest

from alignaudit.commands import cli

pytestmark = pytest.mark.engines

ARGS = [
    "compare",
    "--model",
    "Qwen3-0.6B",
    "--random-weights",
    "--random-prompts",
    "2",
    "--prompt-len",
    "64",
    "--train",
    "megatron",
    "--infer",
    "vllm",
]


@pytest.mark.slow
@pytest.mark.parametrize("strict, expect_all_equal", [([], False), (["--strict"], True)])
def test_qwen3_0_6b_megatron_vs_vllm(tmp_path, strict, expect_all_equal):
    assert cli.main([*ARGS, *strict, "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_compared"] == 126
    if expect_all_equal:
        assert summary["mismatches"] == 0 and summary["ulp_max"] == 0
    else:
        assert summary["mismatches"] == 126
