"""The one-GPU memory estimate of `alignaudit rl` (alignaudit.rl.memory): parameter counts against real
checkpoints, the offload fraction it picks, and its refusals before any engine starts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from alignaudit.arch import find_preset
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec, load_spec
from alignaudit.rl.memory import GB, parameter_count, plan
from helpers import ROOT

FIXTURES = ROOT / "fixtures"
H200_GPU, H200_HOST = 150_754_820_096, 137_438_953_472  # torch's total_memory on the H200; 128 GiB host


def _elements(path: Path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def _preset_spec(name: str) -> ModelSpec:
    c = find_preset(name).config
    return ModelSpec(
        name=name,
        path="",
        architecture=c["architectures"][0],
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or 128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        qk_norm=True,
        dtype="bfloat16",
        has_tokenizer=False,
    )


@pytest.mark.parametrize("fixture", ["qwen3-tiny", "qwen2-tiny", "llama-tiny"])
def test_parameter_count_is_every_element_of_the_checkpoint(fixture):
    spec = load_spec(FIXTURES / fixture)
    assert parameter_count(spec) == _elements(FIXTURES / fixture)


def test_qwen3_8b_needs_part_of_its_optimizer_state_on_the_host_of_an_h200():
    spec = _preset_spec("Qwen3-8B")
    assert parameter_count(spec) == 8_190_735_360  # Qwen/Qwen3-8B's safetensors index: 8.19e9
    kv = 2 * 36 * 2 * 8 * 128 * 2 * 4096
    chosen = plan(
        spec, sequences=32, seq_len=128, micro_batch=8, kv_cache_bytes=kv, gpu_total=H200_GPU, host_total=H200_HOST
    )
    assert chosen.offload_fraction == 0.6  # the smallest multiple of 0.05 that fits 0.9 of the GPU
    assert chosen.gpu_needed <= 0.9 * H200_GPU < chosen.gpu_needed + 0.05 * 16 * chosen.parameters
    assert chosen.optimizer_on_gpu == 0.4 * 16 * chosen.parameters
    assert chosen.optimizer_on_host == 0.6 * 16 * chosen.parameters
    # what ran out of memory on the H200 (2026-12-01): 0.45 offloaded; the estimate says it cannot fit
    over = chosen.gpu_needed + 0.15 * 16 * chosen.parameters
    assert over > H200_GPU
    record = chosen.record()
    assert record["offload_fraction"] == 0.6 and json.dumps(record)
    halves = plan(spec, 32, 128, 8, kv, H200_GPU, H200_HOST, tensor_parallel=2)  # rank 0 holds half of the trainer
    assert halves.offload_fraction == 0.0 and halves.optimizer_on_gpu == 6 * chosen.parameters
    with_reference = plan(spec, 32, 128, 8, kv, H200_GPU, H200_HOST, reference=True)
    assert with_reference.trainer_weights_and_grads == 8 * chosen.parameters and with_reference.offload_fraction == 0.75
    small = plan(_preset_spec("Qwen3-1.7B"), 32, 128, 32, kv, H200_GPU, H200_HOST)
    assert small.offload_fraction == 0.0 and small.optimizer_on_gpu == 12 * small.parameters
    assert small.gpu_needed < 60 * GB


def test_plans_that_cannot_fit_are_refused_with_both_estimates():
    spec = _preset_spec("Qwen3-8B")
    with pytest.raises(
        InputError,
        match=r"needs 0\.60 of its optimizer state offloaded .* 79 GB of host memory, "
        r"and this host has 64 GB",
    ):
        plan(spec, 32, 128, 8, 0, H200_GPU, 64 * 10**9)
    with pytest.raises(InputError, match=r"cannot train and roll out on one GPU of 80 GB: .* need \d+ GB"):
        plan(spec, 32, 128, 8, 0, 80 * 10**9, H200_HOST)


def test_the_rollout_kv_cache_holds_one_sequence_of_the_users_max_model_len():
    """vLLM refuses to start with less KV cache than one max_model_len sequence needs. On an H100 (2026-12-06)
    Qwen3-8B with --infer-opt max_model_len=32768 got the prompts' 0.32 GiB and vLLM asked for 4.5 GiB."""
    from alignaudit.engines.vllm.adapter import kv_cache_bytes

    spec = _preset_spec("Qwen3-8B")
    per_token = 36 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head_dim x bf16 bytes
    need, longest = 2 * (512 + 64), 512 + 64
    # that run's vLLM log: kv_cache_memory_bytes 339738624, the prompts' 1152 tokens over model_len's 1024
    assert kv_cache_bytes(spec, "bf16", need, longest, {}) == 2 * per_token * 1152 == 339738624
    assert kv_cache_bytes(spec, "bf16", need, longest, {"max_model_len": 32768}) == 2 * per_token * 32768
    assert per_token * 32768 == 4.5 * 2**30  # what vLLM asked for
    assert kv_cache_bytes(spec, "bf16", need, longest, {"max_model_len": -1}) == 2 * per_token * 1152  # vLLM: fit
    # the option check refuses these before any engine starts (reject_wrong_types); a direct caller gets the same
    for bad in ("32k", "32768", True, 32768.0, 32768.5, None):
        with pytest.raises(InputError, match=r"option max_model_len=.*: expected an integer"):
            kv_cache_bytes(spec, "bf16", need, longest, {"max_model_len": bad})


