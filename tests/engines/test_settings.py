"""Every setting takes effect or is refused before any engine starts (alignaudit.inputs.capabilities).

Each refusal is checked for its one-line reason and for starting no engine (no capture directory is made);
each setting that is accepted is checked for its effect on what is measured.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE
from helpers import FIXTURE, ROOT, one_line_error

pytestmark = [pytest.mark.engines, pytest.mark.long]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--train-opt", "hidden_dropout=0.1"],
            "megatron hidden_dropout=0.1: no effect, the forward pass runs in eval mode",
        ),
        (["--train-opt", "attention_dropout=0.1"], "megatron attention_dropout=0.1: no effect"),
        (["--train-opt", "pipeline_model_parallel_size=2"], "alignaudit runs Megatron with tensor parallelism only"),
        (["--train-opt", "masked_softmax_fusion=true"], "masked_softmax_fusion=true needs a CUDA kernel"),
        (["--train-opt", "gradient_accumulation_fusion=true"], "training only"),
        (["--train-opt", "fp32_residual_connection=true"], "crashes the local spec"),
        (["--train-opt", "test_mode=true"], "does not know it to take effect in a forward pass"),
        (
            ["--infer-opt", "enable_prefix_caching=true"],
            "vLLM never reads the prefix cache for a request that asks for prompt logprobs",
        ),
        (["--mode", "rollout", "--infer-opt", "skip_reading_prefix_cache=false"], "crashes vLLM 0.32"),
        (
            ["--mode", "rollout", "--infer-opt", "temperature=0.5"],
            "vllm temperature is set by alignaudit; use --temperature",
        ),
        (["--mode", "rollout", "--infer-opt", "min_tokens=4"], "min_tokens would mask EOS"),
        (
            ["--infer-opt", "enable_sleep_mode=true"],
            "vllm enable_sleep_mode is set by alignaudit; use rl --sleep-level",
        ),
        (
            ["--infer", "hf", "--mode", "rollout", "--infer-opt", "micro_batch_size=4"],
            "hf micro_batch_size: an hf rollout generates and scores one sequence at a time",
        ),
        (["--infer-opt", "logprobs_mode=raw_logits"], "raw_logits are logits, not logprobs"),
        (
            ["--mode", "rollout", "--infer-opt", "logprobs_mode=processed_logits"],
            "processed_logits are logits, not logprobs",
        ),
        (["--infer-opt", "logprobs_mode=processed_logprobs"], "so they need --mode rollout"),
        (["--infer-opt", "pipeline_parallel_size=2"], "runs vLLM as one engine, split by tensor_parallel_size only"),
        (["--infer-opt", "repetition_penalty=1.2"], "is a sampling setting and has no effect on teacher-forced"),
        (
            ["--mode", "rollout", "--ignore-eos", "--infer-opt", "stop_token_ids=[7, 0]"],
            "vllm stop_token_ids holds 0, an EOS of qwen3-tiny: completions would end at EOS, which --ignore-eos asks "
            "to ignore",
        ),
        # vLLM's own SamplingParams check, made in the option-check worker (it raised only after both engines started)
        (
            ["--mode", "rollout", "--infer-opt", "presence_penalty=5"],
            "vllm refuses --infer-opt presence_penalty: presence_penalty must be in [-2, 2], got 5",
        ),
        (
            ["--mode", "rollout", "--infer-opt", "logprobs_mode=processed_logprobs", "--infer-opt", "min_p=0.1"],
            "vllm min_p=0.1 with logprobs_mode=processed_logprobs: vLLM applies it before its processed logprobs",
        ),
        (
            [
                "--mode",
                "rollout",
                "--infer-opt",
                "logprobs_mode=processed_logprobs",
                "--infer-opt",
                'logit_bias={"5": 2.0}',
            ],
            'vllm logit_bias={"5": 2.0} with logprobs_mode=processed_logprobs',
        ),
        (["--infer-opt", "quantization=fp8"], 'vllm quantization="fp8": vLLM\'s CPU wheel has no fp8 kernels'),
        (["--mode", "rollout", "--infer-opt", "kv_cache_dtype=fp8"], 'vllm kv_cache_dtype="fp8": vLLM\'s CPU wheel'),
        (
            ["--infer-opt", "max_cudagraph_capture_size=64"],
            "vllm max_cudagraph_capture_size: vLLM on the CPU captures no CUDA graphs",
        ),
        (
            ["--infer-opt", 'compilation_config={"mode": 3, "cudagraph_capture_sizes": [1, 2]}'],
            "vllm compilation_config.cudagraph_capture_sizes: vLLM on the CPU captures no CUDA graphs (cudagraph_mode "
            "resolves to NONE), so it would have no effect; run it with --device cuda or remove "
            "cudagraph_capture_sizes from --infer-opt compilation_config",
        ),
        # vLLM would refuse it only once it ran the prompts, after the training engine (the built-in prompt 2: 98 ids)
        (
            ["--infer-opt", "max_model_len=10"],
            "prompt 2 has 98 tokens plus 1 generated, longer than --infer-opt "
            "max_model_len=10; raise it or shorten the prompts",
        ),
        # TransformerConfig itself runs in the option-check worker, before either engine: a value it overrides
        (
            ["--train-opt", "attention_softmax_in_fp32=false", "--train-opt", "apply_query_key_layer_scaling=true"],
            "attention_softmax_in_fp32=False: TransformerConfig resolves it to True",
        ),
    ],
)
def test_settings_without_effect_are_refused_before_any_engine(capsys, tmp_path, argv, message):
    out = tmp_path / "o"
    err = one_line_error(capsys, ["compare", *argv, "--out", str(out)], EXIT_USAGE)
    assert message in err
    assert not out.exists()


@pytest.mark.parametrize(
    "strict, options, message",
    [
        ("all", {"quantization": "fp8"}, "strict linear replaces vLLM's unquantized linear method only"),
        ("linear", {"quantization": "fp8"}, "strict linear replaces"),
        ("all", {"kv_cache_dtype": "fp8_e4m3"}, "strict attention reads bf16/fp16 KV caches only"),
    ],
)
def test_fp8_rollouts_are_refused_under_the_strict_op_that_would_not_cover_them(strict, options, message):
    from alignaudit.engines.vllm.options import check_options
    from alignaudit.errors import InputError
    from alignaudit.inputs.request import EngineSettings

    with pytest.raises(InputError, match=message):
        check_options(EngineSettings(device="cuda", strict=strict, options=options), "rollout", "infer")
    check_options(EngineSettings(device="cuda", strict="rmsnorm,rope", options=options), "rollout", "infer")
    check_options(EngineSettings(device="cuda", options=options), "rollout", "infer")


@pytest.mark.parametrize(
    "key, bad, good, message",
    [
        ("max_model_len", [0, -5], [-1, 1, 32768], "expected an integer >= 1, or -1 (fit to memory)"),
        (
            "gpu_memory_utilization",
            [0, 1.01, 2, float("nan"), float("inf")],
            [0.05, 1],
            "expected a fraction in (0, 1]",
        ),
        ("kv_cache_memory_bytes", [0, -1], [1, 1 << 30], "expected a positive number of bytes"),
        ("max_num_seqs", [0, -3], [1, 256], "expected 1 or more"),
        ("max_num_batched_tokens", [0], [8192], "expected 1 or more"),
    ],
)
def test_vllm_sizes_out_of_range_are_refused_before_any_engine(key, bad, good, message):
    """vLLM's config would refuse these only at engine start, after the training engine has run."""
    from alignaudit.engines.vllm.options import check_options
    from alignaudit.errors import InputError
    from alignaudit.inputs.request import EngineSettings

    for value in bad:
        with pytest.raises(InputError, match=re.escape(f"{message}; fix --infer-opt {key}")):
            check_options(EngineSettings(device="cuda", options={key: value}), "rollout", "infer")
    for value in good:
        check_options(EngineSettings(device="cuda", options={key: value}), "rollout", "infer")
    check_options(EngineSettings(device="cuda", options={key: "text"}), "rollout", "infer")  # the type check's


