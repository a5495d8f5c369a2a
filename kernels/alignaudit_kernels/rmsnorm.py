"""Strict RMSNorm, optionally fused with the residual add before it.

    s = x (+ residual)                   rounding point 1: s rounded to x.dtype (the residual stream is
                                         kept in the storage dtype, as vLLM, Megatron and HF keep it)
    y = s * rsqrt(mean(s^2) + eps) * w   rounding point 2: once, fp32 -> x.dtype, at the end

Contract (both backends):
    precision     s, s^2, the sum, mean, rsqrt and both products in fp32 (w upcast to fp32)
    reduction     sum of s^2 over the hidden axis. CPU: alignaudit_kernels.primitives.fixed_sum (blocks of 32,
                  pairwise tree in a block, blocks left to right). GPU: one program per row (rows of at
                  most 128: 8 rows a program, each row on the same warps and tree), the whole row in
                  registers, tl.sum's fixed tree for that row length and dtype, read from an aligned buffer
                  (primitives.reduction_input, or in place where a strided view of heads loads as such a
                  buffer: _strided_heads). Neither depends on the number of rows
    primitives    rsqrt = 1/sqrt (correctly rounded sqrt and division); mean = sum / H (one division)
    order         ((s * inv) * w): the normalized value is not rounded before the weight multiply
                  (unlike HF's Qwen3RMSNorm, which rounds it to the storage dtype first)
Backward: plain torch in fp32 (correct, not strict).
"""

from __future__ import annotations

import torch

from alignaudit_kernels.gradients import backward_on, rms_norm_grad
from alignaudit_kernels.primitives import (
    as_rows,
    as_shape,
    cdiv,
    compiling_inference,
    fixed_sum,
    next_power_of_2,
    no_gradient,
    opaque_op,
    reduction_input,
    row_warps,
    rsqrt,
    triton,
    use_triton,
)


def reference(x, weight, eps, residual=None):
    """Plain torch in the inputs' dtype (float64 inputs for an accuracy reference)."""
    s = x + residual if residual is not None else x
    y = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + eps) * weight
    return (y, s) if residual is not None else y


