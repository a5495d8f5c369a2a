"""compare --repeat: each engine again on the same token ids, in one process, alone and among fillers."""

from __future__ import annotations

import json

import pytest
import torch

from alignaudit.errors import EXIT_OK
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.workers.repeats import compare_repeat, repeat_batches
from helpers import one_line_error, run_in_process

pytestmark = pytest.mark.engines


def test_repeat_batches_keep_each_audited_sequence_whole_and_move_it():
    batch = TokenBatch(((1, 2, 3), (4, 5), (6, 7, 8, 9)), (None,) * 3, "ids")
    repeats = repeat_batches(batch, 4, vocab_size=50, seed=0)
    assert [r.kind for r in repeats] == ["same batch", "among fillers", "among fillers"]
    assert repeats[0].batch == batch and repeats[0].rows == (0, 1, 2)
    for r in repeats[1:]:
        assert len(r.batch.sequences) == 6
        assert [r.batch.sequences[row] for row in r.rows] == list(batch.sequences)
        fillers = [s for i, s in enumerate(r.batch.sequences) if i not in r.rows]
        assert all(len(f) in (2, 3, 4) and all(0 <= t < 50 for t in f) for f in fillers)
    assert repeats[1].rows != repeats[2].rows or repeats[1].batch != repeats[2].batch
    assert repeat_batches(batch, 4, 50, seed=0) == repeats  # seeded


def test_compare_repeat_counts_bit_differences():
    first = [torch.tensor([-1.0, -2.0]), torch.tensor([float("nan")])]
    again = [
        torch.tensor([-1.0, torch.nextafter(torch.tensor(-2.0), torch.tensor(0.0)).item()]),
        torch.tensor([float("nan")]),
    ]
    assert compare_repeat(first, again) == {"tokens": 3, "mismatches": 1, "ulp_max": 1}


def test_strict_engines_agree_with_themselves_in_any_batch(tmp_path, capsys, monkeypatch):
    """hf and vLLM under --strict: 3 runs each (the first, the same batch again, the prompts among random
    fillers): every repeat bit-equal to the first run, and the two engines equal."""
    out = tmp_path / "r"
    proc = run_in_process(
        capsys,
        monkeypatch,
        "compare",
        "--train",
        "hf",
        "--infer",
        "vllm",
        "--strict",
        "--repeat",
        "3",
        "--out",
        str(out),
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mismatches"] == 0
    for role in ("train", "infer"):
        r = summary["repeats"][role]
        assert (r["runs"], r["tokens"], r["repeats_differing"], r["mismatches"]) == (3, 176, 0, 0)
        assert [p["kind"] for p in r["per_repeat"]] == ["same batch", "among fillers"]
        assert r["per_repeat"][1]["batch_size"] == 8
    assert "infer engine, 3 runs" in proc.stdout


def test_repeat_is_refused_in_rollout_mode_and_below_one(capsys, tmp_path):
    assert "use it in prompt mode" in one_line_error(
        capsys, ["compare", "--repeat", "2", "--mode", "rollout", "--out", str(tmp_path / "a")], 2
    )
    assert "1 or more" in one_line_error(capsys, ["compare", "--repeat", "0", "--out", str(tmp_path / "b")], 2)