def test_a_vllm_max_model_len_must_hold_each_prompt_and_the_tokens_after_it():
    """Prompt mode: the prompt and the one token vLLM samples with prompt logprobs; a rollout: the sampled tokens;
    vLLM as the trainer of a rollout: the sampled tokens and its own one."""
    from types import SimpleNamespace

    from alignaudit.errors import InputError
    from alignaudit.inputs.request import EngineRun, EngineSettings
    from alignaudit.pipelines.requests import check_max_model_len

    batch = SimpleNamespace(sequences=[[1] * 10, [1] * 30, [1] * 20])

    def vllm(limit):
        return EngineRun("vllm", EngineSettings(options={"max_model_len": limit}))

    for flag, new_tokens, fits in (("--infer-opt", 0, 31), ("--infer-opt", 8, 38), ("--train-opt", 8, 39)):
        check_max_model_len(batch, {flag: vllm(fits)}, new_tokens)
        with pytest.raises(
            InputError,
            match=re.escape(
                f"prompt 1 has 30 tokens plus {fits - 30} generated, longer than {flag} max_model_len={fits - 1}"
            ),
        ):
            check_max_model_len(batch, {flag: vllm(fits - 1)}, new_tokens)
    check_max_model_len(batch, {"--infer-opt": vllm(-1)}, 8)  # fit to memory
    check_max_model_len(batch, {"--train-opt": EngineRun("hf", EngineSettings(options={"max_model_len": 5}))}, 0)


