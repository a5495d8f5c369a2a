"""numerics: bit views and ULP distance against a slow exact reference that never looks at bits.

The reference indexes a finite float by exact rational arithmetic (fractions.Fraction): for a normal
number |x| = 2**(E - bias) * (1 + M / 2**p) its index is E * 2**p + M; a subnormal's index is
|x| / (smallest subnormal); negative numbers get negative indices. The ULP distance is the difference of
indices. This is the definition (count of representable values between a and b), derived without the
bit reinterpretation the implementation uses.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alignaudit import numerics
from alignaudit.numerics import PairClass

FORMATS = {  # mantissa bits, exponent bias
    torch.bfloat16: (7, 127),
    torch.float16: (10, 15),
    torch.float32: (23, 127),
    torch.float64: (52, 1023),
}
INT_OF = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def reference_index(x: float, dtype: torch.dtype) -> int:
    mant, bias = FORMATS[dtype]
    if x == 0:
        return 0
    ax = Fraction(abs(x))
    _, e = math.frexp(abs(x))  # |x| = m * 2**e with m in [0.5, 1)
    biased = e - 1 + bias
    if biased >= 1:
        m = ax / Fraction(2) ** (e - 1) - 1  # in [0, 1)
        index = biased * 2**mant + m * 2**mant
    else:
        index = ax / Fraction(2) ** (1 - bias - mant)
    assert index.denominator == 1, "not representable in this dtype"
    return int(math.copysign(1, x)) * int(index)


def reference_distance(a: float, b: float, dtype: torch.dtype) -> int:
    return min(abs(reference_index(a, dtype) - reference_index(b, dtype)), 2**63 - 1)


def from_bits(pattern: int, dtype: torch.dtype) -> torch.Tensor:
    width = torch.finfo(dtype).bits
    signed = pattern - (1 << width) if pattern >= 1 << (width - 1) else pattern
    return torch.tensor([signed], dtype=INT_OF[dtype]).view(dtype)


def any_float(dtype: torch.dtype):
    width = torch.finfo(dtype).bits
    return st.integers(0, (1 << width) - 1).map(lambda p: from_bits(p, dtype))


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_ulp_distance_matches_exact_reference(dtype, data):
    a = data.draw(any_float(dtype))
    b = data.draw(any_float(dtype))
    got = int(numerics.ulp_distance(a, b)[0])
    cls = PairClass(int(numerics.classify(a, b)[0]))
    fa, fb = float(a[0]), float(b[0])
    if numerics.bits(a).item() == numerics.bits(b).item():
        assert (got, cls) == (0, PairClass.BITWISE_EQUAL)
    elif math.isnan(fa) or math.isnan(fb):
        assert (got, cls) == (-1, PairClass.NAN_MISMATCH)
    elif math.isinf(fa) or math.isinf(fb):
        assert (got, cls) == (-1, PairClass.INF_MISMATCH)
    else:
        assert cls == PairClass.FINITE_DIFF
        assert got == reference_distance(fa, fb, dtype)


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_nearby_floats_match_reference(dtype, data):
    """Pairs a few ULPs apart, possibly straddling zero: the case that matters for logprobs."""
    max_finite = numerics.bits(torch.tensor([torch.finfo(dtype).max], dtype=dtype)).item()
    p = data.draw(st.integers(0, max_finite))
    q = data.draw(st.integers(max(0, p - 40), min(max_finite, p + 40)))
    a, b = from_bits(p, dtype), from_bits(q, dtype)
    if data.draw(st.booleans()):
        b = -b
    assert int(numerics.ulp_distance(a, b)[0]) == reference_distance(float(a[0]), float(b[0]), dtype)


@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_edge_cases(dtype):
    tiny = torch.tensor([torch.finfo(dtype).smallest_normal], dtype=dtype)
    sub = from_bits(1, dtype)  # smallest positive subnormal
    zero, neg_zero = torch.zeros(1, dtype=dtype), -torch.zeros(1, dtype=dtype)
    inf = torch.tensor([math.inf], dtype=dtype)
    nan = torch.tensor([math.nan], dtype=dtype)
    one = torch.ones(1, dtype=dtype)
    big = torch.tensor([torch.finfo(dtype).max], dtype=dtype)

    def d(a, b):
        return int(numerics.ulp_distance(a, b)[0])

    def c(a, b):
        return PairClass(int(numerics.classify(a, b)[0]))

    assert d(zero, neg_zero) == 0 and c(zero, neg_zero) == PairClass.FINITE_DIFF  # 0 ULP, not bitwise equal
    assert not bool(numerics.bitwise_equal(zero, neg_zero)[0])
    assert d(sub, zero) == 1 and d(sub, -sub) == 2 and d(-sub, neg_zero) == 1
    mant, _ = FORMATS[dtype]
    assert d(tiny, zero) == 2**mant  # every subnormal lies between 0 and the smallest normal
    assert d(one, from_bits(numerics.bits(one).item() + 1, dtype)) == 1
    assert (d(big, inf), c(big, inf)) == (-1, PairClass.INF_MISMATCH)  # never folded into "1 ULP"
    assert (d(inf, -inf), c(inf, -inf)) == (-1, PairClass.INF_MISMATCH)
    assert (d(inf, inf), c(inf, inf)) == (0, PairClass.BITWISE_EQUAL)
    assert (d(nan, one), c(nan, one)) == (-1, PairClass.NAN_MISMATCH)
    assert (d(nan, inf), c(nan, inf)) == (-1, PairClass.NAN_MISMATCH)
    assert c(nan, nan) == PairClass.BITWISE_EQUAL  # same payload: bitwise equal, reported as such


def test_fp64_extremes_saturate():
    big = torch.tensor([torch.finfo(torch.float64).max], dtype=torch.float64)
    assert int(numerics.ulp_distance(big, -big)[0]) == 2**63 - 1


def test_hex_bits_and_rel_diff():
    assert numerics.hex_bits(torch.tensor(1.0)) == "0x3f800000"
    assert numerics.hex_bits(torch.tensor(-2.0, dtype=torch.bfloat16)) == "0xc000"
    assert numerics.hex_bits(torch.tensor(1.0, dtype=torch.float64)) == "0x3ff0000000000000"
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert numerics.rel_diff(x, x) == 0.0
    assert numerics.rel_diff(x, -x) == 2.0


def test_mixed_dtypes_and_shapes_are_refused():
    with pytest.raises(TypeError, match="cast both"):
        numerics.ulp_distance(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="shapes"):
        numerics.ulp_distance(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="bit views"):
        numerics.bits(torch.zeros(2, dtype=torch.int32))