def test_rl_memory_plan_counts_the_kv_cache_of_the_users_max_model_len(monkeypatch):
    """rl_plan sizes the rollout engine's KV cache as the engine will (kv_cache_bytes), so a long max_model_len
    is in the plan before any engine starts."""
    import torch

    from alignaudit.rl import memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200_GPU))
    monkeypatch.setattr(memory, "host_memory", lambda: H200_HOST)

    def rollout_bytes(infer_options):
        request = SimpleNamespace(
            spec=_preset_spec("Qwen3-1.7B"),
            batch=SimpleNamespace(sequences=[[1] * 64] * 8),
            rollout=SimpleNamespace(max_new_tokens=64),
            train=SimpleNamespace(engine="megatron", settings=SimpleNamespace(device="cuda", options={})),
            infer=SimpleNamespace(engine="vllm", settings=SimpleNamespace(dtype="bf16", options=infer_options)),
        )
        return memory.rl_plan(request, group_size=4).rollout

    per_token = 28 * 2 * 8 * 128 * 2  # Qwen3-1.7B: layers x (K, V) x KV heads x head_dim x bf16 bytes
    # 8 prompts x 4 completions x (64 + 64) tokens = 4096 tokens; one sequence of 32768
    assert rollout_bytes({"max_model_len": 32768}) - rollout_bytes({}) == 2 * per_token * (32768 - 4096)


def test_rl_memory_plan_sizes_one_step_of_a_drawn_dataset_and_the_held_out_set(monkeypatch):
    """With --prompts-per-step the plan counts one step's draw, not every prompt of the set (seen on an H100,
    2026-12-07: the task's 9,000 training questions x 8 were planned as one step, 242 GB, and refused), and the
    held-out evaluation's sequences where they need more KV cache than a step."""
    import torch

    from alignaudit.rl import memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200_GPU))
    monkeypatch.setattr(memory, "host_memory", lambda: H200_HOST)
    request = SimpleNamespace(
        spec=_preset_spec("Qwen3-1.7B"),
        batch=SimpleNamespace(sequences=[[1] * 64] * 9000),
        rollout=SimpleNamespace(max_new_tokens=64),
        train=SimpleNamespace(engine="megatron", settings=SimpleNamespace(device="cuda", options={})),
        infer=SimpleNamespace(engine="vllm", settings=SimpleNamespace(dtype="bf16", options={})),
    )
    with pytest.raises(InputError, match="cannot train and roll out on one GPU"):
        memory.rl_plan(request, group_size=8)  # every prompt in one step
    step = memory.rl_plan(request, group_size=8, per_step=8)
    held = SimpleNamespace(batch=SimpleNamespace(sequences=[[1] * 64] * 1024))  # more tokens than a step's 64 x 128
    with_held = memory.rl_plan(request, group_size=8, per_step=8, held=held)
    from alignaudit.engines.vllm.adapter import kv_cache_bytes

    kv = [kv_cache_bytes(request.spec, "bf16", n * 128, 128, {}) for n in (64, 1024)]
    assert with_held.rollout - step.rollout == kv[1] - kv[0] > 0  # the KV cache of the larger of the two
