"""`alignaudit rl` with other engine setups than test_rl.py's runs (Megatron-Core training beside vLLM's offline
engine), each on a run of its own: HF as the trainer beside strict vLLM, and rollouts by vLLM's AsyncLLM, its model in
a process of its own (--engine-mode async).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK

pytestmark = [pytest.mark.engines, pytest.mark.long]


def test_hf_trainer_with_vllm_rollout_strict(tmp_path, monkeypatch):
    """HF trains strict beside strict vLLM, its strict ops' gradients by ALIGNAUDIT_BACKWARD=fused (attention through
    torch's SDPA backward; the megatron runs of test_rl.py keep the reference): the trainer's process reads the variable
    and run.json records it; gradients finite and non-zero, every token bitwise equal."""
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    out = tmp_path / "hf"
    assert (
        cli.main(
            [
                "rl",
                "--train",
                "hf",
                "--infer",
                "vllm",
                "--strict",
                "--steps",
                "2",
                "--lr",
                "1e-3",
                "--no-token-rows",
                "--full-vocab",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    s = pd.read_parquet(out / "steps.parquet")
    assert (s["mismatches"] == 0).all() and s["sync_bit_equal"].all() and s["weights_digest"].nunique() == 2
    # HF's strict rows (alignaudit_kernels.log_softmax) equal vLLM's strict sampler rows: every measure exactly 0
    assert (s["vocab_kl_train_infer_max"] == 0).all() and (s["vocab_tv_max"] == 0).all()
    assert (s["vocab_top1_agreement"] == 1).all() and not (out / "vocab").exists()
    assert (s["nan_tokens"] == 0).all() and (s["grad_norm"] > 0).all()  # HF's strict backward once gave NaN
    assert json.loads((out / "run.json").read_text())["engines"]["train"]["strict_backward"] == "fused"
    assert not (out / "tokens").exists()
    # without per-token rows the counts are steps.parquet's alone: every rendering of the verdict says so
    assert cli.main(["gate", str(out)]) == EXIT_OK
    note = "no per-token rows (--no-token-rows)"
    assert note in json.loads((out / "verdict.json").read_text())["notes"][0]
    assert note in (out / "summary.md").read_text() and note in (out / "report.html").read_text()


def test_async_rollouts_sync_inside_vllms_engine_process(tmp_path):
    """rl --engine-mode async: the rollout engine is vLLM's AsyncLLM (its model in a process of its own), the requests
    of a step arriving --arrival-gap seconds apart, groups as one request (n = G), EOS on; the weight sync and its check
    run in vLLM's worker process (worker_extension: alignaudit_sync_weights, alignaudit_checksums). Strict: every
    generated token bit-equal and every sync bit-equal while the weights change. Default: vLLM's CPU linear layers keep
    their weights in the engine process (or the first load would have nowhere to write) and the sync stays bit-equal
    (the packed GEMMs rebuilt: sync_stale_packed 0), while the tokens mismatch."""
    runs = {}
    for name, extra in (("strict", ["--strict"]), ("default", [])):
        out = tmp_path / name
        assert (
            cli.main(
                [
                    "rl",
                    *extra,
                    "--steps",
                    "2",
                    "--lr",
                    "1e-3",
                    "--engine-mode",
                    "async",
                    "--arrival-gap",
                    "0.01",
                    "--no-token-rows",
                    "--out",
                    str(out),
                ]
            )
            == EXIT_OK
        ), name
        runs[name] = pd.read_parquet(out / "steps.parquet"), json.loads((out / "run.json").read_text())
    for name, (s, record) in runs.items():
        assert record["engines"]["infer"]["engine_mode"] == "async" and record["initial_sync"]["bit_equal"], name
        assert s["sync_bit_equal"].all() and (s["sync_stale_packed"] == 0).all(), name
        assert (s["weights_changed"] > 0).all() and s["weights_digest"].nunique() == 2, name
        assert (s["max_running_requests"] >= 1).all() and s["arrived_while_running"].notna().all(), name
    strict, default = runs["strict"][0], runs["default"][0]
    assert (strict["mismatches"] == 0).all() and (default["mismatches"] > 0).all()
    assert not (tmp_path / "strict" / "sync").exists()  # the file transport's weights are not left behind
