"""Bisect on the real engines and the fixture: which op diverges first, and which ops compute differently.

Facts measured on this machine (2026-11-29; versions in tests/engines/test_engines.py), 4 built-in prompts:
- bf16, megatron vs hf: the first diverging op is layer 0 input_norm. HF's Qwen3RMSNorm rounds the
  normalized activations to bf16 before the weight multiply; torch.nn.RMSNorm (Megatron's local spec)
  rounds once. Forced mode lists every RMSNorm (input, q, k, post-attention, final) in every layer, plus
  attention (Megatron scales inside baddbmm, HF after the matmul) and logprobs (Megatron's cross-entropy
  formula vs log_softmax, 1 ULP); all GEMMs, rotary, SiLU-and-mul and residual adds are bitwise equal.
- bf16, vllm (eager) vs hf: the rotary embedding (vLLM's C++ kernel) is first; with vLLM's custom ops
  off (compilation_config custom_ops ["none"]) the first moves to attention.
- fp32, vllm vs hf: q/k/v projection first (vLLM's oneDNN GEMM vs torch.nn.functional.linear); on an Intel
  AVX-512/AMX CPU the projections agree and the rotary embedding is first.
- fp32, megatron vs hf: attention is first and, in forced mode, attention and logprobs are the only ops
  that compute differently (an earlier probe expected no op to diverge in fp32; on this CPU baddbmm with
  alpha and matmul-then-scale round differently); on an Intel AVX-512/AMX CPU attention agrees and logprobs
  is first. Tests marked ``isa`` run again under ATEN_CPU_CAPABILITY=default in ``make test``.
"""

from __future__ import annotations

import json

import pytest

from alignaudit.comparison.op_diff import DIFFERS, EQUAL, first_divergence
from alignaudit.pipelines.runs import diff_ops

pytestmark = pytest.mark.engines

GEMMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_norm", "q_norm", "k_norm", "post_attn_norm")


def by_op(records):
    return {r["op"]: r for r in records}


@pytest.fixture(scope="module")
def megatron_hf_bf16(captures):
    train = captures.get("megatron", "bf16", ops=True)
    natural = diff_ops(train, captures.get("hf", "bf16", ops=True))
    forced = diff_ops(train, captures.get("hf", "bf16", reference=train))
    return natural, forced


@pytest.mark.isa
def test_bf16_megatron_vs_hf_first_divergence_is_input_norm(megatron_hf_bf16):
    natural, _ = megatron_hf_bf16
    first = first_divergence(natural)
    assert first["op"] == "layers.0.input_norm"
    assert by_op(natural)["embed"]["status"] == EQUAL
    w = first["worst"]
    assert w["ulp"] == 1 and w["train_hex"] != w["infer_hex"] and len(w["index"]) == 1
    assert 0.6 < first["equal_fraction"] < 0.9 and first["ulp_max"] == 1


@pytest.mark.isa
def test_bf16_megatron_vs_hf_forced_lists_every_norm_and_nothing_else(megatron_hf_bf16):
    _, forced = megatron_hf_bf16
    ops = by_op(forced)
    differing = {r["op"] for r in forced if r["status"] == DIFFERS}
    expected = {f"layers.{i}.{n}" for i in range(2) for n in (*NORMS, "attn")} | {"final_norm", "logprobs"}
    assert differing == expected
    for i in range(2):
        for name in (*GEMMS, "q_rope", "k_rope", "act", "attn_residual", "mlp_residual"):
            assert ops[f"layers.{i}.{name}"]["status"] == EQUAL, name
        for name in NORMS:
            assert ops[f"layers.{i}.{name}"]["ulp_max"] == 1
    assert ops["logits"]["status"] == EQUAL and ops["logprobs"]["ulp_max"] == 1


@pytest.mark.isa
def test_bf16_vllm_vs_hf_rope_first_then_attention_without_custom_ops(captures):
    hf = captures.get("hf", "bf16", ops=True)
    natural = diff_ops(hf, captures.get("vllm", "bf16", ops=True))
    assert first_divergence(natural)["op"] == "layers.0.q_rope"
    ops = by_op(natural)
    assert all(
        ops[f"layers.0.{n}"]["status"] == EQUAL
        for n in ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm")
    )
    assert ops["logits"]["note"].startswith("first")  # vLLM computes prompt logits for all but the last position
    native = captures.get("vllm", "bf16", ops=True, compilation_config={"custom_ops": ["none"]})
    assert native.manifest["engine_settings"]["llm"]["compilation_config"] == {"custom_ops": ["none"]}
    assert first_divergence(diff_ops(hf, native))["op"] == "layers.0.attn"


