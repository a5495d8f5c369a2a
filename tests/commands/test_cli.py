"""The real command on the real fixture: outputs parsed back, exit codes, one-line errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_ENGINE, EXIT_OK, EXIT_USAGE, InputError
from helpers import FIXTURE, importance_by_hand, one_line_error, run_cli

pytestmark = [pytest.mark.engines, pytest.mark.long]


IS_OPTIONS = [
    "--tis-threshold",
    "1.0001",
    "--mask-low",
    "0.9999",
    "--mask-high",
    "1.001",
    "--geo-mask-low",
    "0.99999",
    "--geo-mask-high",
    "1.00001",
]


def test_compare_megatron_vs_vllm_default(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("compare", "--out", str(out), *IS_OPTIONS)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "Logprob alignment" in proc.stdout and "176 of 176 tokens differ" in proc.stdout
    assert f"{out}/report.html" in proc.stdout and "176 of 176 tokens differ" in (out / "report.html").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sides"]["train"]["engine"] == "megatron" and summary["sides"]["infer"]["engine"] == "vllm"
    assert summary["tokens_compared"] == 176 and summary["mismatches"] == 176
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert len(tokens) == 176 and not tokens["bitwise_equal"].any()
    assert (tokens["ulp"] > 0).all() and set(tokens["pos"]) == set(range(1, 98))
    run = json.loads((out / "run.json").read_text())
    assert run["train"]["dtype"] == "bf16" and run["model"]["name"] == "qwen3-tiny"
    for role in ("train", "infer"):
        assert (out / role / "manifest.json").is_file() and (out / role / "worker.log").is_file()
    # the IS diagnostics at the thresholds given, recomputed by hand from tokens.parquet (prompt mode: every token)
    imp = summary["importance"]
    assert run["importance"] == {
        "tis": 1.0001,
        "mask_low": 0.9999,
        "mask_high": 1.001,
        "geo_mask_low": 0.99999,
        "geo_mask_high": 1.00001,
    }
    assert (imp["scope"], imp["tis_threshold"], imp["mask_low"], imp["mask_high"]) == ("all", 1.0001, 0.9999, 1.001)
    hand = importance_by_hand(tokens, 1.0001, 0.9999, 1.001, 0.99999, 1.00001)
    for key, value in hand.items():
        assert imp[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
    # every token differs, so the ratios leave 1 and a threshold this close to 1 truncates and masks some
    assert imp["token_ratio_max"] > 1 > imp["token_ratio_min"] and imp["kl_k3"] > 0 and imp["chi2_token"] != 0
    assert 0 < imp["token_tis_fraction"] < 1 and 0 < imp["token_mask_fraction"] < 1 and imp["geo_mask_fraction"] > 0
    assert imp["token_ess"] < 1 and imp["kl_k1"] != 0 and imp["training_log_ppl"] != imp["rollout_log_ppl"]
    again = run_cli("compare", "--out", str(out))  # nothing already written is lost
    assert again.returncode == EXIT_USAGE and "--force" in again.stderr and "Traceback" not in again.stderr


def test_self_consistency_same_engine_both_sides(tmp_path):
    """One engine, the same settings spelled two ways: a deterministic engine must agree with itself, down to its
    whole distributions (--full-vocab: every KL and TV exactly 0, the run sealed and checked as gate checks it)."""
    from alignaudit.comparison.integrity import load_run

    out = tmp_path / "self"
    code = cli.main(
        [
            "compare",
            "--train",
            "hf",
            "--infer",
            "hf",
            "--infer-opt",
            "micro_batch_size=auto",
            "--dtype",
            "fp32",
            "--full-vocab",
            "--out",
            str(out),
        ]
    )
    assert code == EXIT_OK
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mismatches"] == 0 and summary["tokens_compared"] == 176
    vocab = summary["vocab"]
    assert vocab["positions"] == 176 and vocab["kl_train_infer"]["max"] == vocab["tv"]["max"] == 0.0
    assert vocab["top1_agreement"] == 1.0 and vocab["row_token_mismatches"] == {"train": 0, "infer": 0}
    assert json.loads((out / "run.json").read_text())["full_vocab"] is True
    assert sorted(p.name for p in (out / "infer" / "vocab").iterdir()) == [f"seq-{s:05d}.safetensors" for s in range(4)]
    assert load_run(out).record["status"] == "complete"
    assert summary["sides"]["infer"]["options"] == {"micro_batch_size": "auto"}
    manifest = json.loads((out / "infer" / "manifest.json").read_text())
    assert manifest["engine_settings"]["micro_batch_size"] == "auto"
    assert manifest["engine_settings"]["micro_batches"] == 4  # the built-in prompts differ in length: no padding


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/model"], "no such directory"),
        (["--train", "deepspeed"], "unknown engine 'deepspeed'; choose one of hf, megatron, vllm"),
        (["--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["--device", "tpu"], "unknown device"),
        (["--train-opt", "noequals"], "is not KEY=VALUE"),
        (["--random-prompts", "0"], "N >= 1"),
        (["--not-an-option"], "No such option"),
        (["--strict-exp", "fast"], "--strict-exp 'fast': choose portable or native"),
        (["--strict", "all,bogus"], "--strict: unknown op(s) bogus"),
        (["--temperature", "0.5"], "--temperature applies to rollouts and would not take effect in prompt mode"),
        (["--max-new-tokens", "8"], "--max-new-tokens applies to rollouts"),
        (["--max-new-tokens", "32"], "--max-new-tokens applies to rollouts"),  # the rollout default, given: refused too
        (["--strict-exp", "native"], "add attention to --strict"),
        (["--strict", "rmsnorm", "--strict-exp", "native"], "add attention to --strict"),
        (["--strict", "--strict-exp", "native", "--device", "cpu"], "use --device cuda"),
        (["--device", "rocm"], "torch names AMD (ROCm) GPUs cuda devices; pass --device cuda"),
        (["--strict-attention", "fa2"], "--strict-attention 'fa2': choose portable or flash"),
        (["--strict-attention", "flash"], "add attention to --strict"),
        (["--strict", "--strict-attention", "flash", "--device", "cpu"], "a CUDA (Hopper) kernel: use --device cuda"),
        (
            ["--mode", "rollout", "--temperature", "inf"],
            "--temperature inf: rollout mode needs a finite temperature > 0",
        ),
    ],
)
def test_usage_errors_are_one_line(capsys, tmp_path, argv, message):
    err = one_line_error(capsys, ["compare", "--out", str(tmp_path / "o"), *argv], EXIT_USAGE)
    assert message in err


def test_strict_on_rocm_is_refused_before_any_engine_starts(capsys, monkeypatch, tmp_path):
    """A ROCm torch (torch.version.hip set; its GPUs are "cuda" devices): --strict is refused in one line
    naming what was not checked and the way on; ALIGNAUDIT_ROCM_UNCHECKED=1 turns the refusal into a warning,
    which the vLLM plugin puts in vLLM's log; without strict ops nothing is said."""
    import torch

    from alignaudit.engines.vllm import plugin as vllm_plugin
    from alignaudit.inputs.strict_ops import check_platform

    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ALIGNAUDIT_ROCM_UNCHECKED", raising=False)
    err = one_line_error(capsys, ["compare", "--strict", "--device", "cuda", "--out", str(tmp_path / "o")], EXIT_USAGE)
    assert "--strict on ROCm (torch HIP 6.4.43482)" in err and "ALIGNAUDIT_ROCM_UNCHECKED=1" in err
    assert not (tmp_path / "o").exists()
    monkeypatch.setenv("ALIGNAUDIT_STRICT", "rmsnorm")
    monkeypatch.setattr(vllm_plugin, "_applied", set())
    with pytest.raises(InputError, match="ALIGNAUDIT_STRICT on ROCm"):
        vllm_plugin.register()
    assert vllm_plugin._applied == set()  # refused before any op was patched
    assert check_platform(frozenset()) is None
    from alignaudit.engines.hf.strict import make_strict

    with pytest.raises(InputError, match="make_strict on ROCm"):  # what users build into their trainer
        make_strict(object(), frozenset({"linear"}))
    monkeypatch.setenv("ALIGNAUDIT_ROCM_UNCHECKED", "1")
    assert check_platform(frozenset({"linear"})).startswith("warning: --strict on ROCm")
    monkeypatch.setattr(torch.version, "hip", None)
    assert check_platform(frozenset({"linear"})) is None