def test_cuda_graph_settings_are_refused_where_no_graph_is_captured():
    """On CUDA a capture size takes effect (read back into engine_settings.resolved); with enforce_eager, as on the
    CPU (test above), vLLM captures no graph, so the setting is refused; a value that asks for no graph is not."""
    from alignaudit.engines.vllm.options import check_options
    from alignaudit.errors import InputError
    from alignaudit.inputs.request import EngineSettings

    sizes = {"max_cudagraph_capture_size": 2048}
    check_options(EngineSettings(device="cuda", strict="all", options=sizes), "rollout", "infer")
    for eager in (True, 1):
        with pytest.raises(
            InputError,
            match="with enforce_eager: an eager engine captures no CUDA graphs; drop "
            "--infer-opt max_cudagraph_capture_size or enforce_eager",
        ):
            check_options(EngineSettings(device="cuda", options={**sizes, "enforce_eager": eager}), "rollout", "infer")
    check_options(EngineSettings(device="cuda", options={"compilation_config": {"mode": 3}}), "rollout", "infer")
    for no_graphs in (
        {"max_cudagraph_capture_size": 0},
        {"cudagraph_capture_sizes": []},
        {"compilation_config": {"cudagraph_mode": "NONE"}},
    ):  # asking for none is true there
        check_options(EngineSettings(device="cpu", options=no_graphs), "rollout", "infer")
        check_options(EngineSettings(device="cuda", options={**no_graphs, "enforce_eager": True}), "rollout", "infer")
    for size in (0, -1):  # on CUDA with graphs on, vLLM asserts >= 1 at engine start
        with pytest.raises(InputError, match=f"max_cudagraph_capture_size={size}: vLLM asserts it is >= 1"):
            check_options(
                EngineSettings(device="cuda", options={"max_cudagraph_capture_size": size}), "rollout", "infer"
            )
        check_options(
            EngineSettings(
                device="cuda",
                options={"max_cudagraph_capture_size": size, "compilation_config": {"cudagraph_mode": "NONE"}},
            ),
            "rollout",
            "infer",
        )


def test_strict_processed_logprobs_under_model_runner_v2_are_refused_before_any_engine(monkeypatch):
    """vLLM 0.26 on CUDA picked model runner V2 for the fixture, whose fused sampling kernels the plugin does not
    replace (2026-12-05, docs/log/findings.md): asked for explicitly, refused up front; otherwise the engine runs V1."""
    from alignaudit.engines.vllm.options import check_options
    from alignaudit.errors import InputError
    from alignaudit.inputs.request import EngineSettings

    processed = {"logprobs_mode": "processed_logprobs"}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(InputError, match="unset VLLM_USE_V2_MODEL_RUNNER"):
        check_options(EngineSettings(device="cuda", strict="all", options=processed), "rollout", "infer")
    check_options(EngineSettings(device="cuda", strict="rmsnorm,rope", options=processed), "rollout", "infer")
    check_options(EngineSettings(device="cuda", strict="all"), "rollout", "infer")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    check_options(EngineSettings(device="cuda", strict="all", options=processed), "rollout", "infer")


