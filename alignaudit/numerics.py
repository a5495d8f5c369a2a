"""Bit-level float comparison: bit views, ULP distance, element classes. Pure functions, no I/O.

ULP distance follows the usual ordered-integer construction (Bruce Dawson, "Comparing Floating Point
Numbers, 2012 Edition"; the same map as numpy.testing.assert_array_max_ulp): reinterpret the IEEE-754 bits
as a sign-magnitude integer, map it to a two's-complement integer that is monotonic in the float value, and
take |a - b|. Adjacent floats are 1 apart; +0.0 and -0.0 are 0 ULP apart (yet not bitwise equal); the
largest finite float and +Inf would be 1 apart, which is why non-finite pairs are classified separately
and never folded into a distance.

Supported dtypes: bfloat16, float16, float32, float64.
"""

from __future__ import annotations

from enum import IntEnum

import torch

_INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


class PairClass(IntEnum):
    """How two elements at the same index relate. Stored as int8 in tensors and parquet."""

    BITWISE_EQUAL = 0  # identical bit patterns (NaN with the same payload included)
    FINITE_DIFF = 1  # both finite, different bits; the ULP distance is meaningful (0 for +0/-0)
    NAN_MISMATCH = 2  # at least one NaN, bits differ
    INF_MISMATCH = 3  # at least one +-Inf, no NaN, bits differ


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of ``x`` as a signed integer tensor of the same width (int16/int32/int64).

    Raises:
        TypeError: for dtypes other than bf16, fp16, fp32, fp64.
    """
    try:
        return x.contiguous().view(_INT_VIEW[x.dtype])
    except KeyError:
        raise TypeError(f"bit views are defined for bf16, fp16, fp32, fp64; got {x.dtype}") from None


def ordered(x: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that the integer order equals the float order and adjacent floats differ by 1.

    Negative floats (sign bit set) map to -(magnitude bits); so -0.0 and +0.0 both map to 0.
    """
    b = bits(x).to(torch.int64)
    width = torch.finfo(x.dtype).bits
    magnitude = b & ((1 << (width - 1)) - 1)
    return torch.where(b < 0, -magnitude, magnitude)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: same bit pattern. Bool tensor of the common shape."""
    _check_pair(a, b)
    return bits(a) == bits(b)


def classify(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise PairClass codes (int8) for two tensors of one dtype and shape."""
    _check_pair(a, b)
    same = bits(a) == bits(b)
    nan = torch.isnan(a) | torch.isnan(b)
    inf = torch.isinf(a) | torch.isinf(b)
    out = torch.full(a.shape, int(PairClass.FINITE_DIFF), dtype=torch.int8)
    out[inf & ~same] = PairClass.INF_MISMATCH
    out[nan & ~same] = PairClass.NAN_MISMATCH
    out[same] = PairClass.BITWISE_EQUAL
    return out


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ULP distance (int64) between two tensors of the same float dtype and shape.

    Returns -1 where the pair is not comparable as finite numbers (see ``classify``: NAN_MISMATCH or
    INF_MISMATCH); bitwise-equal pairs (including two identical NaNs or infinities) are 0. Saturates at
    2**63 - 1, which only fp64 pairs of opposite sign and huge magnitude can reach.
    """
    cls = classify(a, b)
    oa, ob = ordered(a), ordered(b)
    d = (oa - ob).abs()
    if a.dtype == torch.float64:  # |oa - ob| can pass 2**63 - 1 only for fp64 of opposite signs
        int64_max = torch.iinfo(torch.int64).max
        opposite = (oa < 0) != (ob < 0)
        overflow = opposite & (oa.abs() > int64_max - ob.abs())
        d[overflow] = int64_max
    d[cls == PairClass.BITWISE_EQUAL] = 0
    d[(cls == PairClass.NAN_MISMATCH) | (cls == PairClass.INF_MISMATCH)] = -1
    return d


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """SGLang's tensor-dump comparator metric: 1 - 2*sum(a*b) / sum(a*a + b*b), computed in float64.

    0 for identical tensors, 1 for orthogonal, 2 for a == -b. NaN when both are all zeros.
    Source: sglang/srt/debug_utils/dump_comparator.py (``calc_rel_diff``).
    """
    x, y = a.double(), b.double()
    denominator = (x * x + y * y).sum()
    return float(1.0 - 2.0 * (x * y).sum() / denominator)


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"cannot compare {a.dtype} with {b.dtype}: cast both to one dtype first")
    if a.shape != b.shape:
        raise ValueError(f"cannot compare shapes {tuple(a.shape)} and {tuple(b.shape)}")


def hex_bits(x: torch.Tensor) -> str:
    """A scalar's bit pattern in hex, zero-padded to its width (``0x3f800000`` for 1.0 in fp32)."""
    width = torch.finfo(x.dtype).bits
    return f"0x{int(bits(x.reshape(1))[0]) & ((1 << width) - 1):0{width // 4}x}"
