"""Strict kernels, rotary embedding: tables independent of length, batch and position-set invariance; bf16 tables as
the negative control.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import alignaudit_kernels as K
from alignaudit_kernels import primitives, rope
from helpers import (
    EXAMPLES,
    assert_bitwise_equal,
    assert_within,
    gen,
    randn,
    ulp_of,
)


def test_rope_tables_do_not_depend_on_length():
    short, _ = rope.rope_tables(100, 64, 1e6)
    long, _ = rope.rope_tables(5000, 64, 1e6)
    assert_bitwise_equal("cos table", short[:1024], long[:1024])
    ref = torch.cos(
        torch.arange(5000, dtype=torch.float64)[:, None] / 1e6 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    )
    assert float((long[:5000].double() - ref).abs().max()) <= 2**-24


@EXAMPLES
@given(seed=st.integers(0, 10**6))
def test_rope_is_batch_and_position_set_invariant(device, dtype, seed):
    cos, sin = rope.rope_tables(4096, 64, 1e6, device)
    x = randn(300, 4, 64, dtype=dtype, device=device, seed=seed)
    positions = torch.randint(0, 4096, (300,), generator=gen(seed)).to(device)
    full = K.apply_rope(x, positions, cos, sin)
    for i in (0, 150, 299):
        assert_bitwise_equal(f"rope token {i}", K.apply_rope(x[i : i + 1], positions[i : i + 1], cos, sin)[0], full[i])
    ref = rope.reference(x.double(), positions, cos.double(), sin.double()).cpu()
    assert_within(
        "rope", full, ref, 1.01 * ulp_of(ref, dtype) + 4 * 2**-23 * x.double().abs().amax(-1, keepdim=True).cpu()
    )


def test_rope_negative_control_bf16_tables():
    """HF casts cos/sin to bf16 before the multiply; rounding once in fp32 gives other bits."""
    cos, sin = rope.rope_tables(512, 32, 1e6)
    x = randn(512, 2, 32, dtype=torch.bfloat16, device="cpu", seed=9)
    pos = torch.arange(512)
    hf_style = rope.reference(x, pos, cos.bfloat16(), sin.bfloat16())
    assert not torch.equal(hf_style, K.apply_rope(x, pos, cos, sin))


def test_rope_never_reads_outside_its_tables(device):
    """A position outside the tables (1024 rows here) is refused on the CPU and gives NaN rows in the Triton
    kernel, which checks it with no extra launch (vLLM calls rope in every layer of every step), and NaN
    gradient rows; the rows of the other tokens keep their bits."""
    cos, sin = rope.rope_tables(100, 32, 1e6, device)
    x = randn(3, 2, 32, dtype=torch.float32, device=device, seed=3)
    positions = torch.tensor([5, 1024, -1], device=device)
    if primitives.use_triton(x):
        out = K.apply_rope(x, positions, cos, sin)
        assert torch.isnan(out[1:]).all()
        assert_bitwise_equal("rope of the token inside", out[0], K.apply_rope(x[:1], positions[:1], cos, sin)[0])
        leaf = x.clone().requires_grad_()
        K.apply_rope(leaf, positions, cos, sin).sum().backward()  # nothing wraps or asserts in the backward
        assert torch.isnan(leaf.grad[1:]).all() and torch.isfinite(leaf.grad[0]).all()
    else:
        with pytest.raises(IndexError, match="positions -1..1024 outside the 1024 rows"):
            K.apply_rope(x, positions, cos, sin)


@pytest.mark.parametrize("heads", [(5, 3), (32, 8), (2, 4)])
def test_rope_qk_gives_the_bits_of_two_ropes(device, dtype, heads):
    """Queries and keys in one launch (what vLLM's attention layers call): each the bits of its own apply_rope,
    read from views of one fused [q | k | v] buffer as vLLM's are, with head counts that are not powers of two and
    more key heads than query heads (the second tensor's addressing is its own). Gradients, where recorded, are
    the two apply_rope calls'."""
    hq, hk = heads
    qkv = randn(37, (hq + 2 * hk) * 64, dtype=dtype, device=device, seed=5)
    q = qkv[:, : hq * 64].view(37, hq, 64)
    k = qkv[:, hq * 64 : (hq + hk) * 64].view(37, hk, 64)
    cos, sin = rope.rope_tables(2048, 64, 1e6, device)
    positions = torch.randint(0, 2048, (37,), generator=gen(6)).to(device)
    rq, rk = K.apply_rope_qk(q, k, positions, cos, sin)
    assert_bitwise_equal("rope_qk queries", rq, K.apply_rope(q, positions, cos, sin))
    assert_bitwise_equal("rope_qk keys", rk, K.apply_rope(k, positions, cos, sin))
    assert not torch.equal(rk, K.apply_rope(k, positions.flip(0), cos, sin))  # control: keys' own positions read
    leaf = k.detach().clone().requires_grad_()
    _, gk = K.apply_rope_qk(q, leaf, positions, cos, sin)
    gk.sum().backward()
    twin = k.detach().clone().requires_grad_()
    K.apply_rope(twin, positions, cos, sin).sum().backward()
    assert_bitwise_equal("rope_qk key gradient", leaf.grad, twin.grad)


def test_rope_qk_refuses_mismatched_tokens_or_head_dims():
    cos, sin = rope.rope_tables(64, 16, 1e4)
    q, pos = torch.randn(4, 2, 16), torch.arange(4)
    for k in (torch.randn(3, 1, 16), torch.randn(4, 1, 8), torch.randn(4, 16)):
        with pytest.raises(ValueError, match="apply_rope_qk: q"):
            K.apply_rope_qk(q, k, pos, cos, sin)
