"""Strict kernels, exp, log, sqrt and the fixed-order sums every strict kernel is built from: the CPU and Triton
twins bit for bit, position independence, accuracy against fp64.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from alignaudit_kernels import primitives
from helpers import (
    EXAMPLES,
    assert_bitwise_equal,
    assert_within,
    gen,
    ulp_of,
)


def test_exp_log_within_2_ulp_of_fp64():
    x = torch.cat(
        [torch.linspace(-103, 88.7, 200001), torch.randn(10000) * 10, torch.tensor([0.0, -0.0, 1e-30, -1e-30])]
    )
    ref = torch.exp(x.double())
    finite = ref < 3e38
    err_ulp = (primitives.exp(x).double() - ref).abs() / ulp_of(ref.float(), torch.float32)
    assert float(err_ulp[finite & (ref > 1.2e-38)].max()) <= 2.0
    y = torch.cat(
        [
            torch.rand(200000) * 100,
            torch.exp(torch.linspace(-87, 88, 100000)),
            torch.tensor([1e-45, 3e-40, 1.0, 2.0, 0.5]),
        ]
    )
    ref = torch.log(y.double())
    err_ulp = (primitives.log(y).double() - ref).abs() / ulp_of(ref.float(), torch.float32).clamp_min(2**-149)
    assert float(err_ulp.max()) <= 2.0
    special = primitives.log(torch.tensor([0.0, -1.0, float("inf"), float("nan")]))
    assert (
        special[0] == float("-inf") and math.isnan(special[1]) and special[2] == float("inf") and math.isnan(special[3])
    )
    assert primitives.exp(torch.tensor([0.0]))[0] == 1.0 and primitives.exp(torch.tensor([-float("inf")]))[0] == 0.0


@EXAMPLES
@given(seed=st.integers(0, 10**6), n=st.integers(1, 97), offset=st.integers(0, 40))
def test_primitives_do_not_depend_on_position_in_tensor(seed, n, offset):
    """torch.exp on CPU takes Sleef for full vectors and libm for the tail; ours is the same everywhere."""
    x = torch.randn(n + offset + 5, generator=gen(seed)) * 20
    whole = primitives.exp(x)
    part = primitives.exp(x[offset : offset + n])
    assert_bitwise_equal("exp", whole[offset : offset + n], part)
    assert_bitwise_equal(
        "log", primitives.log(x.abs())[offset : offset + n], primitives.log(x[offset : offset + n].abs())
    )


def test_triton_primitives_match_the_cpu_bit_for_bit(request):
    """Same steps, no FMA, IEEE division and sqrt: the Triton twins reproduce the CPU primitives exactly."""
    if request.config.getoption("--kernel-device") == "cpu":
        pytest.skip("compares the Triton twins (interpret or cuda) with the CPU primitives")
    import triton
    import triton.language as tl

    @triton.jit
    def apply(x_ptr, e_ptr, l_ptr, r_ptr, u_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=1.0)
        tl.store(e_ptr + i, primitives.exp_t(x), mask=i < n)
        tl.store(u_ptr + i, primitives.exp_t_up_to_overflow(x), mask=i < n)
        tl.store(l_ptr + i, primitives.log_t(tl.abs(x)), mask=i < n)
        tl.store(r_ptr + i, primitives.rsqrt_t(tl.abs(x)), mask=i < n)

    # exp's edges too: its range checks, subnormal results, the values where its clamp of n would act (exp_t
    # has no clamp), infinities, NaN and the largest finite inputs, where exp_t's float-to-int conversion is
    # out of range (the range checks replace its result)
    edges = torch.tensor(
        [
            88.72283935546875,
            88.72284,
            88.7228317,
            -103.97207708,
            -103.972076,
            -87.33655,
            -100.0,
            -149.0,
            180.0,
            -181.0,
            3e38,
            -3e38,
            2.5e9,
            -2.5e9,
            float("inf"),
            -float("inf"),
            float("nan"),
        ]
    )
    x = torch.cat([torch.randn(50000, generator=gen(3)) * 30, torch.tensor([0.0, 1e-40, -1e-40, 88.7, -103.0]), edges])
    dev = "cuda" if request.config.getoption("--kernel-device") == "cuda" else "cpu"
    xd = x.to(dev)
    outs = [torch.empty_like(xd) for _ in range(4)]
    apply[(triton.cdiv(x.numel(), 1024),)](xd, *outs, x.numel(), BLOCK=1024, enable_fp_fusion=False)
    assert_bitwise_equal("exp", outs[0].cpu(), primitives.exp(x))
    kept = ~(x > primitives.EXP_HI)  # NaN included
    assert kept.sum() < x.numel() - 5  # the inputs above EXP_HI (edges and random ones) are left out
    assert_bitwise_equal("exp up to overflow", outs[3].cpu()[kept], primitives.exp(x)[kept])
    finite = slice(0, x.numel() - edges.numel())
    assert_bitwise_equal("log", outs[1].cpu()[finite], primitives.log(x.abs())[finite])
    assert_bitwise_equal("rsqrt", outs[2].cpu()[finite], primitives.rsqrt(x.abs())[finite])


def test_sqrt_is_correctly_rounded():
    x = torch.cat([torch.rand(300000, generator=gen(4)) * 1e6, torch.tensor([0.0, 1e-45, 3e-39, 1.0, 4.0, 2.0])])
    exact = torch.sqrt(x.double())  # float64 sqrt of a float: its rounding to fp32 is the correctly rounded root
    assert_bitwise_equal("sqrt_rn", primitives.sqrt_rn(x), exact.float())
    assert not torch.equal(torch.sqrt(x), exact.float())  # negative control: torch's fp32 sqrt on this CPU


def test_fixed_sum_order_is_its_definition():
    x = torch.randn(3, 70, generator=gen(1))
    padded = torch.nn.functional.pad(x, (0, 26)).view(3, 3, 32)
    expected = primitives.block_sums(padded[:, 0]) + primitives.block_sums(padded[:, 1])
    expected = expected + primitives.block_sums(padded[:, 2])
    assert_bitwise_equal("fixed_sum", primitives.fixed_sum(x), expected)


def test_unit_sum_is_exact_up_to_its_truncation():
    n = 151936  # the Qwen3 vocabulary
    assert primitives.unit_sum_scale(n) == 2.0**44
    x = torch.rand(4, n, generator=gen(5)) ** 8  # most terms far below 1, where truncation bites
    s = primitives.unit_sum(x)
    exact = x.double().sum(-1)
    assert_within("unit_sum", s, exact, n * 2.0**-44 + 0.5 * ulp_of(exact, torch.float32))
    shuffled = x[:, torch.randperm(n, generator=gen(6))]
    assert_bitwise_equal("unit_sum in another order", primitives.unit_sum(shuffled), s)
    assert not torch.equal(primitives.fixed_sum(shuffled), primitives.fixed_sum(x))  # negative control
    assert_bitwise_equal("unit_sum of ones", primitives.unit_sum(torch.ones(2, n)), torch.full((2,), float(n)))
    x[2, 77] = float("nan")
    assert primitives.unit_sum(x).isnan().tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="at most"):
        primitives.unit_sum_scale(2**20 + 1)
