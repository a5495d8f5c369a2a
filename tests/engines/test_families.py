"""Model families beyond Qwen3, on their tiny fixtures with the real engines: Qwen2 (q/k/v biases, tied
lm_head, no QK-norm) and Llama (llama3 rope scaling, tied lm_head, no QK-norm).

Per family: the default megatron and vllm differ and bisect names the first op that does; under --strict,
vllm's and hf's rollouts (prompt logprobs from their prompt path, sampled-token logprobs from their decode
with a KV cache) are reproduced bit for bit by megatron rescoring the same tokens. For Llama, the llama3
frequencies of the strict tables match each engine's own formula, and megatron applies the scaling in its
default path too (fp32, a small difference to hf instead of a wrong rotation).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from alignaudit.comparison.op_diff import first_divergence
from alignaudit.inputs.checkpoint import load_spec
from alignaudit.inputs.prompts import load_prompts
from alignaudit.pipelines.runs import diff_captures, diff_ops
from helpers import ROOT, CaptureCache, one_line_error

pytestmark = [pytest.mark.engines, pytest.mark.long]

ROLLOUT = {"max_new_tokens": 16, "temperature": 1.0, "seed": 0}
FAMILIES = ("qwen2-tiny", "llama-tiny")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    spec = load_spec(ROOT / "fixtures" / request.param)
    cache = CaptureCache(tmp_path_factory.mktemp(request.param), spec, load_prompts(spec))
    cache.name = request.param
    cache.diff = lambda a, b: diff_captures(a, b, cache.root / f"{a.path.name}-vs-{b.path.name}")
    return cache


def test_fixture_is_its_family(family):
    s = family.spec
    assert not s.qk_norm and s.tie_word_embeddings and (s.num_heads, s.num_kv_heads, s.head_dim) == (4, 2, 32)
    if family.name == "qwen2-tiny":
        assert s.architecture == "Qwen2ForCausalLM" and s.attention_bias and s.rope_llama3 is None
    else:
        assert s.architecture == "LlamaForCausalLM" and not s.attention_bias
        assert s.rope_llama3 == (32.0, 1.0, 4.0, 8192)


def test_default_megatron_and_vllm_differ_and_bisect_names_the_first_op(family):
    megatron, vllm = family.get("megatron", "bf16", ops=True), family.get("vllm", "bf16", ops=True)
    assert family.diff(megatron, vllm)["mismatches"] > 100
    records = diff_ops(megatron, vllm)
    assert not any(r["op"].endswith(("q_norm", "k_norm")) for r in records)  # no QK-norm in these families
    first = first_divergence(records)
    # Megatron's RMSNorm (torch.nn.functional.rms_norm) and vLLM's rounding differ in a quarter of the
    # elements by 1 ULP, as for Qwen3 (docs/findings.md)
    assert first["op"] == "layers.0.input_norm" and first["ulp_max"] == 1, first
    assert 0.5 < first["equal_fraction"] < 0.95


@pytest.mark.parametrize("sampler", ["vllm", "hf"])
def test_strict_rollout_is_reproduced_bit_for_bit_by_megatron(family, sampler):
    sampled = family.get(sampler, "bf16", strict="all", rollout=ROLLOUT)
    s = family.diff(family.get("megatron", "bf16", strict="all", batch=sampled), sampled)
    assert s["generated"]["tokens_compared"] == 4 * 16 and s["generated"]["mismatches"] == 0
    assert s["tokens_compared"] > 4 * 16 and s["mismatches"] == 0 and s["ulp_max"] == 0


def test_llama3_frequencies_match_every_engine():
    """alignaudit_kernels' float64 llama3 frequencies against transformers', vLLM's and Megatron's fp32 ones
    (Llama-3.2-1B: head_dim 64, theta 5e5, factor 32): within fp32 rounding, and scaled where they should be."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding as MegatronRope
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    import alignaudit_kernels as K
    from alignaudit.arch import PRESETS

    config = PRESETS["Llama-3.2-1B"].config
    ours = K.inverse_frequencies(64, 5e5, (32.0, 1.0, 4.0, 8192))
    plain = K.inverse_frequencies(64, 5e5)
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**config), "cpu")
    # vLLM's module needs a running engine's config to be built; its frequency method needs only these fields
    vllm_rope = object.__new__(Llama3RotaryEmbedding)
    for field, value in dict(
        rotary_dim=64, scaling_factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, orig_max_position=8192
    ).items():
        object.__setattr__(vllm_rope, field, value)
    vllm = vllm_rope._compute_inv_freq(5e5)
    megatron = MegatronRope(
        64, 1.0, rotary_base=5e5, rope_scaling=True, rope_scaling_factor=32.0, use_cpu_initialization=True
    ).inv_freq
    for name, theirs in (("transformers", hf), ("vllm", vllm), ("megatron", megatron)):
        assert torch.allclose(theirs.double(), ours, rtol=4e-7, atol=0), name
    wavelength = 2 * math.pi / plain
    assert torch.equal(ours[wavelength < 8192 / 4], plain[wavelength < 8192 / 4])
    assert torch.equal(ours[wavelength > 8192], plain[wavelength > 8192] / 32)
    assert int((ours != plain).sum()) > 16