def test_bad_model_and_prompt_files(capsys, tmp_path):
    arch = tmp_path / "mamba"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    assert "supported: Qwen3ForCausalLM" in one_line_error(capsys, ["compare", "--model", str(arch)], EXIT_USAGE)
    for content, message in [
        ("", "is empty"),
        ('{"token_ids": [1, 600]}', "outside the vocabulary [0, 512)"),
        (json.dumps({"token_ids": [1] * 2000}), "longer than the model's max length"),
    ]:
        f = tmp_path / "p.jsonl"
        f.write_text(content)
        assert message in one_line_error(capsys, ["compare", "--prompts", str(f)], EXIT_USAGE)


def test_engine_not_installed(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("megatron") else real(name, *a)
    )
    err = one_line_error(capsys, ["compare", "--model", str(FIXTURE)], EXIT_ENGINE)
    assert "megatron.core, which is not installed; pip install 'alignaudit[megatron]'" in err


def test_unknown_engine_option_is_an_input_error(capsys, tmp_path):
    err = one_line_error(
        capsys,
        ["compare", "--train", "hf", "--infer", "hf", "--infer-opt", "flash=1", "--out", str(tmp_path / "x")],
        EXIT_USAGE,
    )
    assert "hf does not understand option(s) flash" in err


def test_option_typo_on_the_second_engine_stops_before_the_first_runs(capsys, tmp_path):
    out = tmp_path / "typo"
    err = one_line_error(
        capsys,
        [
            "compare",
            "--model",
            str(FIXTURE),
            "--train",
            "hf",
            "--infer",
            "vllm",
            "--infer-opt",
            "max_num_seqz=4",
            "--out",
            str(out),
        ],
        EXIT_USAGE,
    )
    assert "vllm does not understand option(s) max_num_seqz" in err
    assert not (out / "train").exists()