def _model(tmp_path, edit_config=None, edit_weights=None):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    if edit_config:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(edit_config(config)))
    if edit_weights:
        weights = load_file(model / "model.safetensors")
        edit_weights(weights)
        save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def _add_qkv_bias(weights):
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        for name, size in (("q", 128), ("k", 64), ("v", 64)):
            weights[f"model.layers.{i}.self_attn.{name}_proj.bias"] = (0.5 * torch.randn(size, generator=g)).to(
                torch.bfloat16
            )


@pytest.mark.parametrize(
    "edit_config, edit_weights, message",
    [
        (
            lambda c: {**c, "hidden_act": "gelu_pytorch_tanh"},
            None,
            "hidden_act='gelu_pytorch_tanh' is not implemented by every engine adapter; alignaudit supports "
            "SiLU-gated MLPs",
        ),
        (lambda c: {**c, "use_sliding_window": True}, None, "use_sliding_window=True"),
        (
            None,
            lambda w: w.update({"model.extra.weight": torch.zeros(4)}),
            "holds 1 tensor(s) its config.json does not account for (model.extra.weight)",
        ),
        (None, _add_qkv_bias, "does not account for"),  # biases without "attention_bias": true would be ignored
    ],
)
def test_checkpoint_features_an_engine_would_ignore_are_refused(capsys, tmp_path, edit_config, edit_weights, message):
    model = _model(tmp_path, edit_config, edit_weights)
    err = one_line_error(capsys, ["compare", "--model", str(model), "--out", str(tmp_path / "o")], EXIT_USAGE)
    assert message in err and not (tmp_path / "o").exists()


def test_qkv_biases_are_loaded_where_the_engines_agree_on_them(tmp_path, capsys):
    """attention_bias: true with non-zero q/k/v biases (N(0, 0.5^2)): Megatron and vLLM agree bit for bit
    under --strict (Megatron used to drop the biases: max |d| 10.7 against vLLM); transformers' Qwen3 reads
    the flag as a bias on o_proj too, a different model, so a comparison with hf is refused."""
    model = _model(tmp_path, lambda c: {**c, "attention_bias": True}, _add_qkv_bias)
    out = tmp_path / "strict"
    assert (
        cli.main(
            ["compare", "--model", str(model), "--train", "megatron", "--infer", "vllm", "--strict", "--out", str(out)]
        )
        == EXIT_OK
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mismatches"] == 0 and summary["tokens_compared"] == 176  # a dropped bias would show at once
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert manifest["engine_settings"]["transformer_config"]["add_qkv_bias"] is True
    assert manifest["engine_settings"]["module_mode"] == "eval"
    assert manifest["model"]["tensors"] == 31 and manifest["engine_settings"]["weights"]["checkpoint_tensors"] == 31
    err = one_line_error(
        capsys,
        ["compare", "--model", str(model), "--train", "megatron", "--infer", "hf", "--out", str(tmp_path / "hf")],
        EXIT_USAGE,
    )
    assert "attention_bias is not supported with hf" in err and "o_proj" in err and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("train", ["hf", "megatron"])
def test_processed_logprobs_are_replayed_by_the_trainer_and_eos_is_not_masked(tmp_path, train):
    """vLLM samples at temperature 0.7 and records processed logprobs; the trainer divides its logits by
    0.7 for the generated tokens. In fp32 they agree to rounding, with no bias: before, rollout set
    min_tokens, which masks the EOS logit and shifted every processed logprob by -log(1 - p_EOS)."""
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compare",
                "--mode",
                "rollout",
                "--train",
                train,
                "--infer",
                "vllm",
                "--dtype",
                "fp32",
                "--temperature",
                "0.7",
                "--infer-opt",
                "logprobs_mode=processed_logprobs",
                "--max-new-tokens",
                "16",
                "--ignore-eos",
                "--prompt-logprobs",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    tokens = pd.read_parquet(out / "tokens.parquet")
    generated = tokens[tokens["generated"]]
    assert len(generated) == 4 * 16
    assert generated["diff"].abs().max() < 1e-4 and abs(generated["diff"].mean()) < 1e-6
    summary = json.loads((out / "summary.json").read_text())
    assert abs(summary["generated"]["mean_diff"]) < 1e-6
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    replay = manifest["replay"]
    assert replay["temperature"] == 0.7 and replay["prompt_lengths"] == [31, 7, 98, 44]
    assert "generated tokens" in manifest["engine_settings"]["logprob_formula"]
    raw = tokens[~tokens["generated"]]  # prompt tokens stay raw logprobs on both sides
    assert raw["diff"].abs().max() < 1e-4


def test_strict_processed_logprobs_are_the_trainers_bits(tmp_path):
    """As TRL, verl and NeMo-RL run vLLM (logprobs_mode=processed_logprobs), with temperature, top-k and top-p all
    applied: the strict plugin computes them with the functions the trainer replays them with and the strict
    log-softmax, so every generated token is bitwise equal (vLLM's own log_softmax differed by up to 7 ULP)."""
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compare",
                "--mode",
                "rollout",
                "--strict",
                "--temperature",
                "0.7",
                "--top-k",
                "40",
                "--top-p",
                "0.9",
                "--infer-opt",
                "logprobs_mode=processed_logprobs",
                "--max-new-tokens",
                "16",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated"]["tokens_compared"] == 4 * 16 and summary["generated"]["mismatches"] == 0
    assert summary["mismatches"] == 0
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    replay = manifest["replay"]
    assert (replay["temperature"], replay["top_k"], replay["top_p"]) == (0.7, 40, 0.9)
    assert manifest["engine_settings"]["logprob_formula"].endswith(
        "; generated tokens: -vocab_parallel_cross_entropy(process_logits(logits, **replay), labels)"
    )


@pytest.mark.parametrize("dtype", ["fp32"])
def test_replay_at_temperature_one_changes_no_bit(tmp_path, tiny_spec, captures, dtype):
    """Dividing by 1.0 is exact and no truncation applies: the replayed path gives the bits of the plain one
    (in fp32 this caught Megatron's cross-entropy working in place on the logits the replay reads)."""
    from alignaudit.inputs.prompts import load_prompts
    from alignaudit.inputs.request import EngineSettings, Replay
    from alignaudit.pipelines.runs import EngineRun, capture

    batch = load_prompts(tiny_spec)
    replay = Replay(1.0, 0, 1.0, (10, 3, 50, 20))
    for engine in ("megatron", "hf"):
        run = EngineRun(engine, EngineSettings(dtype=dtype))
        plain = captures.get(engine, dtype)  # the same settings and prompts as run, shared with test_engines
        replayed = capture(tiny_spec, batch, run, tmp_path / f"{engine}-replay", replay=replay)
        a, b = plain.logprobs["logprob"].to_numpy(), replayed.logprobs["logprob"].to_numpy()
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), engine


