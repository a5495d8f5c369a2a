"""Strict rotary position embedding (Qwen/Llama "rotate half" layout) and its cos/sin tables.

Tables, computed once per (rows, rotary_dim, theta, scaling), the same way for every engine and device:
    inv_freq[i] = 1 / theta ** (2i / rotary_dim), angle = position * inv_freq[i], cos and sin of it, all in
    float64 on the CPU, then rounded once to fp32 ([max_positions, rotary_dim / 2] each). Every call
    indexes the same table, so a position's factors never depend on which positions are in the batch.
    llama3 scaling (Llama 3.1 / 3.2), also in float64, before the angles: with w = 2 pi / inv_freq,
    inv_freq unchanged where w < original / high, divided by factor where w > original / low, and
    (1 - s) inv_freq / factor + s inv_freq in between, s = (original / w - low) / (high - low) (Meta's
    llama-models reference; transformers' _compute_llama3_parameters and vLLM's Llama3RotaryEmbedding
    compute the same in fp32, Megatron's _apply_scaling likewise).
Apply, per token and head, with x1 = x[..., :D/2] and x2 = x[..., D/2:] (fp32, each product and sum
rounded, no FMA):
    out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin
    rounding point: once, fp32 -> x.dtype, at the end
No reduction. Backward: the inverse rotation in fp32.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.gradients import backward_on, rope_grad
from alignaudit_kernels.primitives import (
    as_dtype,
    cached_tensors,
    cdiv,
    compiling_inference,
    next_power_of_2,
    no_gradient,
    opaque_op,
    triton,
    use_triton,
)

TABLE_ROWS = 1024  # tables grow in whole multiples of this many positions


def inverse_frequencies(rotary_dim: int, theta: float, llama3: tuple | None = None) -> torch.Tensor:
    """float64 [rotary_dim // 2]: the rotary frequencies, llama3-scaled where ``llama3`` = (factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings) is given."""
    import math

    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low) if high != low else torch.zeros_like(inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelength < original / high, inv_freq, torch.where(wavelength > original / low, inv_freq / factor, mid)
    )