def test_help_lists_commands_and_examples():
    proc = run_cli("compare", "--help")
    assert proc.returncode == 0 and "--train-opt" in proc.stdout and "self-consistency" in proc.stdout


def test_capture_twice_then_diff_anywhere(tmp_path, capsys):
    """Two captures made separately (as in two containers), compared afterwards: ops, logprobs and (--full-vocab)
    whole distributions."""
    import shutil

    a, b = tmp_path / "megatron", tmp_path / "hf"
    sel = ["--layers", "0", "--ops", "input_norm,attn", "--full-vocab"]
    assert cli.main(["capture", "--engine", "megatron", *sel, "--out", str(a)]) == EXIT_OK
    assert cli.main(["capture", "--engine", "hf", *sel, "--out", str(b)]) == EXIT_OK
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["ops"]["ops"] == 2 and manifest["ops"]["selection"]["names"] == ["attn", "input_norm"]
    capsys.readouterr()
    assert cli.main(["diff", str(a), str(b), "--out", str(tmp_path / "d")]) == EXIT_OK
    assert "layers.0.input_norm" in capsys.readouterr().out
    ops = pd.read_parquet(tmp_path / "d" / "ops.parquet").set_index("op")
    assert list(ops.index) == ["layers.0.input_norm", "layers.0.attn", "logprobs"]
    assert ops.loc["layers.0.input_norm", "status"] == "differs" and ops.loc["logprobs", "status"] == "differs"
    vocab = json.loads((tmp_path / "d" / "summary.json").read_text())["vocab"]
    assert vocab["positions"] == 176 and vocab["kl_train_infer"]["mean"] > 0
    assert vocab["row_token_mismatches"] == {"train": 0, "infer": 0}
    err = one_line_error(
        capsys,
        ["capture", "--engine", "hf", "--full-vocab", "--reference", str(a), "--out", str(tmp_path / "fv")],
        EXIT_USAGE,
    )
    assert "--full-vocab records each engine's own rows" in err

    other_prompts = tmp_path / "other-prompts"
    assert (
        cli.main(
            [
                "capture",
                "--engine",
                "hf",
                "--no-ops",
                "--random-prompts",
                "2",
                "--prompt-len",
                "8",
                "--out",
                str(other_prompts),
            ]
        )
        == EXIT_OK
    )
    err = one_line_error(capsys, ["diff", str(a), str(other_prompts), "--out", str(tmp_path / "d2")], EXIT_USAGE)
    assert "different token ids" in err

    other_model = tmp_path / "model-copy"
    shutil.copytree(FIXTURE, other_model)
    (other_model / "config.json").write_text(
        (FIXTURE / "config.json").read_text().replace('"use_cache": true', '"use_cache": false')
    )
    other_ckpt = tmp_path / "other-ckpt"
    assert (
        cli.main(["capture", "--engine", "hf", "--no-ops", "--model", str(other_model), "--out", str(other_ckpt)])
        == EXIT_OK
    )
    err = one_line_error(capsys, ["diff", str(b), str(other_ckpt), "--out", str(tmp_path / "d3")], EXIT_USAGE)
    assert "different checkpoints" in err
    err = one_line_error(
        capsys,
        [
            "capture",
            "--engine",
            "hf",
            "--model",
            str(other_model),
            "--reference",
            str(a),
            "--layers",
            "0",
            "--out",
            str(tmp_path / "r"),
        ],
        EXIT_USAGE,
    )
    assert "captured from another checkpoint than --model" in err  # the same token ids, another model's values
    err = one_line_error(capsys, ["diff", str(a), f"{tmp_path}/./megatron/", "--out", str(tmp_path / "d5")], EXIT_USAGE)
    assert "a capture compared with itself is identical" in err  # however the path is spelled
    shutil.copytree(a, tmp_path / "copy")
    err = one_line_error(capsys, ["diff", str(a), str(tmp_path / "copy"), "--out", str(tmp_path / "d6")], EXIT_USAGE)
    assert "hold one capture (one is a copy of the other)" in err
    for capture in (a, tmp_path / "copy"):  # as captures written before capture_id: the manifests' bytes tell
        manifest = json.loads((capture / "manifest.json").read_text())
        del manifest["capture_id"]
        (capture / "manifest.json").write_text(json.dumps(manifest))
    err = one_line_error(capsys, ["diff", str(a), str(tmp_path / "copy"), "--out", str(tmp_path / "d6")], EXIT_USAGE)
    assert "hold one capture (one is a copy of the other)" in err
    err = one_line_error(
        capsys, ["capture", "--engine", "hf", "--no-ops", "--layers", "0", "--out", str(tmp_path / "n")], EXIT_USAGE
    )
    assert "--layers/--ops select ops to capture and --no-ops captures none" in err
    assert not any((tmp_path / name).exists() for name in ("r", "d5", "d6", "n"))

    (b / "manifest.json").unlink()
    err = one_line_error(capsys, ["diff", str(a), str(b), "--out", str(tmp_path / "d4")], EXIT_USAGE)
    assert "incomplete" in err
    err = one_line_error(
        capsys,
        ["capture", "--engine", "hf", "--reference", str(other_prompts), "--out", str(tmp_path / "f")],
        EXIT_USAGE,
    )
    assert "has no per-op tensors" in err


