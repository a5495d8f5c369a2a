"""Rollouts shaped as RL frameworks sample them, through vLLM (the CPU wheel) on the fixture.

Chain: GRPO frameworks sample a group as one request with n = G, stop at EOS, and ask for the sampled tokens'
logprobs only, so vLLM reads its prefix cache; vLLM's rollouts take that shape by default. Under --strict those
shapes change no bit: the trainer's logprob of every sampled token equals vLLM's, with 2 prompts of 300 tokens x 4
completions, prefix-cache hits read back from vLLM (> 0), and completions that end at EOS; the default stack
differs on the same shape (the negative control). Through vLLM's AsyncLLM, requests arriving while others decode,
the strict rollout is the offline one bit for bit: same tokens, same logprobs; and that with vLLM loading no plugin
from entry points (VLLM_PLUGINS=none, as from a source checkout, where the H200 run found the strict ops missing in
the engine-core process: alignaudit's worker extension registers them there).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE
from alignaudit.inputs.strict_ops import STRICT_OPS
from helpers import one_line_error

pytestmark = pytest.mark.engines

SHAPE = [
    "compare",
    "--mode",
    "rollout",
    "--random-prompts",
    "2",
    "--prompt-len",
    "300",
    "--group-size",
    "4",
    "--max-new-tokens",
    "8",
]  # EOS stops, no prompt logprobs: vLLM's default shape
EOS = 0  # fixtures/qwen3-tiny/config.json eos_token_id


def test_group_eos_and_prefix_cache_change_no_strict_bit(tmp_path, monkeypatch):
    for how, extra in (
        ("strict", ["--strict"]),
        ("default", []),
        ("async", ["--strict", "--engine-mode", "async", "--arrival-gap", "0.03"]),
    ):
        out = tmp_path / how
        if how == "async":
            monkeypatch.setenv("VLLM_PLUGINS", "none")  # no entry-point plugin in vLLM's processes
        assert cli.main([*SHAPE, *extra, "--out", str(out)]) == EXIT_OK
        summary = json.loads((out / "summary.json").read_text())
        infer = json.loads((out / "infer" / "manifest.json").read_text())
        table = pd.read_parquet(out / "infer" / "logprobs.parquet")
        generated = table[table["generated"]]
        assert infer["scored"] == "generated" and table["scored"].equals(table["generated"])
        assert infer["rollout"]["group_size"] == 4 and infer["rollout"]["prompt_lengths"] == [300] * 8
        assert infer["rollout"]["stop_at_eos"] is True and infer["rollout"]["prompt_logprobs"] is False
        assert infer["engine_settings"]["prefix_cache_hits"] > 0
        assert infer["engine_settings"]["resolved"]["enable_prefix_caching"] is True
        ids = table.groupby("seq")["token_id"].apply(list).tolist()
        assert all(ids[g * 4][:300] == ids[g * 4 + j][:300] for g in range(2) for j in range(4))  # one prompt a group
        lengths = generated.groupby("seq").size()
        assert len(lengths) == 8 and lengths.max() <= 8
        for seq, n in lengths.items():  # a completion shorter than --max-new-tokens ended at EOS
            assert n == 8 or generated[generated["seq"] == seq]["token_id"].iloc[-1] == EOS
        assert summary["tokens_compared"] == summary["generated"]["tokens_compared"] == len(generated)
        if how == "default":
            assert summary["mismatches"] > 0
        else:
            assert summary["mismatches"] == 0 and summary["ulp_max"] == 0
        if how == "async":
            arrivals = infer["engine_settings"]["arrivals"]
            assert infer["engine_settings"]["engine_mode"] == "async" and arrivals["requests"] == 2
            assert infer["engine_settings"]["attention_impl"] == ["StrictCPUAttentionImpl"]
            assert infer["engine_settings"]["plugin_ops"] == sorted(STRICT_OPS)  # in vLLM's engine-core process
            assert arrivals["arrived_while_running"] == 1 and arrivals["max_running"] == 2  # the second joined a run
            offline = pd.read_parquet(tmp_path / "strict" / "infer" / "logprobs.parquet")
            assert table["token_id"].equals(offline["token_id"])
            assert (table["logprob"].to_numpy().view("int32") == offline["logprob"].to_numpy().view("int32")).all()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mode", "rollout", "--infer", "hf", "--group-size", "2"], "--group-size: hf rollouts are sampled one"),
        (["--mode", "rollout", "--infer", "hf", "--stop-at-eos"], "--stop-at-eos: hf rollouts"),
        (["--mode", "rollout", "--infer", "hf", "--engine-mode", "async"], "--engine-mode: hf rollouts"),
        (["--mode", "rollout", "--engine-mode", "sync"], "--engine-mode 'sync': choose one of offline, async"),
        (["--mode", "rollout", "--arrival-gap", "0.1"], "--arrival-gap spaces the arrivals of --engine-mode async"),
        (
            ["--mode", "rollout", "--arrival-gap", "0.02"],
            "--arrival-gap spaces the arrivals",
        ),  # the async default, given
        (
            ["--group-size", "1"],
            "--group-size applies to rollouts",
        ),  # given explicitly: refused though it is the default
        (["--mode", "rollout", "--infer-opt", "ignore_eos=true"], "use --stop-at-eos / --ignore-eos instead"),
        (["--mode", "rollout", "--engine-mode", "async", "--arrival-gap", "-1"], "--arrival-gap -1.0: seconds"),
        (
            ["--mode", "rollout", "--engine-mode", "async", "--infer-opt", "worker_extension_cls=x.Y"],
            "worker_extension_cls is set by alignaudit in --engine-mode async",
        ),
        (["--engine-mode", "async"], "--engine-mode applies to rollouts"),
        (["--group-size", "2"], "--group-size applies to rollouts"),
        (["--mode", "rollout", "--group-size", "0"], "--group-size 0: completions per prompt"),
        (
            ["--mode", "rollout", "--prompt-logprobs", "--infer-opt", "enable_prefix_caching=true"],
            "has no effect while prompt logprobs are recorded",
        ),
        (["--infer-opt", "enable_prefix_caching=true"], "has no effect in prompt mode"),
        (["--mode", "rollout", "--infer-opt", "n=4"], "vllm n is set by alignaudit; use --group-size"),
        (
            ["--mode", "rollout", "--infer", "megatron"],
            "megatron does not sample rollouts; --mode rollout needs an engine",
        ),
    ],
)
def test_rollout_shapes_an_engine_cannot_sample_are_refused(tmp_path, capsys, argv, message):
    out = tmp_path / "never"
    assert message in one_line_error(capsys, ["compare", *argv, "--out", str(out)], EXIT_USAGE)
    assert not out.exists()


def test_capture_refuses_a_rollout_shape_its_engine_does_not_sample(tmp_path, capsys):
    """capture validates apart from compare: the same refusal, not a shape silently dropped (it ran 4 sequences)."""
    out = tmp_path / "never"
    argv = ["capture", "--engine", "hf", "--mode", "rollout", "--group-size", "2", "--out", str(out)]
    assert "--group-size: hf rollouts are sampled one" in one_line_error(capsys, argv, EXIT_USAGE)
    assert not out.exists()


def test_capture_refusals_name_its_own_flag(tmp_path, capsys):
    """capture takes one engine's options as --opt: the engines' refusals, worded for compare's sides, say --opt (they
    said --train-opt / --infer-opt, flags capture does not have)."""
    out = tmp_path / "never"
    for argv, says in (
        (["--engine", "vllm", "--opt", "enable_sleep_mode=true"], "instead of --opt enable_sleep_mode"),
        (["--engine", "hf", "--mode", "rollout", "--opt", "micro_batch_size=4"], "drop it from --opt"),
        (
            ["--engine", "vllm", "--mode", "rollout", "--ignore-eos", "--opt", "stop_token_ids=[0]"],
            "drop it from --opt stop_token_ids",
        ),
    ):
        err = one_line_error(capsys, ["capture", *argv, "--out", str(out)], EXIT_USAGE)
        assert says in err and "--infer-opt" not in err and "--train-opt" not in err, err
    assert not out.exists()
