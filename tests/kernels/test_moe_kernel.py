"""Strict kernels, the strict MoE layer: a token's bits independent of the batch, the every-expert (CUDA-graph
capturable) path equal to the gathered one, tie-breaking.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels import moe
from helpers import (
    assert_bitwise_equal,
    assert_within,
    gen,
    needs_hardware_dot,
    randn,
    ulp_of,
)


def moe_weights(e, h, i, dtype, device, seed):
    router = randn(e, h, dtype=dtype, device=device, seed=seed, scale=h ** -0.5)
    gate_up = randn(e, 2 * i, h, dtype=dtype, device=device, seed=seed + 1, scale=h ** -0.5)
    down = randn(e, h, i, dtype=dtype, device=device, seed=seed + 2, scale=i ** -0.5)
    return router, gate_up, down


@needs_hardware_dot
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_token_bits_do_not_depend_on_the_batch(device, dtype, normalize):
    """A token alone, in a batch, and in a shuffled batch (other tokens sharing its experts in other rows)
    gets the same experts and the same bits; the layer is within bf16 rounding of the fp64 reference."""
    e, h, i, k, t = 8, 64, 32, 2, 40
    router, gate_up, down = moe_weights(e, h, i, dtype, device, seed=31)
    x = randn(t, h, dtype=dtype, device=device, seed=34)
    full, logits, chosen = K.mixture_of_experts(x, router, gate_up, down, k, normalize)
    assert logits.dtype == torch.float32 and chosen.shape == (t, k) and full.dtype == dtype
    for idx in (0, 17, t - 1):
        one, _, mine = K.mixture_of_experts(x[idx: idx + 1], router, gate_up, down, k, normalize)
        assert_bitwise_equal(f"token {idx} alone", one[0], full[idx])
        assert torch.equal(mine[0], chosen[idx])
    perm = torch.randperm(t, generator=gen(35)).to(device)
    shuffled, _, _ = K.mixture_of_experts(x[perm], router, gate_up, down, k, normalize)
    assert_bitwise_equal("shuffled batch", shuffled[torch.argsort(perm)], full)
    ref = moe.reference(x.double(), router.double(), gate_up.double(), down.double(), k, normalize)
    assert_within("moe", full, ref, 8 * ulp_of(ref, dtype) + 0.02 * ref.abs().max())


@needs_hardware_dot
def test_moe_every_expert_path_has_the_gathered_bits_and_a_cuda_graph_captures_it(device, dtype, monkeypatch):
    """The dispatch a CUDA graph can capture (every expert on every token) gives the gathered path's bits; on
    CUDA a captured graph of the whole layer, replayed on new tokens, gives the eager layer's bits."""
    e, h, i, k, t = 8, 64, 32, 2, 24
    router, gate_up, down = moe_weights(e, h, i, dtype, device, seed=51)
    x = randn(t, h, dtype=dtype, device=device, seed=54)
    _, chosen, weights = moe.route(x, router, k, True)
    gathered = moe.combine_experts(x, chosen, weights, gate_up, down, every_expert=False)
    with monkeypatch.context() as m:  # the capturable path never reads the routing on the host
        m.setattr(torch, "unique", lambda *a, **k: pytest.fail("every_expert read the routing with torch.unique"))
        every = moe.combine_experts(x, chosen, weights, gate_up, down, every_expert=True)
    assert_bitwise_equal("every expert", every, gathered)
    if device != "cuda":
        return
    static = x.clone()
    K.mixture_of_experts(static, router, gate_up, down, k, True)  # warm-up: Triton compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.mixture_of_experts(static, router, gate_up, down, k, True)[0]
    fresh = randn(t, h, dtype=dtype, device=device, seed=55)
    static.copy_(fresh)
    graph.replay()
    assert_bitwise_equal("graph replay", captured, K.mixture_of_experts(fresh, router, gate_up, down, k, True)[0])


def test_moe_ties_go_to_the_lower_expert_and_weights_are_probabilities(device):
    """Experts 2 and 5 with identical router rows tie for the largest logit: both are chosen, 2 first;
    torch.topk does not specify an order for ties."""
    e, h, i = 8, 32, 16
    router, gate_up, down = moe_weights(e, h, i, torch.float32, device, seed=41)
    x = randn(6, h, dtype=torch.float32, device=device, seed=44)
    router[2] = router[5] = x[0] * 4  # the largest logit for token 0, twice
    _, logits, chosen = K.mixture_of_experts(x, router, gate_up, down, 2, True)
    assert logits[0, 2] == logits[0, 5] and chosen[0].tolist() == [2, 5]
    _, weights_normalized = moe.route(x, router, 2, True)[1:]
    assert torch.allclose(weights_normalized.sum(-1).cpu(), torch.ones(6), rtol=0, atol=2 ** -22)
    assert weights_normalized[0, 0] == weights_normalized[0, 1] == 0.5
    _, _, weights_plain = moe.route(x, router, 2, False)
    full_softmax = torch.softmax(logits.double(), -1).gather(1, chosen)
    assert torch.allclose(weights_plain.double(), full_softmax, rtol=0, atol=1e-6)
    assert bool((weights_plain.sum(-1) < 0.99).any())  # without renormalization the other experts keep their share
    with pytest.raises(ValueError, match="top_k 9 outside"):
        moe.route(x, router, 9, True)
