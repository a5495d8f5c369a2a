"""Tensor parallelism on the CPU: Megatron at TP=2 (two gloo ranks), vLLM at TP=2 (its CPU communicator).

Chain of reasoning:
1. A row-parallel layer adds its ranks' partial sums: the default stack rounds each rank's output, then
   all-reduces, so TP=2 differs from TP=1 inside one engine, and bisect (sharded ops gathered from every
   rank) names the first row-parallel projection, layers.0.o_proj, with every op before it bitwise equal.
2. The strict linear defines K as a tree of ROW_PARALLEL_SEGMENTS segments whose top levels the ranks add
   in rank order (tests/kernels/ proves the partials at TP 1, 2 and 4 combine to the single-rank
   bits), and strict logprobs all-reduce exact row statistics over the vocabulary shards
   (token_logprobs_vocab_parallel: the one-rank bits).
3. So megatron and vllm under --strict agree bit for bit at any pairing of TP 1 and 2: TP=2 vs TP=2 (in
   rollout mode, whose prompt positions are the prompt-mode logprobs and whose sampled tokens come from
   vLLM's TP=2 decode), TP=1 vs TP=2, and TP=2 vs TP=1; without --strict they differ (negative control).
"""

from __future__ import annotations

import json

import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE
from helpers import one_line_error

pytestmark = [pytest.mark.engines, pytest.mark.long]

MEGATRON_TP2 = ["--train-opt", "tensor_model_parallel_size=2"]
VLLM_TP2 = ["--infer-opt", "tensor_parallel_size=2"]


def summary(out):
    return json.loads((out / "summary.json").read_text())


def test_default_tp2_differs_from_tp1_at_the_first_row_parallel_projection(tmp_path):
    out = tmp_path / "bisect"
    assert (
        cli.main(
            [
                "bisect",
                "--train",
                "megatron",
                "--infer",
                "megatron",
                *MEGATRON_TP2,
                "--mode",
                "natural",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    result = json.loads((out / "bisect.json").read_text())["natural"]
    assert result["first_divergence"]["op"] == "layers.0.o_proj"
    records = {r["op"]: r for r in result["records"]}
    for op in ("embed", "layers.0.q_proj", "layers.0.k_rope", "layers.0.attn"):
        assert records[op]["status"] == "equal", op  # gathered shards equal the single-rank tensors
    assert records["logprobs"]["status"] == "differs"
    run = json.loads((out / "run.json").read_text())
    assert run["train"]["options"] == {"tensor_model_parallel_size": 2}
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert manifest["engine_settings"]["transformer_config"]["tensor_model_parallel_size"] == 2


def test_strict_is_bitwise_equal_at_tp2_in_rollout_mode(tmp_path):
    """End to end through the CLI: megatron at TP=2 rescores what vLLM at TP=2 sampled."""
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compare",
                "--strict",
                "--train",
                "megatron",
                "--infer",
                "vllm",
                "--mode",
                "rollout",
                "--max-new-tokens",
                "8",
                "--prompt-logprobs",
                "--ignore-eos",
                "--out",
                str(out),
                *MEGATRON_TP2,
                *VLLM_TP2,
            ]
        )
        == EXIT_OK
    )
    s = summary(out)
    assert s["mismatches"] == 0 and s["ulp_max"] == 0 and s["tokens_compared"] == 176 + 4 * 8
    assert s["generated"]["tokens_compared"] == 32 and s["generated"]["mismatches"] == 0
    resolved = json.loads((out / "infer" / "manifest.json").read_text())["engine_settings"]["resolved"]
    assert resolved["tensor_parallel_size"] == 2


@pytest.mark.parametrize("train_tp, infer_tp", [(1, 2), (2, 1)])
def test_strict_is_bitwise_equal_across_tensor_parallel_sizes(tmp_path, captures, train_tp, infer_tp):
    """TP=1 against TP=2 either way, prompt mode; the TP=1 sides are the session's strict captures."""
    from alignaudit.pipelines.runs import diff_captures

    train = captures.get(
        "megatron", "bf16", strict="all", **({"tensor_model_parallel_size": 2} if train_tp == 2 else {})
    )
    infer = captures.get("vllm", "bf16", strict="all", **({"tensor_parallel_size": 2} if infer_tp == 2 else {}))
    s = diff_captures(train, infer, tmp_path / "diff")
    assert s["mismatches"] == 0 and s["ulp_max"] == 0 and s["tokens_compared"] == 176
    assert infer.manifest["engine_settings"]["resolved"]["tensor_parallel_size"] == infer_tp
    assert (s["sides"]["train"]["tensor_parallel_size"], s["sides"]["infer"]["tensor_parallel_size"]) == (
        train_tp,
        infer_tp,
    )
    config = train.manifest["engine_settings"]["transformer_config"]
    assert config["tensor_model_parallel_size"] == train_tp