def test_strict_exp_native_is_refused_where_it_would_not_take_effect(capsys, tmp_path):
    """native needs strict attention and CUDA (every engine's strict attention takes it there); ablate has
    rows without strict attention. Each refuses --strict-exp native before any engine starts."""
    from alignaudit.inputs.strict_ops import check_strict_exp

    with pytest.raises(InputError, match="add attention to --strict"):
        check_strict_exp("native", frozenset({"linear"}), "cuda")
    with pytest.raises(InputError, match="use --device cuda"):
        check_strict_exp("native", frozenset({"attention"}), "cpu")
    assert check_strict_exp("native", frozenset({"attention"}), "cuda") == "native"
    err = one_line_error(capsys, ["ablate", "--strict-exp", "native", "--out", str(tmp_path / "a")], EXIT_USAGE)
    assert "would not use --strict-exp" in err


def test_strict_attention_flash_is_refused_where_it_would_not_take_effect(capsys, tmp_path, monkeypatch):
    """flash is FlashAttention-3 in every engine: it needs strict attention, CUDA, the portable exp setting, bf16 or
    fp16 on both sides (the refusal names the option that set the other dtype), a head size FlashAttention takes, no
    ALIGNAUDIT_BACKWARD=reference where the run trains, and vLLM's compiled FA3; either kernel given without strict
    attention is refused too, and ablate has rows without strict attention. Each is refused by name before any engine
    starts (this machine's vLLM, the CPU wheel, has no FA3)."""
    from alignaudit.inputs.strict_ops import check_strict_attention, fa3_library

    attention = frozenset({"attention"})
    bf16 = (("--dtype", "bf16"), ("--dtype", "bf16"))
    cases = [
        (("flash", frozenset({"linear"}), "cuda", "portable", bf16, 128), "add attention to --strict"),
        (("portable", frozenset(), "cpu", "portable", bf16, 128), "add attention to --strict, or drop"),
        (("flash", attention, "cpu", "portable", bf16, 128), "use --device cuda"),
        (("flash", attention, "cuda", "native", bf16, 128), "--strict-exp native chooses the exp of alignaudit's"),
        (
            ("flash", attention, "cuda", "portable", (("--dtype", "bf16"), ("--infer-dtype", "fp32")), 128),
            "computes bf16 and fp16, not fp32: set --infer-dtype bf16",
        ),
        (("flash", attention, "cuda", "portable", bf16, 260), "this model's is 260"),
        (("flash", attention, "cuda", "portable", (("--dtype", "fp16"),) * 2, 12), "this model's is 12"),
    ]
    for args, message in cases:
        with pytest.raises(InputError, match=message):
            check_strict_attention(*args)
    assert check_strict_attention(None, frozenset(), "cpu", "native", (("--dtype", "fp32"),), 3) == "portable"
    assert check_strict_attention("portable", attention, "cpu", "portable", bf16, 3) == "portable"
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "reference")
    with pytest.raises(InputError, match="ALIGNAUDIT_BACKWARD=reference would not reach --strict-attention flash"):
        check_strict_attention("flash", attention, "cuda", "portable", bf16, 128, trains=True)
    monkeypatch.delenv("ALIGNAUDIT_BACKWARD")
    if not fa3_library():
        with pytest.raises(InputError, match="install vLLM for CUDA"):
            check_strict_attention("flash", attention, "cuda", "portable", bf16, 128)
    err = one_line_error(capsys, ["ablate", "--strict-attention", "flash", "--out", str(tmp_path / "a")], EXIT_USAGE)
    assert "would not use --strict-attention" in err
    for command in (["capture", "--engine", "hf"], ["rescore", str(tmp_path / "none.jsonl"), "--train", "hf"]):
        err = one_line_error(
            capsys, [*command, "--strict-attention", "flash", "--out", str(tmp_path / "c")], EXIT_USAGE
        )
        assert "add attention to --strict, or drop --strict-attention" in err, err
    err = one_line_error(
        capsys,
        ["capture", "--engine", "hf", "--strict", "--strict-attention", "flash", "--out", str(tmp_path / "d")],
        EXIT_USAGE,
    )
    assert "a CUDA (Hopper) kernel: use --device cuda" in err


