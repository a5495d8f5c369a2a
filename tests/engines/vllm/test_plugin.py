"""The vLLM plugin's logprob patches reach both of vLLM's model runners.

vLLM 0.26 on CUDA ran Qwen3 under model runner V2 (vllm/v1/worker/gpu/), which computes prompt and sampled
logprobs with its own fused kernel (sample/logprob.py compute_token_logprobs) and never calls
Sampler.compute_logprobs: with only the latter patched, strict vLLM on the H200 gave 6 of 176 fixture
prompt logprobs 1 ULP off Megatron's from bitwise-equal logits (2026-12-01, docs/log/findings.md). This checks,
on the installed vLLM, that both entry points compute alignaudit_kernels' bits and that unregister restores
vLLM's own functions.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.worker.gpu.sample import logprob as runner_v2  # noqa: E402

import alignaudit_kernels as K  # noqa: E402
from alignaudit.engines.vllm import plugin as vllm_plugin
from alignaudit.inputs.strict_ops import ENV  # noqa: E402
from helpers import assert_bitwise_equal  # noqa: E402


def test_both_model_runners_compute_strict_logprobs(monkeypatch):
    stock_v1, stock_v2 = Sampler.compute_logprobs, runner_v2.compute_token_logprobs
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 5000, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, 5000, (6, 3), generator=g)
    monkeypatch.setenv(ENV, "logprobs")
    vllm_plugin.register()
    try:
        expected = K.log_softmax(logits)
        assert_bitwise_equal("V1 compute_logprobs", Sampler.compute_logprobs(logits), expected)
        assert_bitwise_equal(
            "V2, sampled token only",
            runner_v2.compute_token_logprobs(logits, ids[:, :1]),
            K.token_logprobs(logits, ids[:, 0])[:, None],
        )
        assert_bitwise_equal(
            "V2, with top-k columns", runner_v2.compute_token_logprobs(logits, ids), expected.gather(1, ids)
        )
    finally:
        vllm_plugin.unregister()
    assert Sampler.compute_logprobs is stock_v1 and runner_v2.compute_token_logprobs is stock_v2
    assert not torch.equal(stock_v1(logits).view(torch.int32), expected.view(torch.int32))  # stock: other bits


def test_every_strict_attention_backend_the_plugin_registers_imports():
    """vLLM imports a backend by the dotted path the plugin registers, in each of its processes: each path must
    name a class of that module (a moved module would fail only inside vLLM, on that platform)."""
    import importlib

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for platform, (member, path) in vllm_plugin.ATTENTION_BACKENDS.items():
        module, _, name = path.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type), platform
        assert AttentionBackendEnum[member] is not None