def test_the_default_stack_at_tp2_differs(tmp_path):
    """Negative control for the strict results above: without --strict, Megatron at TP=2 and HF differ."""
    out = tmp_path / "stock"
    assert cli.main(["compare", "--train", "megatron", "--infer", "hf", *MEGATRON_TP2, "--out", str(out)]) == EXIT_OK
    assert summary(out)["mismatches"] == 176


def test_rl_with_a_tensor_parallel_trainer(tmp_path):
    """Megatron trains at TP=2 (two ranks following one command stream; q/k layernorm grads all-reduced
    across ranks as megatron-lm's finalize_model_grads does), vLLM rolls out at TP=1: every step 0
    mismatching tokens, every sync bit-equal, the replicated parameters identical on both ranks, and the
    step-1 gradient norm the TP=1 trainer's up to the non-strict backward's rounding."""
    out = tmp_path / "rl"
    assert (
        cli.main(
            ["rl", "--strict", *MEGATRON_TP2, "--steps", "2", "--lr", "1e-3", "--no-token-rows", "--out", str(out)]
        )
        == EXIT_OK
    )
    import pandas as pd

    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps["mismatches"] == 0).all() and steps["sync_bit_equal"].all()
    assert (steps["sync_replicas_diverged"] == 0).all() and steps["weights_digest"].nunique() == 2
    assert abs(steps["grad_norm"].iloc[0] - 7.6810) < 0.01  # TP=1, same seed, the default reward: 7.681034


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--train-opt", "tensor_model_parallel_size=3"], "does not divide the 4 attention heads"),
        (["compare", "--train-opt", "tensor_model_parallel_size=4"], "does not divide the 2 query groups"),
        (["compare", "--infer-opt", "tensor_parallel_size=4"], "needs 4 CPU cores, one per rank"),
        (["bisect", *VLLM_TP2], "op capture with vllm at tensor parallel size > 1 is not implemented"),
        (["bisect", *MEGATRON_TP2, "--mode", "forced"], "forced-mode op capture with megatron"),
        (["rl", *VLLM_TP2], "alignaudit rl with vllm at tensor parallel size > 1 is not implemented"),
    ],
)
def test_tensor_parallel_sizes_the_run_cannot_take_are_refused(capsys, tmp_path, argv, message):
    out = tmp_path / "o"
    assert message in one_line_error(capsys, [*argv, "--out", str(out)], EXIT_USAGE)
    assert not out.exists()


def test_replay_truncates_the_whole_vocabulary_at_tp2(tmp_path, tiny_spec):
    """A trainer replaying vLLM's processed logprobs with top-k at TP=2 truncates the gathered vocabulary (each
    rank holds half of it; top-k of a half kept other tokens, 2k in all, and another normalizer): fp32 TP=2
    equals TP=1 to rounding, -inf at the same tokens."""
    import numpy as np

    from alignaudit.inputs.prompts import load_prompts
    from alignaudit.inputs.request import EngineSettings, Replay
    from alignaudit.pipelines.runs import EngineRun, capture

    batch = load_prompts(tiny_spec)
    replay = Replay(0.7, 5, 1.0, (10, 3, 50, 20))
    logprobs = {}
    for tp in (1, 2):
        run = EngineRun("megatron", EngineSettings(dtype="fp32", options={"tensor_model_parallel_size": tp}))
        logprobs[tp] = (
            capture(tiny_spec, batch, run, tmp_path / f"tp{tp}", replay=replay).logprobs["logprob"].to_numpy()
        )
    truncated = np.isneginf(logprobs[1])
    assert 50 < truncated.sum() < len(truncated) - 50  # replayed tokens outside the top 5, and others not
    np.testing.assert_allclose(logprobs[2], logprobs[1], rtol=0, atol=1e-4)


def test_ranks_are_forked_on_the_cpu_and_spawned_on_cuda():
    """A forked child cannot use its parent's CUDA context, so CUDA ranks start as fresh interpreters; CPU ranks are
    forked from a worker that has only imported (every CPU tensor-parallel test above ran them so)."""
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.workers.capture_worker import rank_start_method

    assert rank_start_method(EngineSettings(device="cuda")) == "spawn"
    assert rank_start_method(EngineSettings(device="cpu")) == "fork"


def test_the_rendezvous_file_is_removed_when_the_worker_exits(tmp_path):
    """Megatron's ranks meet through a file (torch.distributed's file:// rendezvous) that the worker forking them
    creates and removes when it exits. Before, each run at TP > 1 left an alignaudit-pg-* file in the temporary
    directory (the forked ranks leave through os._exit, so torch's FileStore never deletes it; at TP=1 it does)."""
    import os
    import subprocess
    import sys

    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "alignaudit",
            "capture",
            "--engine",
            "megatron",
            "--no-ops",
            "--opt",
            "tensor_model_parallel_size=2",
            "--out",
            str(tmp_path / "cap"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    assert (tmp_path / "cap" / "logprobs.parquet").is_file()
    assert not list(temp.glob("alignaudit-pg-*"))
