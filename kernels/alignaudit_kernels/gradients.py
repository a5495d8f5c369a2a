"""The strict ops' backward, and its fused form: correct and deterministic, never strict (nothing compares gradient
bits across engines; only the forward's are).

ALIGNAUDIT_BACKWARD, read at each backward call, chooses:
    auto       (default) fused for CUDA tensors, reference for the others (``backward_on``)
    reference  autograd through each op's plain-torch reference in fp32, gradients rounded once to the inputs'
               dtypes; attention through batched_reference (B x H x T x T fp32 scores per chunk)
    fused      on the Triton backend, one kernel per elementwise op (below) instead of the ten or so torch launches
               of autograd through its reference; attention by torch's scaled_dot_product_attention forward and
               backward in the inputs' dtype (attention/torch_reference.py), on every backend; on CUDA in bf16/fp16
               FlashAttention-2's varlen backward fed the strict forward's log-sum-exp (attention/flash_gradients.py),
               every attention backward under torch's deterministic mode

The fused kernels compute in fp32 from the saved inputs (loads upcast, one rounding per stored gradient):
    rms_norm     y = x * r * w, r = 1 / sqrt(mean(x^2) + eps):  dx = r * (g * w) - x * r^3 * sum(g * w * x) / H;
                 dw = sum over rows of g * x * r, by fixed blocks of GRAD_ROWS rows (one fp32 partial each) and
                 torch's sum over the partials
    silu_mul     s = 1 / (1 + exp(-a)):  da = g * u * s * (1 + a * (1 - s)),  du = g * a * s
    rope         the rotation by -angle:  dx1 = g1 * c + g2 * s,  dx2 = g2 * c - g1 * s;  NaN at positions
                 outside the tables, as the forward
Why fused is CUDA's default (docs/log/gpu-sessions.md, 2026-12-05): one update at the Qwen3-1.7B shape 1.13x of the
default stack's on an H200 (reference 1.52x), 0.97x on an H100; `alignaudit rl --reward task`, 200 steps on an H100
with it: 0 mismatching tokens at every step and the reward 0.239 -> 0.887, as with the reference backward on an H200.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import cdiv, env_choice, next_power_of_2, row_warps, triton

BACKWARDS = ("auto", "reference", "fused")
BACKWARD_ENV = "ALIGNAUDIT_BACKWARD"
GRAD_ROWS = 32  # rows per program of the RMSNorm gradient: the weight gradient's partial sums
ELEMENTS = 1024  # elements per program of the SiLU-mul gradient


def asked_backward() -> str:
    """ALIGNAUDIT_BACKWARD: one of BACKWARDS ("auto" when unset).

    Raises:
        ValueError: any other value, naming the ones there are.
    """
    return env_choice(BACKWARD_ENV, BACKWARDS)


def backward_on(cuda: bool) -> str:
    """The backward the strict ops run ("reference" or "fused") for tensors on CUDA (``cuda``) or elsewhere:
    ``asked_backward()``, where auto means fused on CUDA and reference elsewhere. Raises ValueError as
    asked_backward."""
    asked = asked_backward()
    if asked == "auto":
        return "fused" if cuda else "reference"
    return asked


def rms_norm_grad(s: torch.Tensor, weight: torch.Tensor, eps: float, gy: torch.Tensor):
    """Gradients of y = rmsnorm(s) * weight: s and gy [..., H] (one dtype), weight [H] -> (ds fp32 [..., H],
    dw fp32 [H])."""
    h = s.shape[-1]
    s2, g2 = s.reshape(-1, h), gy.reshape(-1, h)
    s2, g2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (s2, g2))
    rows = s2.shape[0]
    ds = torch.empty(rows, h, dtype=torch.float32, device=s.device)
    programs = cdiv(rows, GRAD_ROWS)
    partial = torch.empty(programs, h, dtype=torch.float32, device=s.device)
    if programs:
        block = next_power_of_2(h)
        _rms_norm_grad_kernel[(programs,)](
            s2,
            weight.contiguous(),
            g2,
            ds,
            partial,
            rows,
            h,
            s2.stride(0),
            g2.stride(0),
            float(eps),
            ROWS=GRAD_ROWS,
            BLOCK_H=block,
            num_warps=row_warps(block),
        )  # the forward's rule
    return ds.view(s.shape), partial.sum(0)


def silu_mul_grad(gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor):
    """Gradients of silu(gate) * up: gate, up, g of one shape -> (dgate, dup) in gate's and up's dtypes."""
    gate, up, g = (t.contiguous() for t in (gate, up, g))
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _silu_mul_grad_kernel[(cdiv(n, ELEMENTS),)](gate, up, g, dgate, dup, n, BLOCK=ELEMENTS)
    return dgate, dup


def rope_grad(g: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient of apply_rope: g [T, heads, D], positions [T] (int), cos/sin fp32 [P, D / 2] -> [T, heads, D] in
    g's dtype; NaN rows at positions outside [0, P)."""
    t, heads, d = g.shape
    g = g.contiguous()
    out = torch.empty_like(g)
    half = d // 2
    block_heads = min(next_power_of_2(heads), max(1, 4096 // next_power_of_2(half)))
    if t:
        _rope_grad_kernel[(t, cdiv(heads, block_heads))](
            g,
            positions.contiguous(),
            cos,
            sin,
            out,
            heads,
            cos.shape[0],
            cos.stride(0),
            HALF=half,
            BLOCK_HALF=next_power_of_2(half),
            BLOCK_HEADS=block_heads,
        )
    return out


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["rows"])
    def _rms_norm_grad_kernel(
        s_ptr,
        w_ptr,
        g_ptr,
        ds_ptr,
        partial_ptr,
        rows,
        H,
        stride_s,
        stride_g,
        eps,
        ROWS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """Rows [pid * ROWS, (pid + 1) * ROWS): each row's ds, and their weight-gradient sum as partial[pid]."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        live_cols = cols < H
        w = tl.load(w_ptr + cols, mask=live_cols, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i in range(ROWS):
            row = (pid * ROWS + i).to(tl.int64)
            live = live_cols & (row < rows)
            x = tl.load(s_ptr + row * stride_s + cols, mask=live, other=0.0).to(tl.float32)
            gy = tl.load(g_ptr + row * stride_g + cols, mask=live, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
            gw = gy * w
            ds = r * gw - x * (r * r * r) * (tl.sum(gw * x, axis=0) / H)
            tl.store(ds_ptr + row * H + cols, ds, mask=live)
            dw += gy * x * r
        tl.store(partial_ptr + pid.to(tl.int64) * H + cols, dw, mask=live_cols)

    @triton.jit(do_not_specialize=["n"])
    def _silu_mul_grad_kernel(gate_ptr, up_ptr, g_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        a = tl.load(gate_ptr + offs, mask=live, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=live, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        tl.store(dgate_ptr + offs, (g * u * s * (1.0 + a * (1.0 - s))).to(dgate_ptr.dtype.element_ty), mask=live)
        tl.store(dup_ptr + offs, (g * a * s).to(dup_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _rope_grad_kernel(
        g_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        heads,
        P,
        stride_table,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
    ):
        """Token program_id(0), heads [program_id(1) * BLOCK_HEADS, ...): the rotation by -angle."""
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        inside = (pos >= 0) & (pos < P)
        row = tl.where(inside, pos, 0)
        d = tl.arange(0, BLOCK_HALF)
        live_d = d < HALF
        c = tl.load(cos_ptr + row * stride_table + d, mask=live_d, other=0.0)[None, :]
        s = tl.load(sin_ptr + row * stride_table + d, mask=live_d, other=0.0)[None, :]
        h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        live = (h < heads)[:, None] & live_d[None, :]
        first = g_ptr + (t * heads + h[:, None]) * (2 * HALF) + d[None, :]
        g1 = tl.load(first, mask=live, other=0.0).to(tl.float32)
        g2 = tl.load(first + HALF, mask=live, other=0.0).to(tl.float32)
        dx1 = tl.where(inside, g1 * c + g2 * s, float("nan"))
        dx2 = tl.where(inside, g2 * c - g1 * s, float("nan"))
        out = out_ptr + (t * heads + h[:, None]) * (2 * HALF) + d[None, :]
        tl.store(out, dx1.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(out + HALF, dx2.to(out_ptr.dtype.element_ty), mask=live)
