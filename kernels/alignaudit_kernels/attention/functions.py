"""The entry points of strict attention (paged prefill and decode for inference engines, contiguous batches
for training engines) and their autograd (torch_reference.attention_gradients)."""

from __future__ import annotations

import torch

from alignaudit_kernels.attention.algorithm import DEFAULT_EXP, _check_exp
from alignaudit_kernels.attention.cpu import _cpu_attend
from alignaudit_kernels.attention.flash import DEFAULT_KERNEL, check_kernel, flash_causal, flash_varlen
from alignaudit_kernels.attention.flash_gradients import flash_backward_available, varlen_flash_gradients
from alignaudit_kernels.attention.launch import (
    DECODE_CONFIG,
    KV_DIRECT,
    TILE_CONFIG,
    _as_pages,
    _batch_plan,
    _check_caches,
    _check_out,
    _check_tiles,
    _kv_mode,
    _launch,
    _launch_varlen,
    _triton_paged,
)
from alignaudit_kernels.attention.torch_reference import attention_gradients
from alignaudit_kernels.gradients import backward_on
from alignaudit_kernels.primitives import (
    compiling_inference,
    no_gradient,
    opaque_op,
    use_triton,
)


def paged_attention(
    q, k_cache, v_cache, block_table, q_positions, q_seq, scale, exp=DEFAULT_EXP, max_keys=None, out=None, tiles=None
):
    """Strict attention over a paged KV cache (inference engines; prefill and decode alike).

    Args:
        q: [T, H, D] query rows of any number of sequences (bf16/fp16/fp32).
        k_cache, v_cache: [num_blocks, block_size, KVH, D]; keys of sequence i at positions 0..p are in
            blocks block_table[i, 0], block_table[i, 1], ... (already written, the current token included).
        block_table: [num_sequences, max_blocks] int. q_positions: [T] absolute position of each row.
        q_seq: [T] sequence index of each row (rows of one sequence consecutive); read on the host, so a
            CPU tensor costs no device synchronization. scale: float.
        exp: "portable" or "native" (module docstring).
        max_keys: host int >= every q_positions[i] + 1 (an engine's longest sequence), or None to read the
            bound from q_positions (a device synchronization on a GPU). It sizes the chunk grid only: every
            bound at or above the longest row's keys gives the same bits. A row past it: NaN on the GPU (no
            key past the bound is read), ValueError on the CPU.
        out: [T, H, D] of q's dtype, unit stride along D, to write into (an engine's output buffer: no copy),
            or None.
        tiles: the Triton backends' query tiles for these rows (``paged_tiles(q_seq, H // KVH, q.device)``, planned
            once per engine step for all its layers), or None to plan them here; the same bits either way. The
            CPU backend plans per sequence from q_seq and does not read them.
    Returns: ``out`` or a new [T, H, D] in q.dtype. Without ``tiles`` (or ``max_keys``) it plans on the host from
    q_seq (or reads q_positions): not capturable in a CUDA graph; ``paged_decode`` is.
    Raises: ValueError for an unknown ``exp``, "native" on the CPU backend, an ``out`` that cannot hold the
    result, caches that the kernel cannot read as given (``_check_caches``), or ``tiles`` planned for another
    number of rows or of query heads per KV head.
    """
    _check_exp(exp, q)
    _check_caches(q, k_cache, v_cache)
    _check_tiles(tiles, q, k_cache)
    if use_triton(q):
        return _triton_paged(
            q,
            k_cache,
            v_cache,
            block_table,
            q_positions,
            q_seq,
            scale,
            exp=exp,
            max_keys=max_keys,
            out=out,
            tiles=tiles,
        )
    if max_keys is not None and q_positions.numel() and int(q_positions.max()) >= max_keys:
        raise ValueError(f"paged attention: a query at position {int(q_positions.max())}, past max_keys {max_keys}")
    out = _check_out(q, out)
    bs = k_cache.shape[1]
    for seq in torch.unique_consecutive(q_seq).tolist():
        rows = (q_seq == seq).nonzero()[:, 0]
        n_keys = int(q_positions[rows].max()) + 1
        pages = block_table[seq, : (n_keys + bs - 1) // bs].long()
        k = k_cache[pages].flatten(0, 1)[:n_keys]
        v = v_cache[pages].flatten(0, 1)[:n_keys]
        out[rows] = _cpu_attend(q[rows], k, v, q_positions[rows], scale)
    return out


def paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len, exp=DEFAULT_EXP, out=None):
    """One decode step over a paged KV cache: the row of sequence i is its query at position seq_lens[i] - 1.
    The same bits as ``paged_attention`` (and a prefill) for that row, without any host synchronization, so
    a CUDA graph can capture it (vLLM replays decode steps as graphs).

    Args:
        q: [B, H, D] one query row per sequence. k_cache, v_cache, block_table: as ``paged_attention`` (a
            table whose rows are not contiguous is copied first).
        seq_lens: [B] int on q's device, keys per sequence (the current token included).
        max_seq_len: host int >= every seq_lens[i] (as FlashAttention's max_seqlen_k), in a captured graph
            for every replay: sets the chunk grid (CHUNK_N keys per program when the (sequence, KV head)
            programs alone would leave SMs idle). A longer sequence gives a NaN row on the GPU (checked in
            the kernel: no key past the bound is read, and no extra launch as a device-side assert would
            cost in every layer of every step) and a ValueError on the CPU. scale: float.
        exp: "portable" or "native" (module docstring).
        out: [B, H, D] of q's dtype, unit stride along D, to write into (an engine's output buffer: no copy),
            or None.
    Returns: ``out`` or a new [B, H, D] in q.dtype.
    Raises: ValueError for an unknown ``exp``, "native" on the CPU backend, an ``out`` that cannot hold the
    result, or caches that the kernel cannot read as given (``_check_caches``).
    """
    _check_exp(exp, q)
    if not use_triton(q):
        if seq_lens.numel() and int(seq_lens.max()) > max_seq_len:
            raise ValueError(
                f"paged_decode: a sequence of {int(seq_lens.max())} keys, longer than max_seq_len {max_seq_len}"
            )
        return paged_attention(
            q, k_cache, v_cache, block_table, seq_lens - 1, torch.arange(q.shape[0]), scale, out=out
        )  # checks the caches
    _check_caches(q, k_cache, v_cache)
    table = block_table.to(torch.int32)
    if table.stride(1) != 1:  # the kernel steps along a row by one entry (vLLM's tables: always so, no copy)
        table = table.contiguous()
    return _launch(
        q,
        k_cache,
        v_cache,
        table,
        None,
        seq_lens,
        scale,
        kv_mode=_kv_mode(k_cache),
        max_keys=int(max_seq_len),
        exp=exp,
        out=out,
        config=DECODE_CONFIG,
    )


