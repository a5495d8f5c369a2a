"""Attention gradients by torch's FlashAttention-2 backward over a whole ragged batch, deterministically: the fused
backward (ALIGNAUDIT_BACKWARD=fused) of ``varlen_attention`` on CUDA.

One launch of ``aten._flash_attention_backward`` for every sequence of the batch (cu_seqlens; GQA read in place,
so no K/V copy per query head and no regrouping of the sequences by length), fed the strict forward's output and
its log-sum-exp per head and row: lse[h, t] = m + log(l) of the kernel's final softmax state, the natural log of
the sum of exp(scale * q.k) over the row's keys, which FlashAttention-2's backward re-exponentiates its scores
against (P = exp(scale * S - lse); Dao, "FlashAttention-2", 2023, Algorithm 2). A forward that kept no lse (the
fused backward asked only after it ran) has it recomputed by torch's flash forward.

FlashAttention-2 adds the partial sums of dQ with atomics unless its deterministic flag is set, and torch sets
that flag from ``torch.use_deterministic_algorithms`` (aten/src/ATen/native/transformers/cuda/
attention_backward.cu, ``_flash_attention_backward`` and ``_efficient_attention_backward``), so every backward
here runs inside ``deterministic_algorithms()``: the mode on, torch's NaN fill of uninitialized memory off (it
would fill every output and workspace), the caller's settings restored after.
"""

from __future__ import annotations

import contextlib

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def flash_backward_available(q: torch.Tensor) -> bool:
    """Whether torch's FlashAttention-2 kernels take q [T, H, D]: a CUDA (not ROCm) tensor in fp16/bf16 with D a
    multiple of 8 up to 256 (flash_api.cpp's checks), on a torch that has the op."""
    d = q.shape[-1]
    return (q.is_cuda and torch.version.hip is None and q.dtype in FLASH_DTYPES and d % 8 == 0
            and d <= FLASH_MAX_HEAD_DIM and hasattr(torch.ops.aten, "_flash_attention_backward"))


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the block (it is process-wide: an op another thread launches
    meanwhile runs under it too), with ``torch.utils.deterministic.fill_uninitialized_memory`` off; both
    restored after."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def varlen_flash_gradients(q, k, v, g, cu_seqlens, max_len: int, scale: float, out=None, lse=None):
    """Gradients of causal attention over whole sequences by FlashAttention-2, deterministic.

    Args:
        q, g: [T, H, D]; k, v: [T, KVH, D] (KVH dividing H), one fp16/bf16 dtype, on CUDA
            (``flash_backward_available``). cu_seqlens: [B + 1] int, sequence i is rows cu[i]:cu[i+1] at
            positions 0..len-1. max_len: the longest sequence (host int). scale: the scores' factor.
        out, lse: the forward's output [T, H, D] and fp32 log-sum-exp [H, T]; both None to recompute them with
            torch's flash forward.
    Returns: (dq, dk, dv) in q's shapes and dtype.
    """
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    with deterministic_algorithms():
        if lse is None:
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        else:  # no dropout: never read (torch's flash forward returns such empty CPU scalars then)
            seed = offset = torch.empty((), dtype=torch.long)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            g.contiguous(), q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, seed, offset, scale=scale)
    return dq, dk, dv


def equal_length_cudnn_gradients(q, k, v, g, out, lse, length: int, scale: float):
    """A candidate, not yet measured (bench/kernels_gpu.py --sections attention-backward times it): the same
    gradients as ``varlen_flash_gradients`` for a batch of B sequences of ``length`` tokens each, by cuDNN's SDPA
    backward (``aten._scaled_dot_product_cudnn_attention_backward``, torch's fastest attention backward on an H200:
    docs/benchmarks.md 2026-12-05 sixth session), deterministic under the same mode. q, g, out [B * length, H, D],
    k, v [B * length, KVH, D] are read as [B, heads, length, D] views; lse [H, B * length] fp32 is laid out as
    cuDNN's softmax statistics [B, H, length, 1]. Returns (dq, dk, dv) in the inputs' shapes.
    Raises RuntimeError where torch's cuDNN attention does not take these inputs (e.g. no cuDNN frontend build)."""
    b = q.shape[0] // length

    def heads_major(x):
        return x.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)

    stats = lse.view(lse.shape[0], b, length).permute(1, 0, 2).contiguous()[..., None]
    unused = torch.empty((), dtype=torch.long, device=q.device)  # no dropout: the Philox state is never read
    with deterministic_algorithms():
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            heads_major(g), heads_major(q), heads_major(k), heads_major(v), heads_major(out), stats, unused, unused,
            None, None, None, length, length, 0.0, True, scale=scale)
    return tuple(x.transpose(1, 2).reshape(b * length, x.shape[1], x.shape[3]) for x in grads)
