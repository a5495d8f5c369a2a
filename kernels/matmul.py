"""Strict linear layer: y = x @ W^T (+ b), one fixed reduction order over K for every row.

Contract (both backends):
    inputs        x [..., K] and W [N, K] in bf16, fp16 or fp32 (one dtype); optional bias [N]
    precision     products and accumulation in fp32; bias added in fp32
    rounding      once, fp32 -> x.dtype, at the end
    reduction     over K only, no split-K; the order for an output element depends on K alone, never
                  on the number of rows, the row's position, or the other rows
    CPU order     K in blocks of 32 (zero-padded), each block a pairwise tree, blocks added left to right
                  (kernels/primitives.fixed_sum); products x*w rounded to fp32 (exact for bf16/fp16)
    GPU order     Triton: one program per (BLOCK_M x BLOCK_N) output tile, K in increasing order, tl.dot
                  accumulating into one fp32 accumulator (tensor cores; fp32 inputs use IEEE fp32
                  products, not TF32); tiles fixed per dtype and batch-size class (TILES), no autotuning.
                  The tensor cores add K in steps of their instruction (16 for bf16/fp16) into the
                  accumulator, so BLOCK_K only groups steps: on an H200, BLOCK_K 64 and 128 give the same
                  bits (bench/sweep_gpu.py), and tests/test_kernels.py re-checks rows across every switch
Backward: plain torch matmuls in fp32 (correct, not strict).
"""

from __future__ import annotations

import os

import torch

from alignaudit_kernels.primitives import BLOCK, block_sums, triton

CPU_CHUNK_ELEMENTS = 1 << 24  # rows are independent: process as many as fit in this many fp32 products


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, in the inputs' dtype (pass float64 for an accuracy reference)."""
    y = x @ weight.T
    return y + bias if bias is not None else y


def _cpu(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x2.shape
    n = weight.shape[0]
    pad = (-k) % BLOCK
    xf = torch.nn.functional.pad(x2.float(), (0, pad)).unflatten(-1, (-1, BLOCK))  # [M, KB, 32]
    wf = torch.nn.functional.pad(weight.float(), (0, pad)).unflatten(-1, (-1, BLOCK))  # [N, KB, 32]
    out = torch.empty(m, n, dtype=torch.float32)
    rows = max(1, CPU_CHUNK_ELEMENTS // max(1, n * BLOCK))
    for start in range(0, m, rows):
        xs = xf[start: start + rows]
        acc = block_sums(xs[:, None, 0, :] * wf[None, :, 0, :])
        for b in range(1, xf.shape[1]):
            acc = acc + block_sums(xs[:, None, b, :] * wf[None, :, b, :])
        out[start: start + rows] = acc
    if bias is not None:
        out = out + bias.float()
    return out.to(x2.dtype)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # Tile order: groups of GROUP_M row-tiles sweep the columns together (L2 reuse of W); the order in
        # which tiles run never changes what a tile computes.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


# Tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Never chosen by timing at run time; chosen by
# batch size: up to TINY_M rows (decode) a 16-row tile with narrow columns, so that enough programs stream
# W; up to SMALL_M rows 64x64 (128x128 for wide layers, N >= WIDE_N: gate/up, lm_head); above, 256x128. A tile only decides which outputs a program computes: on an
# H200 every tile in bench/sweep_gpu.py (fifteen bf16 tiles from 16x16 to 256x128, BLOCK_K 64 and 128,
# 2026-11-29) gave every element the same bits, and a row alone in a small tile equals the same row in a
# large one; tests/test_kernels.py re-checks across the switches. ALIGNAUDIT_MATMUL_TILES=fixed forces
# the large tile for every batch size on hardware where that has not been verified.
TILES = {
    torch.bfloat16: {"tiny": (16, 32, 128, 4, 3), "small": (64, 64, 64, 4, 4), "small_wide": (128, 128, 64, 8, 3),
                     "large": (256, 128, 64, 8, 3)},
    torch.float16: {"tiny": (16, 32, 128, 4, 3), "small": (64, 64, 64, 4, 4), "small_wide": (128, 128, 64, 8, 3),
                    "large": (256, 128, 64, 8, 3)},
    torch.float32: dict.fromkeys(("tiny", "small", "small_wide", "large"), (64, 64, 32, 4, 3)),
}
TINY_M = 16
SMALL_M = 256
WIDE_N = 16384


def tile_for(m: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """The launch tile for an [m, K] x [K, n] product (see TILES)."""
    tiles = TILES[dtype]
    if os.environ.get("ALIGNAUDIT_MATMUL_TILES", "by_m") == "fixed" or m > SMALL_M:
        return tiles["large"]
    if m <= TINY_M:
        return tiles["tiny"]
    return tiles["small_wide"] if n >= WIDE_N else tiles["small"]


def _triton(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile=None) -> torch.Tensor:
    m, k = x2.shape
    n = weight.shape[0]
    x2, weight = x2.contiguous(), weight.contiguous()
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    bm, bn, bk, warps, stages = tile or tile_for(m, n, x2.dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](x2, weight, bias if bias is not None else x2, y, m, n, k, x2.stride(0), weight.stride(0),
                         y.stride(0), HAS_BIAS=bias is not None, IEEE=x2.dtype == torch.float32,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != weight.dtype:
        raise TypeError(f"strict linear needs one dtype: x is {x.dtype}, weight is {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"strict linear: x has K={x.shape[-1]}, weight has K={weight.shape[1]}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    use_triton = x.is_cuda or _interpreting()
    y = (_triton if use_triton else _cpu)(x2, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _interpreting() -> bool:
    return triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float().reshape(-1, weight.shape[0])
        gx = (g @ weight.float()).to(x.dtype).reshape(x.shape)
        gw = (g.T @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        gb = g.sum(0).to(weight.dtype) if ctx.has_bias else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Strict ``x @ weight.T + bias``: x [..., K], weight [N, K], bias [N] or None -> [..., N] in x.dtype.

    Raises:
        TypeError: x and weight of different dtypes. ValueError: K mismatch.
    """
    return _Linear.apply(x, weight, bias)
