"""Strict attention as one FlashAttention-3 kernel in every engine (``kernel="flash"``; issue [30]).

Where every engine runs on one Hopper GPU, strict attention need not be a kernel of our own: FlashAttention-3's
forward gives a query row the same bits in every layout an engine calls it in, provided the key dimension is never
split (``num_splits=1``). Measured on an H100 on 2026-12-07 (bench/fa3_bits.py, docs/log/gpu-sessions.md eighteenth
session): 0 rows of 2048 differ between an unpaged varlen prefill (a trainer's forward) and a paged prefill, a
decode step alone, in a batch and among 243 fillers, a chunked prefill's second chunk and a mixed batch, the tile
edges included; FA3's own split heuristic (``num_splits=0``) changes 3 of 16 decode rows. TorchTitan's bitwise RL
and miles make the same call on both sides; vLLM's FLASH_ATTN backend passes ``num_splits=1`` under
VLLM_BATCH_INVARIANT (vllm/v1/attention/backends/flash_attn.py).

The kernel is vLLM's build of FA3 (``vllm.vllm_flash_attn.flash_attn_varlen_func``, ``fa_version=3``), imported
by the training engines too, so trainer and rollout run one binary. Its bits are not the portable kernel's (FA3
exponentiates with the GPU's exp2 and tiles its own way) and exist on sm_90 only: "portable" stays the choice for
bits equal across the CPU and GPUs, and the CPU's only one.

Backward (training): FlashAttention-2's deterministic varlen backward (``flash_gradients``) fed FA3's output and
log-sum-exp [H, T] (fp32, natural log): the gradient of the forward FA3 computed, never compared across engines.
"""

from __future__ import annotations

import functools

import torch

from alignaudit_kernels.attention.flash_gradients import (
    _device_bounds,
    flash_backward_available,
    flash_takes_head_dim,
    varlen_flash_gradients,
)
from alignaudit_kernels.primitives import capability, no_gradient, rocm

KERNELS = ("portable", "flash")
DEFAULT_KERNEL = "portable"
FLASH_SPLITS = 1  # one split of the keys: the layout-independent bits (module docstring)
FLASH_VERSION = 3
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def check_kernel(kernel: str) -> None:
    """Raises ValueError for a ``kernel`` not in KERNELS."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}, not {kernel!r}")


def flash_unavailable(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``kernel="flash"`` cannot run here (one line naming the fix), or None when it can: it needs a CUDA (not
    ROCm) device of compute capability 9.0 (FA3 is built for Hopper only), fp16 or bf16, a head size FA3 and
    FlashAttention-2's backward both take (a multiple of 8 up to 256), and vLLM's FA3 build importable. Answered once
    per (device, dtype, head size) in a process: the kernel's entry points ask at every call, in every layer."""
    return _unavailable(torch.device(device), dtype, head_dim)


@functools.lru_cache(maxsize=None)
def _unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type != "cuda" or rocm():
        return "the flash attention kernel is FlashAttention-3, a CUDA (Hopper) kernel; use the portable one here"
    if not torch.cuda.is_available():
        return "the flash attention kernel is FlashAttention-3, and this torch sees no CUDA GPU"
    if capability(device) != (9, 0):
        major, minor = capability(device)
        return (
            f"the flash attention kernel is FlashAttention-3, built for compute capability 9.0 (Hopper); this GPU "
            f"is {major}.{minor}: use the portable one"
        )
    if dtype not in FLASH_DTYPES:
        return f"FlashAttention-3 computes fp16 and bf16, not {dtype}; use the portable attention kernel"
    if not flash_takes_head_dim(head_dim):
        return f"FlashAttention computes head sizes that are multiples of 8 up to 256, not {head_dim}"
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except ImportError:
        return "the flash attention kernel is vLLM's FlashAttention-3 build (vllm.vllm_flash_attn); install vLLM"
    if not is_fa_version_supported(FLASH_VERSION):
        return "this vLLM build has no FlashAttention-3 (vllm.vllm_flash_attn); use the portable attention kernel"
    return None


def _fa3(
    q,
    k,
    v,
    cu_q,
    max_q: int,
    max_k: int,
    scale: float,
    *,
    cu_k=None,
    seqused_k=None,
    block_table=None,
    out=None,
    lse: bool = False,
):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        max_seqlen_q=max_q,
        cu_seqlens_q=cu_q,
        max_seqlen_k=max_k,
        cu_seqlens_k=cu_k,
        seqused_k=seqused_k,
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
        out=out,
        return_softmax_lse=lse,
        num_splits=FLASH_SPLITS,
        fa_version=FLASH_VERSION,
    )


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float):
    """Causal attention of a ragged batch of whole sequences (a trainer's forward) by FA3, one key split.

    Args: q [T, H, D], k/v [T, KVH, D] (KVH dividing H) of one fp16/bf16 dtype on a Hopper GPU; cu_seqlens [B + 1]
    int on the host (sequence i is rows cu[i]:cu[i+1], positions 0..len-1); scale: the scores' factor.
    Returns [T, H, D] in q's dtype; differentiable (backward: module docstring).
    Raises ValueError where ``flash_unavailable`` gives a reason.
    """
    reason = flash_unavailable(q.device, q.dtype, q.shape[-1])
    if reason:
        raise ValueError(reason)
    if no_gradient(q, k, v):
        return _varlen_forward(q, k, v, cu_seqlens.cpu(), scale, lse=False)
    return _FlashVarlen.apply(q, k, v, cu_seqlens.cpu(), float(scale))


