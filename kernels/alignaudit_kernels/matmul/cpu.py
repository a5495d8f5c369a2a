"""The CPU backend of the strict linear (the package docstring is the contract: K in blocks of 32, each block a
pairwise tree, blocks left to right), and ``tree_sum``, the segment tree that ``combine_partials`` also adds by."""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import (
    BLOCK,
    as_dtype,
    block_sums,
)

CPU_CHUNK_ELEMENTS = 1 << 24  # rows are independent: process as many as fit in this many fp32 products


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise tree over a power-of-two number of fp32 tensors: ((p0 + p1) + (p2 + p3)) ..."""
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"a pairwise tree needs a power of two of partials, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _cpu_partial(x2: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """fp32 [M, N]: the tree over ``segments`` segment accumulations (no bias, no rounding)."""
    seg = x2.shape[1] // segments
    return tree_sum(
        [_cpu_segment(x2[:, s * seg : (s + 1) * seg], weight[:, s * seg : (s + 1) * seg]) for s in range(segments)]
    )


def _cpu_segment(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    n = weight.shape[0]
    pad = (-k) % BLOCK
    xf = torch.nn.functional.pad(x2.float(), (0, pad)).unflatten(-1, (-1, BLOCK))  # [M, KB, 32]
    wf = torch.nn.functional.pad(weight.float(), (0, pad)).unflatten(-1, (-1, BLOCK))  # [N, KB, 32]
    out = torch.empty(m, n, dtype=torch.float32)
    rows = max(1, CPU_CHUNK_ELEMENTS // max(1, n * BLOCK))
    for start in range(0, m, rows):
        xs = xf[start : start + rows]
        acc = block_sums(xs[:, None, 0, :] * wf[None, :, 0, :])
        for b in range(1, xf.shape[1]):
            acc = acc + block_sums(xs[:, None, b, :] * wf[None, :, b, :])
        out[start : start + rows] = acc
    return out


def _cpu(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int = 1) -> torch.Tensor:
    out = _cpu_partial(x2, weight, segments)
    return as_dtype(out if bias is None else out + bias.float(), x2.dtype)
