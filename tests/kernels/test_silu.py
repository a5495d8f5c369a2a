"""Strict kernels, silu(gate) * up: invariance and accuracy; a rounded activation as the negative control.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import torch

import alignaudit_kernels as K
from alignaudit_kernels import silu
from helpers import (
    assert_bitwise_equal,
    assert_within,
    randn,
    ulp_of,
)


def test_silu_mul_invariance_and_accuracy(device, dtype):
    g, u = (
        randn(300, 200, dtype=dtype, device=device, seed=1, scale=3),
        randn(300, 200, dtype=dtype, device=device, seed=2),
    )
    full = K.silu_mul(g, u)
    for i in (0, 150, 299):
        assert_bitwise_equal(f"silu_mul row {i}", K.silu_mul(g[i : i + 1], u[i : i + 1])[0], full[i])
    assert_bitwise_equal("silu_and_mul", K.silu_and_mul(torch.cat([g, u], -1)), full)
    ref = silu.reference(g.double(), u.double())
    assert_within("silu_mul", full, ref, 1.01 * ulp_of(ref, dtype) + 8 * 2**-23 * ref.abs())


def test_silu_negative_control_rounded_activation():
    """HF rounds silu(gate) to bf16 before multiplying by up; vLLM's fused op does not."""
    g, u = (
        randn(64, 256, dtype=torch.bfloat16, device="cpu", seed=3, scale=3),
        randn(64, 256, dtype=torch.bfloat16, device="cpu", seed=4),
    )
    assert not torch.equal(torch.nn.functional.silu(g) * u, K.silu_mul(g, u))