def causal_attention(q, k, v, q_positions, scale, exp=DEFAULT_EXP, kernel=DEFAULT_KERNEL):
    """Strict attention for a batch of sequences with contiguous K/V (e.g. a training engine's KV cache).

    q [B, Tq, H, D] (or [Tq, H, D] for one sequence) at absolute positions ``q_positions`` [B, Tq] (int;
    [Tq] for one sequence); k/v [B, Tk, KVH, D] hold positions 0..Tk-1 of each sequence. Returns q's shape
    in q.dtype, each row equal bit for bit to the same row of a prefill or a decode. Differentiable:
    backward by torch_reference.attention_gradients, as varlen_attention (an HF trainer's forward).
    exp: "portable" or "native" (module docstring). kernel: "portable" (this package's algorithm) or "flash"
    (FlashAttention-3, attention/flash.py: forward only, queries at the last positions of their keys).
    Raises: ValueError for an unknown ``exp`` or ``kernel``, "native" on the CPU backend or with "flash", and what
    flash.flash_causal raises.
    """
    _check_exp(exp, q)
    if _flash(kernel, exp):
        return flash_causal(q, k, v, q_positions, float(scale))
    if not no_gradient(q, k, v):
        return _CausalAttention.apply(q, k, v, q_positions, float(scale), exp)
    return _causal_forward(q, k, v, q_positions, scale, exp)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_positions, scale, exp):
        ctx.save_for_backward(q, k, v, q_positions)
        ctx.scale = scale
        return _causal_forward(q, k, v, q_positions, scale, exp)

    @staticmethod
    def backward(ctx, g):
        q, k, v, positions = ctx.saved_tensors
        if q.dim() == 3:
            grads = attention_gradients(q[None], k[None], v[None], g[None], ctx.scale, positions.reshape(1, -1))
            return (*(t[0] for t in grads), None, None, None)
        return (*attention_gradients(q, k, v, g, ctx.scale, positions.reshape(q.shape[:2])), None, None, None)


