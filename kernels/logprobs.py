"""Strict log_softmax over the vocabulary, and the logprob of target tokens, in fp32.

    m   = max_v l[v]                       exact (max does not round)
    z   = l - m                            fp32
    s   = sum_v exp(z[v])                  exp: kernels/primitives
    lp  = z - log(s)                       log: kernels/primitives; result fp32, never rounded further
token_logprobs gathers lp at the target ids with the same arithmetic, so its values equal the
corresponding entries of log_softmax bit for bit. Megatron's vocab-parallel cross-entropy computes
log(s) - z[target]: the same expression, negated.

Contract (both backends):
    inputs        logits [T, V] in bf16, fp16 or fp32, upcast to fp32 first: on the GPU into an fp32 buffer
                  (UPCAST_ROWS rows at a time), so the kernel always loads fp32 rows from an aligned
                  buffer and a bf16 rollout logit and its fp32 copy give one result (primitives.
                  reduction_input says why the buffer matters)
    reduction     sum over V only. CPU: kernels/primitives.fixed_sum (blocks of 32, pairwise tree in a
                  block, blocks left to right). GPU: one program per row, V in steps of BLOCK_V (4096)
                  left to right, tl.sum's fixed tree inside a step. Independent of the number of rows
Backward: plain torch in fp32 (softmax from the saved lse).
"""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import (cdiv, compiling_inference, exp, fixed_sum, log, no_gradient, opaque_op,
                                          reduction_input, triton, use_triton)

BLOCK_V = 4096
UPCAST_ELEMENTS = 1 << 26  # the fp32 copy of a bf16 batch is made this many logits at a time (256 MiB)


def reference(logits):
    return torch.log_softmax(logits, dim=-1)


def _cpu_lse(l):
    """(l - max [T, V], log(sum(exp(l - max))) [T, 1]) on the CPU."""
    m = l.amax(-1, keepdim=True)
    z = l - m
    return z, log(fixed_sum(exp(z)))[:, None]


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import exp_t, log_t

    @triton.jit
    def _lse_kernel(l_ptr, lse_ptr, max_ptr, V, stride_l, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = l_ptr + row * stride_l
        m = tl.full((), float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.max(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32), axis=0))
        s = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) - m
            s = s + tl.sum(exp_t(z), axis=0)
        tl.store(lse_ptr + row, log_t(s))
        tl.store(max_ptr + row, m)

    @triton.jit
    def _log_softmax_kernel(l_ptr, lse_ptr, max_ptr, y_ptr, V, stride_l, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(l_ptr + row * stride_l + cols, mask=cols < V, other=0.0).to(tl.float32) - tl.load(max_ptr + row)
        tl.store(y_ptr + row * stride_y + cols, z - tl.load(lse_ptr + row), mask=cols < V)


def _lse_triton(l):
    """(max [T], log(sum(exp(l - max))) [T]) by the Triton kernel."""
    t, v = l.shape
    lse = torch.empty(t, dtype=torch.float32, device=l.device)
    m = torch.empty(t, dtype=torch.float32, device=l.device)
    rows = max(1, UPCAST_ELEMENTS // v)
    for a in range(0, t, rows):
        chunk = reduction_input(l[a: a + rows], torch.float32)
        _lse_kernel[(chunk.shape[0],)](chunk, lse[a:], m[a:], v, chunk.stride(0), BLOCK=BLOCK_V, num_warps=8,
                                       enable_fp_fusion=False)
    return m, lse


def _log_softmax(l2):
    if use_triton(l2):
        m, lse = _lse_triton(l2)
        y = torch.empty(l2.shape, dtype=torch.float32, device=l2.device)
        _log_softmax_kernel[(l2.shape[0], cdiv(l2.shape[1], BLOCK_V))](
            l2, lse, m, y, l2.shape[1], l2.stride(0), y.stride(0), BLOCK=BLOCK_V, num_warps=8, enable_fp_fusion=False)
        return y, lse
    z, lse = _cpu_lse(l2.float())
    return z - lse, lse[:, 0]


def _token_logprobs(l2, targets):
    """(logprobs [T], m + log(s) [T], the log-sum-exp of the logits, for the backward pass)."""
    if use_triton(l2):
        m, log_s = _lse_triton(l2)
        picked = l2.gather(1, targets[:, None])[:, 0].float()
        return (picked - m) - log_s, m + log_s
    l = l2.float()
    z, log_s = _cpu_lse(l)
    m = l.amax(-1)
    return z.gather(1, targets[:, None])[:, 0] - log_s[:, 0], m + log_s[:, 0]


def _log_softmax_forward(logits):
    """-> fp32 log_softmax of logits [..., V], in logits' shape."""
    return _log_softmax(logits.reshape(-1, logits.shape[-1]).contiguous())[0].reshape(logits.shape)


def _token_logprobs_forward(logits, targets):
    """-> fp32 log p(target) in targets' shape, and the per-row logsumexp [rows] (fp32)."""
    lp, lse = _token_logprobs(logits.reshape(-1, logits.shape[-1]).contiguous(), targets.reshape(-1))
    return lp.reshape(targets.shape), lse


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        y = _log_softmax_forward(logits)
        ctx.save_for_backward(y)
        ctx.dtype = logits.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        g = g.float()
        return (g - y.exp() * g.sum(-1, keepdim=True)).to(ctx.dtype)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        lp, lse = _token_logprobs_forward(logits, targets)
        ctx.save_for_backward(logits, targets, lse)
        return lp

    @staticmethod
    def backward(ctx, g):
        logits, targets, lse = ctx.saved_tensors
        l2 = logits.reshape(-1, logits.shape[-1]).float()
        grad = -(l2 - lse[:, None]).exp() * g.reshape(-1, 1).float()
        grad.scatter_add_(1, targets.reshape(-1, 1), g.reshape(-1, 1).float())
        return grad.reshape(logits.shape).to(logits.dtype), None


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Strict log_softmax over the last axis: logits [..., V] -> fp32 [..., V]."""
    if compiling_inference(logits):
        return _log_softmax_op(logits)
    if no_gradient(logits):
        return _log_softmax_forward(logits)
    return _LogSoftmax.apply(logits)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Strict log p(target): logits [..., V], targets [...] (int64) -> fp32 [...]; equal bit for bit to
    ``log_softmax(logits).gather(-1, targets[..., None])``."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}")
    if compiling_inference(logits):
        return _token_logprobs_op(logits, targets.long())
    if no_gradient(logits):
        return _token_logprobs_forward(logits, targets.long())[0]
    return _TokenLogprobs.apply(logits, targets.long())


@opaque_op("log_softmax", "(Tensor logits) -> Tensor",
           lambda logits: torch.empty(logits.shape, dtype=torch.float32, device=logits.device))
def _log_softmax_op(logits):
    return _log_softmax_forward(logits)


@opaque_op("token_logprobs", "(Tensor logits, Tensor targets) -> Tensor",
           lambda logits, targets: torch.empty(targets.shape, dtype=torch.float32, device=logits.device))
def _token_logprobs_op(logits, targets):
    return _token_logprobs_forward(logits, targets)[0]