@pytest.mark.isa
def test_fp32_vllm_vs_hf_projection_or_rope_first(captures):
    """Which of vLLM's two own kernels in layer 0 parts first from torch's depends on the CPU: the q projection
    (oneDNN GEMM vs torch.nn.functional.linear) on AVX2 and AMD AVX-512, the rotary embedding (vLLM's C++ kernel)
    on an Intel AVX-512/AMX CPU, where the projections agree. Everything before it agrees on every CPU."""
    natural = diff_ops(captures.get("hf", "fp32", ops=True), captures.get("vllm", "fp32", ops=True))
    first = first_divergence(natural)
    assert first["op"] in ("layers.0.q_proj", "layers.0.q_rope") and first["dtype"] == "float32"
    ops = by_op(natural)
    before = ["embed", "layers.0.input_norm"] + (
        ["layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj"] if first["op"] == "layers.0.q_rope" else []
    )
    assert all(ops[name]["status"] == EQUAL for name in before)


@pytest.mark.isa
def test_fp32_megatron_vs_hf_only_attention_and_logprobs_differ(captures):
    """Forced mode (each op fed the same inputs) lists the ops that compute differently: within attention and
    logprobs on every CPU (attention agrees on an Intel AVX-512/AMX CPU, differs on AVX2 and AMD AVX-512;
    logprobs differs on all). Natural mode's first divergence is then, by construction, the first of them."""
    train = captures.get("megatron", "fp32", ops=True)
    natural = diff_ops(train, captures.get("hf", "fp32", ops=True))
    forced = [r["op"] for r in diff_ops(train, captures.get("hf", "fp32", reference=train)) if r["status"] == DIFFERS]
    assert "logprobs" in forced and set(forced) <= {"layers.0.attn", "layers.1.attn", "logprobs"}
    assert first_divergence(natural)["op"] == forced[0]


def test_forced_capture_records_substitutions(captures):
    train = captures.get("megatron", "bf16", ops=True)
    forced = captures.get("hf", "bf16", reference=train)
    assert forced.manifest["ops"]["mode"] == "forced" and forced.manifest["ops"]["substituted_ops"] == 37
    assert train.manifest["ops"]["mode"] == "natural" and train.manifest["ops"]["ops"] == 37


def test_cli_bisect_selection_and_outputs(tmp_path):
    from alignaudit.commands import cli

    out = tmp_path / "b"
    code = cli.main(
        [
            "bisect",
            "--train",
            "megatron",
            "--infer",
            "hf",
            "--layers",
            "1",
            "--ops",
            "input_norm,q_proj,attn,final_norm",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "bisect.json").read_text())
    ops = [r["op"] for r in result["natural"]["records"]]
    assert ops == ["layers.1.input_norm", "layers.1.q_proj", "layers.1.attn", "final_norm", "logprobs"]
    assert result["natural"]["first_divergence"]["op"] == "layers.1.input_norm"
    assert set(result["forced"]["differing_ops"]) == {"layers.1.input_norm", "layers.1.attn", "final_norm"}
    # logits were not selected, so the reference holds none to force: logprobs is shown, not judged
    assert result["forced"]["unforced_ops"] == ["logprobs"]
    assert (out / "ops-natural.parquet").is_file() and (out / "ops-forced.parquet").is_file()
    assert "first diverging op: layers.1.input_norm" in (out / "report.html").read_text()


def test_bisect_help_explains_both_modes():
    from typer.testing import CliRunner

    from alignaudit.commands.cli import app

    result = CliRunner().invoke(app, ["bisect", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "natural" in result.output and "forced" in result.output and "first op whose outputs differ" in result.output


def test_an_op_removed_from_a_capture_is_reported_missing_by_diff(captures, tmp_path, capsys):
    """One op's rows cut out of a capture's ops index, its manifest checksum recomputed: diff refuses and
    names the op (exit 2, nothing written), instead of moving the first divergence to the next op."""
    import hashlib
    import shutil

    import pandas as pd

    from alignaudit.errors import EXIT_USAGE
    from helpers import one_line_error

    train = captures.get("megatron", "bf16", ops=True)
    damaged = tmp_path / "hf"
    shutil.copytree(captures.get("hf", "bf16", ops=True).path, damaged)
    index = damaged / "ops" / "index.parquet"
    table = pd.read_parquet(index)
    table[table["op"] != "layers.0.input_norm"].to_parquet(index, index=False)
    argv = ["diff", str(train.path), str(damaged), "--out", str(tmp_path / "d")]
    assert "index.parquet is missing or is not the file the capture wrote" in one_line_error(capsys, argv, EXIT_USAGE)
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["ops"]["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    assert "op layers.0.input_norm is missing" in one_line_error(capsys, argv, EXIT_USAGE)
    assert not (tmp_path / "d").exists()