def _causal_forward(q, k, v, q_positions, scale, exp):
    if compiling_inference(q, k, v):
        return _causal_attention_op(q, k, v, q_positions, float(scale), exp)
    if q.dim() == 3:
        return _causal_forward(q[None], k[None], v[None], q_positions.reshape(1, -1), scale, exp)[0]
    b, tq, h, d = q.shape
    if not use_triton(q):
        return torch.stack([_cpu_attend(q[i], k[i], v[i], q_positions[i].cpu(), scale) for i in range(b)])
    tk, kvh = k.shape[1], k.shape[2]
    tiles, table = _batch_plan(b, tq, tk, TILE_CONFIG[0] // (h // kvh), q.device)
    out = _launch(
        q.reshape(b * tq, h, d),
        _as_pages(k.reshape(b * tk, kvh, d)),
        _as_pages(v.reshape(b * tk, kvh, d)),
        table,
        tiles,
        q_positions.reshape(-1).to(q.device),
        scale,
        kv_mode=KV_DIRECT,
        max_keys=tk,
        exp=exp,
    )
    return out.view(b, tq, h, d)


@opaque_op(
    "causal_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor q_positions, float scale, str exp) -> Tensor",
    lambda q, k, v, q_positions, scale, exp: q.new_empty(q.shape),
)
def _causal_attention_op(q, k, v, q_positions, scale, exp):
    return causal_attention(q, k, v, q_positions, scale, exp)


def _contiguous_forward(q, k, v, cu_seqlens, scale, exp=DEFAULT_EXP, lse=None):
    """Ragged batch of whole sequences (prefill from position 0), K/V contiguous [T, KVH, D]. lse: fp32 [H, T] to
    fill with each row's log-sum-exp (Triton backend only)."""
    bounds = cu_seqlens.tolist()
    if not use_triton(q):
        out = torch.empty_like(q)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            out[a:b] = _cpu_attend(q[a:b], k[a:b], v[a:b], torch.arange(b - a), scale)
        return out
    return _launch_varlen(q, k, v, cu_seqlens, scale, exp=exp, lse=lse)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, exp):
        ctx.scale = scale
        # FlashAttention-2's backward reads the forward's output and lse: the choice is made here, once, for both
        ctx.flash = flash_backward_available(q) and backward_on(q.is_cuda) == "fused"
        if ctx.flash:
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
            out = _contiguous_forward(q, k, v, cu_seqlens, scale, exp, lse=lse)
            ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
            return out
        ctx.save_for_backward(q, k, v, cu_seqlens)
        return _contiguous_forward(q, k, v, cu_seqlens, scale, exp)

    @staticmethod
    def backward(ctx, g):
        """FlashAttention-2's varlen backward where the fused backward is asked and takes the inputs
        (flash_gradients); otherwise sequences of one length go through attention_gradients together, gathered into
        [n, length, heads, D]."""
        q, k, v, cu_seqlens, *forward = ctx.saved_tensors
        bounds = cu_seqlens.tolist()
        if ctx.flash:
            longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
            return (*varlen_flash_gradients(q, k, v, g, cu_seqlens, longest, ctx.scale, *forward), None, None, None)
        starts: dict[int, list[int]] = {}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            starts.setdefault(b - a, []).append(a)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for length, firsts in starts.items():
            rows = (torch.tensor(firsts)[:, None] + torch.arange(length)[None, :]).to(q.device)  # [n, length]
            positions = torch.arange(length, device=q.device).expand(len(firsts), length)
            parts = attention_gradients(q[rows], k[rows], v[rows], g[rows], ctx.scale, positions, from_zero=True)
            for grad, part in zip(grads, parts, strict=True):
                grad[rows] = part
        return (*grads, None, None, None)


def varlen_attention(q, k, v, cu_seqlens, scale, exp=DEFAULT_EXP, kernel=DEFAULT_KERNEL):
    """Strict causal attention for a ragged batch of whole sequences (training engines, prefill).

    q [T, H, D], k/v [T, KVH, D], cu_seqlens [B + 1] (int, sequence i is rows cu[i]:cu[i+1], positions
    0..len-1). Returns [T, H, D] in q.dtype; differentiable (torch_reference.attention_gradients).
    exp: "portable" or "native" (module docstring). kernel: "portable" (this package's algorithm) or "flash"
    (FlashAttention-3 forward, FlashAttention-2 backward: attention/flash.py).
    Raises: ValueError when H is not a multiple of KVH, for an unknown ``exp`` or ``kernel``, "native" on the CPU
    backend or with "flash", and what flash.flash_varlen raises.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]}")
    _check_exp(exp, q)
    if _flash(kernel, exp):
        return flash_varlen(q, k, v, cu_seqlens, float(scale))
    if no_gradient(q, k, v):
        return _contiguous_forward(q, k, v, cu_seqlens.cpu(), float(scale), exp)
    return _VarlenAttention.apply(q, k, v, cu_seqlens.cpu(), float(scale), exp)


def _flash(kernel: str, exp: str) -> bool:
    """Whether ``kernel`` is "flash"; ValueError for an unknown kernel or an exp the flash kernel would not apply."""
    check_kernel(kernel)
    if kernel == "flash" and exp != DEFAULT_EXP:
        raise ValueError(f"exp={exp!r} is the portable kernel's choice; FlashAttention-3 computes its own exp")
    return kernel == "flash"