@cached_tensors(maxsize=16)
def _tables_cpu(rows: int, rotary_dim: int, theta: float, llama3: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = inverse_frequencies(rotary_dim, theta, llama3)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


@torch.compiler.disable  # traced by torch.compile, the tables could round otherwise: always built eagerly
@cached_tensors(maxsize=16)
def rope_tables(
    max_positions: int, rotary_dim: int, theta: float, device: str = "cpu", llama3: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each fp32 [>= max_positions, rotary_dim // 2], on ``device`` (copied from the CPU tables).
    ``llama3``: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or None.

    The row count is rounded up to a multiple of TABLE_ROWS, so the tensors torch's vectorized cos/sin run
    over have no tail: torch's CPU loops use a scalar libm call for a tail that does not fill a vector,
    which could give a position another last bit in a table of another length.
    """
    rows = -(-max_positions // TABLE_ROWS) * TABLE_ROWS
    cos, sin = _tables_cpu(rows, rotary_dim, float(theta), tuple(llama3) if llama3 else None)
    return cos.to(device), sin.to(device)


def reference(x, positions, cos, sin):
    """Plain torch in the dtype of x (float64 for an accuracy reference)."""
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :].to(x.dtype), sin[positions][:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _cpu(x, positions, cos, sin):
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
        raise IndexError(
            f"strict rope: positions {int(positions.min())}..{int(positions.max())} outside the "
            f"{cos.shape[0]} rows of the rope tables"
        )
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return as_dtype(out, x.dtype)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotate_heads(
        x_ptr,
        y_ptr,
        t,
        pos,
        cos_ptr,
        sin_ptr,
        block,
        H,
        rows,
        stride_xt,
        stride_xh,
        stride_yt,
        stride_yh,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < H) & (d[None, :] < HALF)
        in_table = (d < HALF) & (pos >= 0) & (pos < rows)  # a position outside the tables: NaN, never read
        c = tl.load(cos_ptr + pos * HALF + d, mask=in_table, other=float("nan"))[None, :]
        s = tl.load(sin_ptr + pos * HALF + d, mask=in_table, other=float("nan"))[None, :]
        base = x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
        x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
        out = y_ptr + t * stride_yt + heads[:, None] * stride_yh + d[None, :]
        tl.store(out, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr,
        k_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        yq_ptr,
        yk_ptr,
        HQ,
        HK,
        rows,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_yqt,
        stride_yqh,
        stride_ykt,
        stride_ykh,
        HALF: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # grid (tokens, q's head blocks + k's): one launch rotates q and k (HK = 0: q alone); every element's
        # arithmetic is _rotate_heads', whichever tensor it belongs to
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        block = tl.program_id(1)
        q_blocks = tl.cdiv(HQ, BLOCK_H)
        if block < q_blocks:
            _rotate_heads(
                q_ptr,
                yq_ptr,
                t,
                pos,
                cos_ptr,
                sin_ptr,
                block,
                HQ,
                rows,
                stride_qt,
                stride_qh,
                stride_yqt,
                stride_yqh,
                HALF,
                BLOCK_H,
                BLOCK_D,
            )
        else:
            _rotate_heads(
                k_ptr,
                yk_ptr,
                t,
                pos,
                cos_ptr,
                sin_ptr,
                block - q_blocks,
                HK,
                rows,
                stride_kt,
                stride_kh,
                stride_ykt,
                stride_ykh,
                HALF,
                BLOCK_H,
                BLOCK_D,
            )


def _triton(q, positions, cos, sin, k=None):
    """q [T, HQ, D] (and k [T, HK, D]) rotated in one launch; returns q's result, or (q's, k's) with k."""
    t, hq, d = q.shape
    q = q.contiguous()
    yq = torch.empty_like(q)
    kk = k.contiguous() if k is not None else q
    yk = torch.empty_like(kk) if k is not None else yq
    hk = kk.shape[1] if k is not None else 0
    block_h = min(16, next_power_of_2(max(hq, hk)))
    _rope_kernel[(t, cdiv(hq, block_h) + cdiv(hk, block_h))](
        q,
        kk,
        positions.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        yq,
        yk,
        hq,
        hk,
        cos.shape[0],
        q.stride(0),
        q.stride(1),
        kk.stride(0),
        kk.stride(1),
        yq.stride(0),
        yq.stride(1),
        yk.stride(0),
        yk.stride(1),
        HALF=d // 2,
        BLOCK_H=block_h,
        BLOCK_D=next_power_of_2(d // 2),
        enable_fp_fusion=False,
    )
    return (yq, yk) if k is not None else yq


def _forward(x, positions, cos, sin):
    return (_triton if use_triton(x) else _cpu)(x, positions, cos, sin)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, cos, sin):
        ctx.save_for_backward(positions, cos, sin)
        return _forward(x, positions, cos, sin)

    @staticmethod
    def backward(ctx, g):
        positions, cos, sin = ctx.saved_tensors
        if use_triton(g) and backward_on(g.is_cuda) == "fused":  # kernels/alignaudit_kernels/gradients.py
            return rope_grad(g, positions, cos, sin), None, None, None
        inside = (positions >= 0) & (positions < cos.shape[0])  # as the forward: outside the tables, NaN
        gx = reference(g.float(), positions.clamp(0, cos.shape[0] - 1), cos.float(), -sin.float())
        return torch.where(inside[:, None, None], gx, float("nan")).to(g.dtype), None, None, None


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by the angles of ``positions`` [tokens] (int) from rope_tables.

    The whole head_dim rotates (rotary_dim == head_dim, as in Qwen3 and Llama). A position outside the
    tables' rows: NaN rows on the GPU (checked in the kernel, with no extra launch or host read; the gradient
    of those rows is NaN too), IndexError on the CPU.
    Raises ValueError on shape mismatches.
    """
    if x.dim() != 3 or positions.shape != (x.shape[0],) or cos.shape[1] * 2 != x.shape[-1]:
        raise ValueError(
            f"apply_rope: x {tuple(x.shape)}, positions {tuple(positions.shape)}, tables {tuple(cos.shape)}"
        )
    if compiling_inference(x, cos, sin):
        return _rope_op(x, positions, cos, sin)
    if no_gradient(x, cos, sin):
        return _forward(x, positions, cos, sin)
    return _Rope.apply(x, positions, cos, sin)


@opaque_op(
    "apply_rope",
    "(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor",
    lambda x, positions, cos, sin: x.new_empty(x.shape),
)
def _rope_op(x, positions, cos, sin):
    return _forward(x, positions, cos, sin)


def apply_rope_qk(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rope(q, ...), apply_rope(k, ...))`` for queries q [tokens, query heads, head_dim] and keys k
    [tokens, KV heads, head_dim] of the same tokens, bit for bit, in one Triton launch where no gradient is
    recorded (an attention layer's rope: one launch and one host wrapper less a layer, which an eager prefill
    pays in every layer); with a gradient recorded, the two apply_rope calls and their backward. Same tables and
    position checks as apply_rope. Raises ValueError on shape mismatches (tokens, head_dim, tables)."""
    if (
        q.dim() != 3
        or k.dim() != 3
        or positions.shape != (q.shape[0],)
        or k.shape[0] != q.shape[0]
        or k.shape[-1] != q.shape[-1]
        or cos.shape[1] * 2 != q.shape[-1]
    ):
        raise ValueError(
            f"apply_rope_qk: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
            f"{tuple(positions.shape)}, tables {tuple(cos.shape)}"
        )
    if not no_gradient(q, k, cos, sin):
        return apply_rope(q, positions, cos, sin), apply_rope(k, positions, cos, sin)
    if compiling_inference(q, k, cos, sin):
        return _rope_qk_op(q, k, positions, cos, sin)
    return _forward_qk(q, k, positions, cos, sin)


def _forward_qk(q, k, positions, cos, sin):
    if use_triton(q):
        return _triton(q, positions, cos, sin, k=k)
    return _cpu(q, positions, cos, sin), _cpu(k, positions, cos, sin)


@opaque_op(
    "apply_rope_qk",
    "(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
    lambda q, k, positions, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)),
)
def _rope_qk_op(q, k, positions, cos, sin):
    return _forward_qk(q, k, positions, cos, sin)
