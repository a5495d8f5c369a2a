"""Strict kernels, RMSNorm (with and without the residual add): batch invariance, its two rounding points, accuracy;
the engines' own roundings as the negative control.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import alignaudit_kernels as K
from alignaudit_kernels import rmsnorm
from helpers import (
    EXAMPLES,
    assert_bitwise_equal,
    assert_within,
    randn,
    rows_everywhere,
    ulp_of,
)


@EXAMPLES
@given(seed=st.integers(0, 10**6))
def test_rmsnorm_is_batch_invariant_with_and_without_residual(device, dtype, seed):
    h = 160
    w = randn(h, dtype=dtype, device=device, seed=seed, scale=0.5) + 1
    row = randn(2, h, dtype=dtype, device=device, seed=seed + 1)

    def fused(batch):
        y, s = K.rms_norm(batch[:, 0], w, 1e-6, residual=batch[:, 1])
        return torch.stack([y, s], 1)

    for fn in (lambda b: K.rms_norm(b[:, 0], w, 1e-6), fused):
        alone, outs = rows_everywhere(
            fn, row, lambda b: randn(b, 2, h, dtype=dtype, device=device, seed=seed + b), device
        )
        for where, out in outs:
            assert_bitwise_equal(f"rms_norm row at {where}", out, alone)


def test_rmsnorm_rounding_points_and_accuracy(device, dtype):
    h = 256
    x, r = randn(64, h, dtype=dtype, device=device, seed=1), randn(64, h, dtype=dtype, device=device, seed=2)
    w = randn(h, dtype=dtype, device=device, seed=3, scale=0.2) + 1
    y, s = K.rms_norm(x, w, 1e-6, residual=r)
    assert_bitwise_equal("residual stream", s, (x.float() + r.float()).to(dtype))  # rounding point 1
    ref = rmsnorm.reference(s.double(), w.double(), 1e-6)
    assert_within("rms_norm", y, ref, 1.01 * ulp_of(ref, dtype) + 8 * 2**-23 * ref.abs())


def test_rmsnorm_negative_control_engines_round_differently():
    """HF's Qwen3RMSNorm (rounds before the weight) and torch.nn.RMSNorm (Megatron) disagree."""
    x = randn(64, 256, dtype=torch.bfloat16, device="cpu", seed=4)
    w = randn(256, dtype=torch.bfloat16, device="cpu", seed=5, scale=0.2) + 1
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch_norm = torch.nn.functional.rms_norm(x, (256,), w, 1e-6)
    assert not torch.equal(hf, torch_norm)


def test_rmsnorm_reads_per_head_views_in_place_with_the_bits_of_their_copy(device, dtype):
    """vLLM's Qwen3 normalizes q and k per head on views of the fused qkv output ([tokens, heads, head_dim],
    rows not contiguous): the Triton kernel reads such a view in place, with the bits of the same rows copied
    to a contiguous buffer (its loads, and so tl.sum's order, are the same); the CPU backend copies."""
    heads, kv_heads, d = 4, 2, 128
    qkv = randn(37, (heads + 2 * kv_heads) * d, dtype=dtype, device=device, seed=12)
    w = randn(d, dtype=dtype, device=device, seed=13, scale=0.5) + 1
    q = qkv[:, : heads * d].view(37, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(37, kv_heads, d)
    for name, x in (("q", q), ("k", k)):
        assert (rmsnorm._strided_heads(x, None) is x) == rmsnorm.use_triton(x)
        assert_bitwise_equal(
            f"rms_norm of {name} heads in place", K.rms_norm(x, w, 1e-6), K.rms_norm(x.contiguous(), w, 1e-6)
        )


ROWS_CANDIDATES = (2, 8, 32)  # rows a program of _rmsnorm_rows_kernel (8: the default for narrow rows)


def test_rmsnorm_rows_kernel_is_batch_invariant_and_reads_head_views_in_place(device, dtype):
    """The multi-row kernel (the default for rows of <= 128) keeps what the one-row kernel guarantees, for each
    rows-a-program value: a row's bits alone, at every place of every batch size (masked tail programs included),
    and in a per-head view of a fused qkv output read in place equal to its contiguous copy; the residual stream
    rounded once; RMSNorm's value within the one-row kernel's bound; and the one-row kernel's bits (on an H100 too,
    2026-12-06), which is what let it become the default."""
    if not rmsnorm.use_triton(torch.empty(0, device=device)):
        pytest.skip("the multi-row kernel is a Triton kernel (interpret or cuda)")
    d = 128
    w = randn(d, dtype=dtype, device=device, seed=20, scale=0.5) + 1
    row = randn(2, d, dtype=dtype, device=device, seed=21)
    qkv = randn(37, 8 * d, dtype=dtype, device=device, seed=22)
    q = qkv[:, : 4 * d].view(37, 4, d)
    for rows in ROWS_CANDIDATES:

        def norm(batch, rows=rows):
            y, s = rmsnorm._triton(batch[:, 0].contiguous(), w, 1e-6, batch[:, 1].contiguous(), rows=rows)
            return torch.stack([y, s], 1)

        alone, outs = rows_everywhere(
            norm, row, lambda b: randn(b, 2, d, dtype=dtype, device=device, seed=30 + b), device
        )
        for where, out in outs:
            assert_bitwise_equal(f"{rows} rows a program: row at {where}", out, alone)
        assert_bitwise_equal("residual stream", alone[1], (row[0].float() + row[1].float()).to(dtype))
        ref = rmsnorm.reference(alone[1].double(), w.double(), 1e-6)
        assert_within(f"{rows} rows a program", alone[0], ref, 1.01 * ulp_of(ref, dtype) + 8 * 2**-23 * ref.abs())
        in_place = rmsnorm._triton(q, w, 1e-6, None, heads=4, rows=rows)[0]
        assert_bitwise_equal(
            f"{rows} rows a program, q heads in place",
            in_place,
            rmsnorm._triton(q.reshape(-1, d).contiguous(), w, 1e-6, None, rows=rows)[0],
        )
        # built to the one-row kernel's arithmetic (test_kernels_compile.py): its bits, so that making it the
        # default for narrow rows changed no result
        assert_bitwise_equal(
            f"{rows} rows a program vs one", in_place, rmsnorm._triton(q, w, 1e-6, None, heads=4, rows=1)[0]
        )
