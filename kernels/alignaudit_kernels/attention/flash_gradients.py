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
import threading

import torch

from alignaudit_kernels.primitives import cached_tensors, capability, rocm, to_device

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def flash_takes_head_dim(head_dim: int) -> bool:
    """Whether FlashAttention's kernels take this head size: a multiple of 8 up to FLASH_MAX_HEAD_DIM (flash_api.cpp's
    checks; FA3's forward takes the same range)."""
    return head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM


def flash_backward_available(q: torch.Tensor) -> bool:
    """Whether torch's FlashAttention-2 kernels take q [T, H, D]: a CUDA (not ROCm) tensor on an Ampere or newer GPU
    (compute capability 8+), in fp16/bf16, with D a multiple of 8 up to 256 (flash_api.cpp's checks), on a torch that
    has the op."""
    return (
        q.is_cuda
        and not rocm()
        and q.dtype in FLASH_DTYPES
        and flash_takes_head_dim(q.shape[-1])
        and capability(q.device)[0] >= 8
        and hasattr(torch.ops.aten, "_flash_attention_backward")
    )


_MODE_LOCK = threading.Lock()
_mode_users = 0  # blocks inside deterministic_algorithms() now, in any thread
_saved_mode: tuple[bool, bool, bool] | None = None  # the settings the first of them found


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the block, with ``torch.utils.deterministic.
    fill_uninitialized_memory`` off. Both are process-wide: an op another thread launches meanwhile runs under them
    too. Blocks may overlap (autograd runs a backward per device thread): the first to enter saves the settings it
    finds, the mode stays on while any block is inside, and the last to leave restores them."""
    global _mode_users, _saved_mode
    with _MODE_LOCK:
        if _mode_users == 0:
            _saved_mode = (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory,
            )
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = False
        _mode_users += 1
    try:
        yield
    finally:
        with _MODE_LOCK:
            _mode_users -= 1
            if _mode_users == 0:
                mode, warn_only, fill = _saved_mode
                torch.utils.deterministic.fill_uninitialized_memory = fill
                torch.use_deterministic_algorithms(mode, warn_only=warn_only)


@cached_tensors(maxsize=64)
def _device_bounds(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Host cu_seqlens ``bounds`` as int32 [B + 1] on ``device``, kept per batch layout: every layer's backward reads
    the same sequences, and a copy from pageable host memory per layer would make the host wait for the stream each
    time (torch synchronizes a blocking host-to-device copy), draining the launch queue once a layer. The one copy
    is from pinned memory, in stream order (``to_device``): not even a new layout waits."""
    return to_device(torch.tensor(bounds, dtype=torch.int32), device)


def varlen_flash_gradients(q, k, v, g, cu_seqlens, max_len: int, scale: float, out=None, lse=None):
    """Gradients of causal attention over whole sequences by FlashAttention-2, deterministic.

    Args:
        q, g: [T, H, D]; k, v: [T, KVH, D] (KVH dividing H), one fp16/bf16 dtype, on CUDA
            (``flash_backward_available``). cu_seqlens: [B + 1] int, sequence i is rows cu[i]:cu[i+1] at
            positions 0..len-1; on the host (as varlen_attention keeps them), copied to the device once per layout.
            max_len: the longest sequence (host int). scale: the scores' factor.
        out, lse: the forward's output [T, H, D] and fp32 log-sum-exp [H, T]; both None to recompute them with
            torch's flash forward.
    Returns: (dq, dk, dv) in q's shapes and dtype.
    """
    cu = (
        _device_bounds(tuple(cu_seqlens.tolist()), q.device)
        if cu_seqlens.device.type == "cpu"
        else cu_seqlens.to(device=q.device, dtype=torch.int32)
    )
    with deterministic_algorithms():
        if lse is None:
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
            )
        else:  # no dropout: never read (torch's flash forward returns such empty CPU scalars then)
            seed = offset = torch.empty((), dtype=torch.long)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            g.contiguous(), q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, seed, offset, scale=scale
        )
    return dq, dk, dv
