"""Strict SiLU-and-mul (the SwiGLU activation): out = silu(gate) * up.

Per element, in fp32 (each operation rounded, no FMA):
    silu = gate / (1 + exp(-gate))      exp: kernels/alignaudit_kernels/primitives (same algorithm on CPU and GPU)
    out  = silu * up                    rounding point: once, fp32 -> dtype, at the end
No reduction. Backward: plain torch in fp32.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.gradients import backward_on, silu_mul_grad
from alignaudit_kernels.primitives import (
    as_rows,
    as_shape,
    cdiv,
    compiling_inference,
    exp,
    no_gradient,
    opaque_op,
    triton,
    use_triton,
)


def reference(gate, up):
    return torch.nn.functional.silu(gate) * up


def _cpu(gate, up):
    g = gate.float()
    return ((g / (1.0 + exp(-g))) * up.float()).to(gate.dtype)


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import exp_t

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n_cols, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        silu = tl.div_rn(g, 1.0 + exp_t(-g))
        tl.store(y_ptr + row * stride_y + cols, (silu * u).to(y_ptr.dtype.element_ty), mask=mask)


def _triton(gate, up):
    rows, cols = gate.shape
    y = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(rows, cdiv(cols, block))](
        gate, up, y, cols, gate.stride(0), up.stride(0), y.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False
    )
    return y


def _forward(gate, up):
    shape = gate.shape
    g2, u2 = as_rows(gate), as_rows(up)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    return as_shape((_triton if use_triton(gate) else _cpu)(g2, u2), shape)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        if use_triton(gate) and backward_on(gate.is_cuda) == "fused":  # kernels/alignaudit_kernels/gradients.py
            return silu_mul_grad(gate, up, g)
        with torch.enable_grad():
            gf, uf = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
            dg, du = torch.autograd.grad(reference(gf, uf), (gf, uf), g.float())
        return dg.to(gate.dtype), du.to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Strict silu(gate) * up; gate and up of one shape [..., I] and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {gate.dtype}{tuple(gate.shape)} vs up {up.dtype}{tuple(up.shape)}")
    if compiling_inference(gate, up):
        return _silu_mul_op(gate, up)
    if no_gradient(gate, up):
        return _forward(gate, up)
    return _SiluMul.apply(gate, up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Strict SwiGLU on a fused [..., 2I] tensor laid out [gate | up] (vLLM, Megatron): -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul(gate, up)


@opaque_op("silu_mul", "(Tensor gate, Tensor up) -> Tensor", lambda gate, up: gate.new_empty(gate.shape))
def _silu_mul_op(gate, up):
    return _forward(gate, up)