def test_a_vllm_on_another_attention_kernel_is_refused():
    """The read-back of a built vLLM: strict attention on the flash kernel where the portable one was asked for (an
    ALIGNAUDIT_STRICT_ATTENTION left in a framework's environment) is an EngineError naming the variable."""
    from alignaudit.engines.vllm.weights import check_strict_kernels
    from alignaudit.errors import EngineError

    kernels = {
        "strict_ops": ["attention"],
        "linear_methods": [],
        "attention_impls": {"StrictFlashAttentionImpl": "portable"},
    }
    check_strict_kernels({**kernels, "attention_kernels": ["portable"]}, frozenset({"attention"}))
    check_strict_kernels({**kernels, "attention_kernels": ["flash"]}, frozenset({"attention"}), "flash")
    with pytest.raises(EngineError, match="ALIGNAUDIT_STRICT_ATTENTION"):
        check_strict_kernels({**kernels, "attention_kernels": ["flash"]}, frozenset({"attention"}))


def test_kernel_switches_are_refused_before_any_engine(capsys, tmp_path, monkeypatch):
    """ALIGNAUDIT_MOE_DISPATCH and ALIGNAUDIT_BACKWARD reach the strict kernels in every engine's process: an unknown
    value, the grouped (Triton) dispatch on a CPU run, or a value where it would change nothing, is refused by name
    before an engine starts."""
    monkeypatch.setenv("ALIGNAUDIT_MOE_DISPATCH", "fused")
    err = one_line_error(
        capsys, ["compare", "--model", "qwen3-moe-tiny", "--strict", "--out", str(tmp_path / "a")], EXIT_USAGE
    )
    assert "ALIGNAUDIT_MOE_DISPATCH='fused': use one of auto, gathered, grouped, every_expert" in err
    monkeypatch.setenv("ALIGNAUDIT_MOE_DISPATCH", "grouped")
    err = one_line_error(
        capsys, ["compare", "--model", "qwen3-moe-tiny", "--strict", "--out", str(tmp_path / "b")], EXIT_USAGE
    )
    assert "ALIGNAUDIT_MOE_DISPATCH=grouped is a Triton kernel and runs on CUDA only (--device cuda)" in err
    monkeypatch.delenv("ALIGNAUDIT_MOE_DISPATCH")
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "flash")
    err = one_line_error(capsys, ["compare", "--strict", "--out", str(tmp_path / "c")], EXIT_USAGE)
    assert "ALIGNAUDIT_BACKWARD='flash': use one of auto, reference, fused" in err
    # known values where they would change nothing: compare computes no gradient; a dense model has no MoE layer
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    err = one_line_error(capsys, ["compare", "--strict", "--out", str(tmp_path / "d")], EXIT_USAGE)
    assert "ALIGNAUDIT_BACKWARD=fused sets the strict ops' backward, and this command computes no gradient" in err
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "reference")  # set, not the default (auto): refused the same way
    err = one_line_error(capsys, ["compare", "--strict", "--out", str(tmp_path / "d")], EXIT_USAGE)
    assert "ALIGNAUDIT_BACKWARD=reference sets the strict ops' backward, and this command computes no gradient" in err
    monkeypatch.delenv("ALIGNAUDIT_BACKWARD")
    monkeypatch.setenv("ALIGNAUDIT_MOE_DISPATCH", "gathered")
    err = one_line_error(capsys, ["compare", "--strict", "--out", str(tmp_path / "e")], EXIT_USAGE)
    assert "ALIGNAUDIT_MOE_DISPATCH=gathered sets the strict MoE layer's dispatch, which runs only for a " in err
    # the Python API builds models for the caller's trainer: the same rules, in its argument names
    from alignaudit import api

    with pytest.raises(InputError, match="mixture-of-experts model with linear in ops; unset it"):
        api.strict_hf_model("qwen3-tiny", device="cpu")
    monkeypatch.setenv("ALIGNAUDIT_MOE_DISPATCH", "grouped")
    with pytest.raises(InputError, match=r"runs on CUDA only \(device='cuda'\)"):
        api.strict_hf_model("qwen3-moe-tiny", device="cpu")
    monkeypatch.delenv("ALIGNAUDIT_MOE_DISPATCH")
    # rl trains, but on the CPU the fused backward changes only strict attention's
    monkeypatch.setenv("ALIGNAUDIT_BACKWARD", "fused")
    err = one_line_error(capsys, ["rl", "--strict", "linear,rmsnorm", "--out", str(tmp_path / "f")], EXIT_USAGE)
    assert "none of which --strict makes strict here; add attention to --strict or unset it" in err
    with pytest.raises(InputError, match="none of which ops makes strict here"):
        api.strict_megatron_model(ops="linear", device="cpu")
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_a_rollout_audited_across_containers_capture_rollout_then_tokens_from_then_diff_and_gate(tmp_path, capsys):
    """The rollout engine samples in its own container (capture --mode rollout), the trainer scores those token
    ids in another (capture --tokens-from), diff compares them anywhere and gate judges the diff: strict on both
    sides, every token (the prompts' too: --prompt-logprobs), the 32 sampled ones included, bitwise equal."""
    rollout, train, diff = tmp_path / "rollout", tmp_path / "train", tmp_path / "d"
    assert (
        cli.main(
            [
                "capture",
                "--engine",
                "vllm",
                "--strict",
                "--mode",
                "rollout",
                "--max-new-tokens",
                "8",
                "--prompt-logprobs",
                "--ignore-eos",
                "--out",
                str(rollout),
            ]
        )
        == EXIT_OK
    )
    manifest = json.loads((rollout / "manifest.json").read_text())
    assert manifest["mode"] == "rollout" and manifest["rollout"]["max_new_tokens"] == 8
    assert (
        cli.main(
            [
                "capture",
                "--engine",
                "megatron",
                "--strict",
                "--no-ops",
                "--tokens-from",
                str(rollout),
                "--out",
                str(train),
            ]
        )
        == EXIT_OK
    )
    assert cli.main(["diff", str(train), str(rollout), "--out", str(diff)]) == EXIT_OK
    summary = json.loads((diff / "summary.json").read_text())
    assert summary["generated"]["tokens_compared"] == 32 and summary["tokens_compared"] == 176 + 32
    assert summary["mismatches"] == 0 and summary["generated"]["mismatches"] == 0
    imp = summary["importance"]  # the sampled tokens, bitwise equal: every ratio exactly 1, nothing truncated
    assert imp["scope"] == "generated" and imp["tokens"] == 32 and imp["sequences"] == 4
    for key in (
        "token_ratio_min",
        "token_ratio_max",
        "seq_ratio_min",
        "seq_ratio_max",
        "geo_ratio_min",
        "geo_ratio_max",
        "token_tis_weight_mean",
        "seq_tis_weight_mean",
        "token_ess",
        "seq_ess",
    ):
        assert imp[key] == 1.0, key
    assert all(imp[key] == 0.0 for key in imp if "fraction" in key or key.startswith(("kl_", "chi2")))
    assert importance_by_hand(pd.read_parquet(diff / "tokens.parquet"))["token_tis_fraction"] == 0.0
    assert cli.main(["gate", str(diff)]) == EXIT_OK
    capsys.readouterr()
    for argv, message in (
        (["--engine", "megatron", "--mode", "rollout"], "megatron does not sample rollouts"),
        (["--engine", "vllm", "--mode", "rollout", "--tokens-from", str(rollout)], "--tokens-from scores given tokens"),
        (
            ["--engine", "hf", "--tokens-from", str(rollout), "--random-prompts", "2"],
            "--tokens-from gives the token ids",
        ),
        (
            ["--engine", "hf", "--model", "llama-tiny", "--tokens-from", str(rollout)],
            "captured from another checkpoint",
        ),
        (
            ["--engine", "megatron", "--tokens-from", str(rollout), "--top-k", "5"],
            "--top-k: --tokens-from scores a rollout's tokens under the sampling settings its capture "
            "recorded; drop --top-k",
        ),
    ):
        assert message in one_line_error(capsys, ["capture", *argv, "--out", str(tmp_path / "bad")], EXIT_USAGE)