def test_sampling_transform_follows_vllm():
    from alignaudit.engines.sampling import process_logits

    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0]])
    assert torch.equal(process_logits(logits, 2.0), logits / 2.0)
    top2 = process_logits(logits, 1.0, top_k=2)  # ties at the k-th value are kept, as in vLLM
    assert torch.isinf(top2).tolist() == [[True, False, True, False, True]]
    nucleus = process_logits(torch.tensor([[0.0, 10.0, 9.0, -5.0]]), 1.0, top_p=0.5)
    assert torch.isinf(nucleus).tolist() == [[True, False, True, True]]


def test_bisect_forced_marks_ops_whose_inputs_were_not_forced(tmp_path, capsys):
    """vLLM's final norm is a fused add+norm that reads layer 1's down_proj and residual: with --layers 0
    they are not forced, so final_norm is shown but not judged; with every layer forced it is judged."""
    out = tmp_path / "b"
    assert (
        cli.main(["bisect", "--train", "hf", "--infer", "vllm", "--mode", "forced", "--layers", "0", "--out", str(out)])
        == EXIT_OK
    )
    text = capsys.readouterr().out
    result = json.loads((out / "bisect.json").read_text())["forced"]
    assert "final_norm" in result["unforced_ops"] and "final_norm" not in result["differing_ops"]
    assert "not judged (inputs not forced): final_norm" in text
    ops = pd.read_parquet(out / "ops-forced.parquet").set_index("op")
    assert ops.loc["final_norm", "forced"] == False and "inputs not forced" in ops.loc["final_norm", "note"]  # noqa: E712
    assert ops.loc["layers.0.q_proj", "forced"] != False  # noqa: E712
    configured = json.loads((out / "bisect.json").read_text())["as_configured"]
    assert configured == {
        "infer": {
            "engine": "vllm",
            "overrides": {"enable_prefix_caching": False, "enforce_eager": True},
            "tokens": None,
            "mismatches": None,
        }
    }
    assert "op capture changed how vllm (infer) runs" in text and "(forced mode: not compared)" in text


