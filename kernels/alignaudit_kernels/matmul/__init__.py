"""Strict linear layer: y = x @ W^T (+ b), one fixed reduction order over K for every row.

Contract (both backends):
    inputs        x [..., K] and W [N, K] in bf16, fp16 or fp32 (one dtype); optional bias [N]
    precision     products and accumulation in fp32; bias added in fp32
    rounding      once, fp32 -> x.dtype, at the end
    reduction     over K only; the order for an output element depends on K and ``k_segments`` alone, never
                  on the number of rows, the row's position, or the other rows
    segments      ``k_segments`` S (1, 2, 4 or 8; K divisible by S): K is cut into S equal contiguous
                  segments, each accumulated from zero in the order below, and the S fp32 partials are
                  added by a pairwise tree ((p0 + p1) + (p2 + p3)). A row-parallel layer at tensor-parallel
                  size t holds S/t consecutive segments on each rank: ``linear_partial`` gives its subtree,
                  unrounded, and ``combine_partials`` adds the ranks' partials in rank order by the top of
                  the same tree, then adds the bias and rounds once. So t = 1, 2, 4 (dividing S) give the
                  same bits as each other and as ``linear(..., k_segments=S)`` on one rank.
    CPU order     K in blocks of 32 (zero-padded), each block a pairwise tree, blocks added left to right
                  (alignaudit_kernels.primitives.fixed_sum); products x*w rounded to fp32 (exact for bf16/fp16)
    GPU order     Triton: each (BLOCK_M x BLOCK_N) output tile by one program, K in increasing order, tl.dot
                  accumulating into one fp32 accumulator (tensor cores; fp32 inputs use IEEE fp32
                  products, not TF32); tiles fixed per dtype and batch-size class (TILES, TMA_PLANS), no
                  autotuning. Segments: the tree inside the program (the TMA kernel keeps finished subtrees in
                  fp32 scratch tiles), or one program per (tile, segment) and a launch adding the tree
                  (_split_k; _triton_tma_split by the TMA unit): the same additions in the same order
                  either way.
                  The tensor cores add K in steps of their instruction (16 for bf16/fp16) into the
                  accumulator, so BLOCK_K only groups steps: on an H200, BLOCK_K 64 and 128 give the same
                  bits (bench/sweep_gpu.py), and tests/kernels/ re-checks rows across every switch
Backward: plain torch matmuls in the inputs' dtype (correct, not strict: ``linear_backward``).

The package, one job per module: ``cpu`` (the CPU backend and ``tree_sum``, the segment tree on the host),
``triton_kernels`` (the GPU kernels), ``launch`` (tiles, plans by batch size, the TMA and split-K paths: how the
kernels run), and here the entry points, their checks and autograd.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.matmul.cpu import _cpu, _cpu_partial, tree_sum
from alignaudit_kernels.matmul.launch import _triton
from alignaudit_kernels.primitives import (
    as_rows,
    compiling_inference,
    no_gradient,
    opaque_op,
    use_triton,
)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, in the inputs' dtype (pass float64 for an accuracy reference)."""
    y = x @ weight.T
    return y + bias if bias is not None else y


SEGMENT_COUNTS = (1, 2, 4, 8)
# The K segments of every row-parallel layer (attention output and MLP down projections) in every engine's
# strict path: tensor-parallel sizes 1, 2 and 4 then give identical bits (docs/kernels.md).
ROW_PARALLEL_SEGMENTS = 4


def _check(x: torch.Tensor, weight: torch.Tensor, segments: int) -> None:
    if x.dtype != weight.dtype:
        raise TypeError(f"strict linear needs one dtype: x is {x.dtype}, weight is {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"strict linear: x has K={x.shape[-1]}, weight has K={weight.shape[1]}")
    if segments not in SEGMENT_COUNTS or x.shape[-1] % segments:
        raise ValueError(
            f"strict linear: k_segments={segments} must be one of {SEGMENT_COUNTS} and divide K={x.shape[-1]}"
        )


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int = 1) -> torch.Tensor:
    _check(x, weight, segments)
    x2 = as_rows(x)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    if use_triton(x):
        y = _triton(x2, weight, bias, segments=segments)
    else:
        y = _cpu(x2, weight, bias, segments)
    return y if x2 is x else y.reshape(*x.shape[:-1], weight.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, segments):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, segments)

    @staticmethod
    def backward(ctx, grad):
        return (*linear_backward(grad, *ctx.saved_tensors, ctx.has_bias), None)


def linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool):
    """Gradients of y = x @ W^T (+ b) with respect to x, W and b: plain torch matmuls in the inputs' dtype
    (cuBLAS on CUDA, fp32 accumulation, as torch's own linear backward and Megatron's; correct and
    deterministic, not strict: nothing compares gradient bits across engines). grad [..., N], x [..., K],
    weight [N, K], one dtype (grad is cast to it); b's gradient (summed in fp32) None without a bias.

    In fp32 on the H200 these products were 0.55 of the 0.95 s of a strict Qwen3-1.7B-shape update of 4096
    tokens (fp32 SIMT GEMMs; bench/train_step_profile.py, 2026-12-02)."""
    g = grad.to(weight.dtype).reshape(-1, weight.shape[0])
    gx = (g @ weight).reshape(x.shape)
    gw = g.T @ x.reshape(-1, x.shape[-1])
    return gx, gw, g.float().sum(0).to(weight.dtype) if has_bias else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_segments: int = 1
) -> torch.Tensor:
    """Strict ``x @ weight.T + bias``: x [..., K], weight [N, K], bias [N] or None -> [..., N] in x.dtype.
    ``k_segments`` > 1 reduces K as a tree of that many segments (the row-parallel form; module docstring).

    Raises:
        TypeError: x and weight of different dtypes. ValueError: K mismatch, or k_segments not in
            SEGMENT_COUNTS or not dividing K.
    """
    if compiling_inference(x, weight, bias):
        return _linear_op(x, weight, bias, k_segments)
    if no_gradient(x, weight, bias):
        return _forward(x, weight, bias, k_segments)
    return _Linear.apply(x, weight, bias, k_segments)


@opaque_op(
    "linear",
    "(Tensor x, Tensor weight, Tensor? bias, int segments) -> Tensor",
    lambda x, weight, bias, segments: x.new_empty(*x.shape[:-1], weight.shape[0]),
)
def _linear_op(x, weight, bias, segments):
    return _forward(x, weight, bias, segments)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> torch.Tensor:
    """One rank's share of a row-parallel strict linear: x [..., K/t], weight [N, K/t] holding ``k_segments``
    (= S/t) consecutive segments -> fp32 [..., N], their tree, unrounded, without bias. Forward only.

    Raises:
        as ``linear``.
    """
    _check(x, weight, k_segments)
    x2 = as_rows(x)
    if use_triton(x):
        y = _triton(x2, weight, None, segments=k_segments, out_dtype=torch.float32)
    else:
        y = _cpu_partial(x2, weight, k_segments)
    return y if x2 is x else y.reshape(*x.shape[:-1], weight.shape[0])


def combine_partials(parts: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' fp32 partials, in rank order, by the top of the segment tree; + bias (fp32); rounded once
    to ``dtype``. With ``linear_partial`` this equals ``linear(..., k_segments=S)`` bit for bit."""
    out = tree_sum([p.float() for p in parts])
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)