def _cpu(x2, weight, eps, residual2):
    s = x2 if residual2 is None else (x2.float() + residual2.float()).to(x2.dtype)
    sf = s.float()
    mean = fixed_sum(sf * sf) / sf.shape[-1]
    inv = rsqrt(mean + eps)
    y = ((sf * inv[:, None]) * weight.float()).to(x2.dtype)
    return y, s


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import rsqrt_t

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        y_ptr,
        s_ptr,
        H,
        eps,
        heads,
        stride_x,
        stride_xh,
        stride_r,
        stride_y,
        stride_s,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        # x row ``row`` is head row % heads of token row // heads (heads == 1: rows of a 2-D x)
        x = tl.load(x_ptr + (row // heads) * stride_x + (row % heads) * stride_xh + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
        xf = x.to(tl.float32)
        mean = tl.div_rn(tl.sum(xf * xf, axis=0), H.to(tl.float32))
        inv = rsqrt_t(mean + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, ((xf * inv) * w).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rmsnorm_rows_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        y_ptr,
        s_ptr,
        M,
        H,
        eps,
        heads,
        stride_x,
        stride_xh,
        stride_r,
        stride_y,
        stride_s,
        HAS_RESIDUAL: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """_rmsnorm_kernel over ROWS rows a program (a [ROWS, BLOCK_H] block, each row's sum by tl.sum along
        axis 1): the default for narrow rows (H <= 128: Qwen3's per-head q/k norms), where one 1-warp program a
        row leaves the GPU mostly idle. Launched with the one-row kernel's warps for each row, a thread holds
        as many elements of a row as there, so the layout gives each row the one-row kernel's lanes and warps
        (at H = 128 and sm_90: 4 elements a thread, 32 lanes) and, cross-compiled, the same arithmetic
        (tests/kernels/test_kernels_compile.py). On an H100 (Triton 3.6, 2026-12-06) it gave the one-row kernel's
        bits at 2-32 rows a program, batch invariant, and at 8 rows 2.8x its speed for Qwen3-8B's q norms at
        4096 tokens (bench/sweep_gpu.py rmsnorm-rows; docs/benchmarks.md). A row's bits depend on (H, ROWS)
        only, never on M or the row's place."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        mask = (rows[:, None] < M) & (cols[None, :] < H)
        base = (rows // heads) * stride_x + (rows % heads) * stride_xh
        x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        mean = tl.div_rn(tl.sum(xf * xf, axis=1), H.to(tl.float32))
        inv = rsqrt_t(mean + eps)
        w = tl.load(w_ptr + cols[None, :], mask=cols[None, :] < H, other=0.0).to(tl.float32)  # x's layout
        y = (xf * inv[:, None]) * w
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


NARROW_ROWS = 8  # rows a program for rows of at most NARROW_H elements (the fastest of 2-32 in the 12-06 sweep)
NARROW_H = 128


def _triton(x2, weight, eps, residual2, heads=None, rows=None):
    """x2 [rows, H], or with ``heads`` a [tokens, heads, H] view whose rows are read in place. ``rows``: rows a
    program; None: NARROW_ROWS (_rmsnorm_rows_kernel) for H <= NARROW_H, else 1 (_rmsnorm_kernel, one row a
    program: also what rows=1 asks for). Both give a row the same bits (_rmsnorm_rows_kernel's docstring).
    Raises ValueError for a ``rows`` that is not a power of two or needs more than a program's 32 warps."""
    h = x2.shape[-1]
    m = x2.shape[0] * (heads or 1)
    y = torch.empty(m, h, dtype=x2.dtype, device=x2.device)
    s = torch.empty_like(x2) if residual2 is not None else x2
    block = next_power_of_2(h)
    args = (x2, residual2 if residual2 is not None else x2, weight, y, s)
    strides = (
        x2.stride(0),
        x2.stride(1) if heads else 0,
        residual2.stride(0) if residual2 is not None else 0,
        y.stride(0),
        s.stride(0),
    )
    warps = row_warps(block)
    if rows is None:
        rows = NARROW_ROWS if h <= NARROW_H else 1
    if rows > 1:
        if rows & (rows - 1) or rows * warps > 32:
            raise ValueError(
                f"strict rms_norm: rows={rows} must be a power of two whose rows, {warps} warps each, "
                f"fit a program's 32 warps"
            )
        _rmsnorm_rows_kernel[(cdiv(m, rows),)](
            *args,
            m,
            h,
            eps,
            heads or 1,
            *strides,
            HAS_RESIDUAL=residual2 is not None,
            ROWS=rows,
            BLOCK_H=block,
            num_warps=rows * warps,
            enable_fp_fusion=False,
        )
        return y, s
    _rmsnorm_kernel[(m,)](
        *args,
        h,
        eps,
        heads or 1,
        *strides,
        HAS_RESIDUAL=residual2 is not None,
        BLOCK_H=block,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return y, s


def _strided_heads(x: torch.Tensor, residual) -> torch.Tensor | None:
    """x [tokens, heads, H] as the view the kernel reads in place, where its loads are those of a
    contiguous aligned buffer (unit stride along H, 16-byte aligned start, strides divisible by 16, as H is:
    Triton specializes pointers and strides on exactly that, and the load width sets tl.sum's order); else
    None (the rows are copied). What it saves: vLLM's Qwen3 q_norm and k_norm get per-head views of the
    fused qkv output, which a reshape to rows would copy in every layer of every step."""
    if residual is not None or x.dim() != 3 or x.is_contiguous() or not use_triton(x):
        return None
    aligned = x.data_ptr() % 16 == 0 and x.stride(2) == 1 and x.shape[2] % 16 == 0
    return x if aligned and x.stride(0) % 16 == 0 and x.stride(1) % 16 == 0 else None


def _forward(x, weight, eps, residual):
    view = _strided_heads(x, residual)
    if view is not None:
        return _triton(view, weight, float(eps), None, heads=view.shape[1])[0].view(x.shape), x
    x2 = reduction_input(as_rows(x))
    r2 = reduction_input(as_rows(residual)) if residual is not None else None
    if r2 is not None and r2.dtype != x2.dtype:
        raise TypeError(f"strict rms_norm: residual is {r2.dtype}, x is {x2.dtype}")
    y, s = (_triton if use_triton(x) else _cpu)(x2, weight, float(eps), r2)
    return as_shape(y, x.shape), as_shape(s, x.shape)


def _backward(s, weight, eps, gy):
    """Gradient of y = rmsnorm(s) * w with respect to s and w, in fp32: through the reference, or fused
    (kernels/alignaudit_kernels/gradients.py, ALIGNAUDIT_BACKWARD)."""
    if use_triton(s) and backward_on(s.is_cuda) == "fused":
        return rms_norm_grad(s, weight, eps, gy)
    with torch.enable_grad():
        sf = s.detach().float().requires_grad_()
        wf = weight.detach().float().requires_grad_()
        gs, gw = torch.autograd.grad(reference(sf, wf, eps), (sf, wf), gy.float())
    return gs, gw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _forward(x, weight, eps, None)[0]

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx, gw = _backward(x, weight, ctx.eps, gy)
        return gx.to(x.dtype), gw.to(weight.dtype), None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, s = _forward(x, weight, eps, residual)
        ctx.save_for_backward(s, weight)
        ctx.eps = eps
        return y, s

    @staticmethod
    def backward(ctx, gy, gs_out):
        s, weight = ctx.saved_tensors
        gs, gw = _backward(s, weight, ctx.eps, gy)
        if gs_out is not None:
            gs = gs + gs_out.float()
        return gs.to(s.dtype), gw.to(weight.dtype), None, gs.to(s.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Strict RMSNorm over the last axis. x [..., H] (bf16/fp16/fp32), weight [H].

    Returns y (x.dtype) when ``residual`` is None, else ``(y, s)`` with s = round(x + residual), the new
    residual stream. Raises TypeError when residual and x dtypes differ.
    """
    if compiling_inference(x, weight, residual):
        return _rms_norm_op(x, weight, eps) if residual is None else tuple(_add_rms_norm_op(x, weight, eps, residual))
    if no_gradient(x, weight, residual):
        return _forward(x, weight, eps, None)[0] if residual is None else _forward(x, weight, eps, residual)
    if residual is None:
        return _RMSNorm.apply(x, weight, eps)
    return _AddRMSNorm.apply(x, weight, eps, residual)


@opaque_op("rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", lambda x, weight, eps: x.new_empty(x.shape))
def _rms_norm_op(x, weight, eps):
    return _forward(x, weight, eps, None)[0]


@opaque_op(
    "add_rms_norm",
    "(Tensor x, Tensor weight, float eps, Tensor residual) -> (Tensor, Tensor)",
    lambda x, weight, eps, residual: (x.new_empty(x.shape), x.new_empty(x.shape)),
)
def _add_rms_norm_op(x, weight, eps, residual):
    return _forward(x, weight, eps, residual)