def test_bisect_never_says_all_equal_when_op_capture_changed_the_engine(tmp_path, capsys):
    """vLLM compiled (train) vs vLLM eager (infer): compare finds every token different, but op capture runs
    vLLM eager on both sides, where every op agrees. Bisect runs the train side again as configured, finds
    that its logprobs moved, and its verdict says the ops describe the captured runs only."""
    out = tmp_path / "b"
    assert (
        cli.main(
            [
                "bisect",
                "--train",
                "vllm",
                "--infer",
                "vllm",
                "--infer-opt",
                "enforce_eager=true",
                "--mode",
                "natural",
                "--out",
                str(out),
            ]
        )
        == EXIT_OK
    )
    text = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the terminal width
    result = json.loads((out / "bisect.json").read_text())
    assert result["natural"]["first_divergence"] is None  # both captured eager: every op equal
    train = result["as_configured"]["train"]
    assert train["overrides"]["enforce_eager"] is True and train["tokens"] == 176 and train["mismatches"] > 100
    assert "infer" in result["as_configured"] and result["as_configured"]["infer"]["mismatches"] == 0
    assert text.count("every op is bitwise equal") == text.count("every op is bitwise equal in the captured runs") == 1
    assert f"in {train['mismatches']} of 176 tokens" in text


def test_help_defaults_and_hardware_record(tmp_path):
    from alignaudit.capture.environment import hardware
    from helpers import run_cli

    assert "alignaudit-runs/COMMAND-TIME" in run_cli("compare", "--help").stdout
    record = hardware("cpu")
    assert record["cpu_isa"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "NEON", "SVE256")
    assert isinstance(record["cpu_flags"], list)


def test_docs_list_every_setting_rule():

    from alignaudit.engines.megatron import options as megatron
    from alignaudit.engines.vllm import options as vllm
    from alignaudit.inputs import capabilities as caps

    text = (ROOT / "docs" / "cli.md").read_text()
    names = [
        *megatron.MEGATRON_OPTIONS,
        *megatron.MEGATRON_REFUSED,
        *vllm.VLLM_REFUSED,
        *vllm.VLLM_SET_BY_ALIGNAUDIT,
        *vllm.VLLM_RANGES,
        *vllm.NOT_REPLAYED,
        *(f.field for f in caps.CHECKPOINT_FEATURES),
        *(name for name, _, _, _ in caps.ENGINE_FEATURES),
    ]
    missing = [n for n in names if f"`{n}" not in text]
    assert not missing, f"docs/cli.md does not mention {missing}"


def test_fp32_lm_head_takes_effect_in_every_engine_and_strict_agrees(captures, tmp_path):
    """--lm-head-dtype fp32 changes the logprobs of each engine against its bf16 head (so it takes effect;
    vLLM through its own head_dtype switch), and the strict path stays bit for bit equal with it."""
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.pipelines.runs import EngineRun, capture, diff_captures

    for engine in ("megatron", "vllm", "hf"):
        fp32 = capture(
            captures.spec, captures.batch, EngineRun(engine, EngineSettings(lm_head_dtype="fp32")), tmp_path / engine
        )
        assert fp32.manifest["settings"]["lm_head_dtype"] == "fp32"
        s = diff_captures(captures.get(engine, "bf16"), fp32, tmp_path / f"d-{engine}")
        assert s["mismatches"] > 100, engine
    vllm = json.loads((tmp_path / "vllm" / "manifest.json").read_text())["engine_settings"]
    assert vllm["resolved"]["head_dtype"] == "torch.float32" and vllm["llm"]["hf_overrides"] == {
        "head_dtype": "float32"
    }
    out = tmp_path / "strict"
    assert cli.main(["compare", "--strict", "--lm-head-dtype", "fp32", "--out", str(out)]) == EXIT_OK
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mismatches"] == 0 and summary["tokens_compared"] == 176
    assert summary["sides"]["train"]["lm_head_dtype"] == "fp32"