def _longest(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence of host ``cu_seqlens`` (0 for none)."""
    bounds = cu_seqlens.tolist()
    return max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)), default=0)


def _varlen_forward(q, k, v, cu_seqlens, scale, lse: bool, longest: int | None = None):
    """FA3 over host ``cu_seqlens``, copied to the device once per batch layout (flash_gradients._device_bounds)."""
    longest = _longest(cu_seqlens) if longest is None else longest
    cu = _device_bounds(tuple(cu_seqlens.tolist()), q.device)
    return _fa3(q, k, v, cu, longest, longest, scale, cu_k=cu, lse=lse)


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        if not flash_backward_available(q):
            raise ValueError(
                "the flash attention kernel's backward is FlashAttention-2's (torch's); this torch or "
                "GPU lacks it: use the portable kernel"
            )
        ctx.scale, ctx.longest = scale, _longest(cu_seqlens)
        out, lse = _varlen_forward(q, k, v, cu_seqlens, scale, lse=True, longest=ctx.longest)
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
        return (*varlen_flash_gradients(q, k, v, g, cu_seqlens, ctx.longest, ctx.scale, out, lse), None, None)


def flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float):
    """Causal attention of a batch whose queries are the last Tq of each sequence's Tk keys (a cached forward): q [B,
    Tq, H, D] (or [Tq, H, D]), k/v [B, Tk, KVH, D] (or [Tk, KVH, D]), q_positions [B, Tq] (or [Tq]) which must be
    Tk - Tq .. Tk - 1 in every row (FA3's causal mask is aligned to the last key). Forward only (inference).
    Returns q's shape and dtype.
    Raises ValueError for other positions (one device synchronization to check them) or where
    ``flash_unavailable`` gives a reason."""
    if q.dim() == 3:
        return flash_causal(q[None], k[None], v[None], q_positions.reshape(1, -1), scale)[0]
    reason = flash_unavailable(q.device, q.dtype, q.shape[-1])
    if reason:
        raise ValueError(reason)
    b, tq, h, d = q.shape
    tk = k.shape[1]
    expected = torch.arange(tk - tq, tk, device=q_positions.device).expand(b, tq)
    if not torch.equal(q_positions.reshape(b, tq), expected):
        raise ValueError(
            "the flash attention kernel computes queries at the last positions of their keys "
            "(bottom-right causal); these positions are not: use the portable kernel"
        )
    cu_q = torch.arange(0, (b + 1) * tq, tq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * tk, tk, dtype=torch.int32, device=q.device)
    out = _fa3(
        q.reshape(b * tq, h, d),
        k.reshape(b * tk, *k.shape[2:]),
        v.reshape(b * tk, *v.shape[2:]),
        cu_q,
        tq,
        tk,
        scale,
        cu_k=cu_k,
    )
    return out.view(b, tq, h, d)


def flash_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a paged KV cache (an inference engine's step: prefill, chunked prefill, decode or a mix) by
    FA3, one key split: no host synchronization, so a CUDA graph captures it.

    Args:
        q: [T, H, D] the step's query rows, request i's at rows query_start_loc[i]:query_start_loc[i+1], the last
            of them at position seq_lens[i] - 1 (its keys already in the cache).
        k_cache, v_cache: [num_blocks, block_size, KVH, D] (vLLM's FLASH_ATTN layout; block_size a multiple of 16).
        block_table: [R, max_blocks] int32. query_start_loc: [R + 1] int32. seq_lens: [R] int32, keys per request.
        max_query_len, max_seq_len: host ints bounding the rows and the keys of any request.
        out: [T, H, D] to write into, or None.
    Returns ``out`` or a new [T, H, D]. Raises ValueError where ``flash_unavailable`` gives a reason.
    """
    reason = flash_unavailable(q.device, q.dtype, q.shape[-1])
    if reason:
        raise ValueError(reason)
    return _fa3(
        q,
        k_cache,
        v_cache,
        query_start_loc,
        max_query_len,
        max_seq_len,
        scale,
        seqused_k=seq_lens,
        block_table=block_table,
        out=out,
    )