def test_megatron_applies_llama3_scaling_in_its_default_path(tmp_path_factory):
    """Without the scaling, every position past a few would rotate by other angles: fp32 logprobs would
    differ by O(1). With it, megatron and hf (both stock) differ by fp32 rounding only."""
    spec = load_spec(ROOT / "fixtures" / "llama-tiny")
    cache = CaptureCache(tmp_path_factory.mktemp("llama-fp32"), spec, load_prompts(spec))
    s = diff_captures(cache.get("megatron", "fp32"), cache.get("hf", "fp32"), cache.root / "diff")
    assert s["max_abs_diff"] < 1e-3


def test_fixtures_by_name_and_inputs_that_are_not_models(capsys, tmp_path):
    from alignaudit.pipelines.requests import ModelArgs, resolve_model_arg

    assert resolve_model_arg(ModelArgs(model="llama-tiny")).architecture == "LlamaForCausalLM"
    err = one_line_error(
        capsys, ["compare", "--model", "Llama-3.2-2B", "--random-weights", "--out", str(tmp_path / "o")], 2
    )
    assert "'Llama-3.2-2B' is not a preset; did you mean Llama-3.2-" in err and "Llama-3.2-1B" in err
    moe = _edited(tmp_path, "qwen3-moe-tiny", num_experts_per_tok=9)
    err = one_line_error(
        capsys,
        ["compare", "--model", str(moe), "--train", "megatron", "--infer", "hf", "--out", str(tmp_path / "o")],
        2,
    )
    assert "num_experts_per_tok 9 must be between 1 and num_experts 8" in err
    gpt2 = _edited(tmp_path, "qwen2-tiny", architectures=["GPT2LMHeadModel"])
    err = one_line_error(capsys, ["compare", "--model", str(gpt2), "--out", str(tmp_path / "o")], 2)
    assert err.startswith(f"error: {gpt2 / 'config.json'}: architecture GPT2LMHeadModel is not supported; supported: ")


def test_qk_norm_ops_are_refused_for_a_model_without_qk_norm(capsys, tmp_path):
    err = one_line_error(
        capsys,
        [
            "bisect",
            "--model",
            str(ROOT / "fixtures" / "qwen2-tiny"),
            "--train",
            "megatron",
            "--infer",
            "hf",
            "--ops",
            "q_norm,attn",
            "--out",
            str(tmp_path / "o"),
        ],
        2,
    )
    assert "--ops q_norm: this model has no QK-norm" in err and not (tmp_path / "o").exists()


def _edited(tmp_path, fixture, **fields):
    model = tmp_path / fixture
    shutil.copytree(ROOT / "fixtures" / fixture, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    return model


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "fixture, fields, engines, message",
    [
        (
            "llama-tiny",
            {"attention_bias": True},
            ("megatron", "vllm"),
            "attention_bias=True is not supported for LlamaForCausalLM: transformers and vLLM then add an o_proj bias",
        ),
        (
            "llama-tiny",
            {"rope_scaling": {**LLAMA3, "high_freq_factor": 2.0}},
            ("megatron", "vllm"),
            "rope_scaling is not supported with megatron: Megatron's llama3 rope scaling fixes low_freq_factor 1",
        ),
        (
            "qwen3-tiny",
            {"rope_scaling": LLAMA3},
            ("megatron", "vllm"),
            "rope_type 'llama3' in",
        ),  # Qwen3 has no llama3 scaling in any engine
        (
            "qwen2-tiny",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
            ("megatron", "vllm"),
            "rope_type 'yarn' in",
        ),
    ],
)
def test_what_a_family_cannot_run_alike_is_refused_before_any_engine(
    capsys, tmp_path, fixture, fields, engines, message
):
    model = _edited(tmp_path, fixture, **fields)
    err = one_line_error(
        capsys,
        ["compare", "--model", str(model), "--train", engines[0], "--infer", engines[1], "--out", str(tmp_path / "o")],
        2,
    )
    assert message in err and not (tmp_path / "o").exists()
