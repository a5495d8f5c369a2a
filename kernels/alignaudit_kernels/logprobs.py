"""Strict log_softmax over the vocabulary, and the logprob of target tokens, in fp32.

    m   = max_v l[v]                       exact (max does not round)
    z   = l - m                            fp32
    s   = sum_v exp(z[v])                  exp: alignaudit_kernels.primitives; sum: primitives.unit_sum (exact)
    lp  = z - log(s)                       log: alignaudit_kernels.primitives; result fp32, never rounded further
token_logprobs gathers lp at the target ids with the same arithmetic, so its values equal the
corresponding entries of log_softmax bit for bit. Megatron's vocab-parallel cross-entropy computes
log(s) - z[target]: the same expression, negated.

Contract (both backends):
    inputs        logits [T, V] in bf16, fp16 or fp32, upcast to fp32 on load
    reduction     max (exact) and unit_sum (exact fixed-point, rounded once): neither depends on the order,
                  so the result is the same on the CPU and the GPU, for any number of rows, any split of
                  the vocabulary between programs, and any width of the loads (a bf16 logit and its fp32
                  copy give one result without an upcast buffer; primitives.reduction_input says why that
                  needed one while the sum was a tl.sum of floats)
    GPU           grid (rows, vocabulary chunks): chunk maxima and chunk sums meet in per-row atomics (an
                  fp32 max and an int64 add: exact, so their order does not matter); a single row is
                  spread over the whole GPU
    tensor        token_logprobs_vocab_parallel: the same stages on each rank's vocabulary shard, with the
    parallel      row statistics all-reduced between them (exact, so: the one-rank bits)
Backward: plain torch in fp32 (token_logprobs: softmax from the saved log-sum-exp; log_softmax: from its
output). Limit: V <= primitives.UNIT_SUM_MAX_TERMS (2^20); a larger vocabulary raises ValueError.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import (
    cdiv,
    compiling_inference,
    exp,
    log,
    no_gradient,
    opaque_op,
    sm_count,
    triton,
    unit_sum_scale,
    unit_sum_units,
    units_to_sum,
    use_triton,
)

BLOCK_V = 4096
INTERPRETER_SPLITS = 3  # vocabulary chunks per row under the Triton interpreter, so the CPU tests cover splits


def reference(logits):
    return torch.log_softmax(logits, dim=-1)


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import exp_t, log_t

    @triton.jit
    def _max_kernel(l_ptr, max_ptr, V, stride_l, chunk, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * chunk
        base = l_ptr + row * stride_l
        m = tl.full((), float("-inf"), tl.float32)
        for v0 in range(start, tl.minimum(start + chunk, V), BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.max(tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32), axis=0))
        tl.atomic_max(max_ptr + row, m + 0.0)  # -0.0 -> +0.0: Triton < 3.4 mishandled -0.0 in a float atomic_max

    @triton.jit
    def _units_kernel(l_ptr, max_ptr, units_ptr, nan_ptr, V, stride_l, chunk, scale, BLOCK: tl.constexpr):
        """int64 sum of exp(l - m) in units of 1/scale over one chunk, added to the row's total; a NaN in
        l - m sets the row's NaN flag (primitives.unit_sum_units' arithmetic)."""
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * chunk
        base = l_ptr + row * stride_l
        m = tl.load(max_ptr + row)
        total = tl.zeros((), tl.int64)
        nan = tl.zeros((), tl.int64)
        for v0 in range(start, tl.minimum(start + chunk, V), BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            inside = cols < V
            z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) - m
            bad = inside & (z != z)
            e = tl.where(inside & ~bad, exp_t(z), 0.0)  # never convert a NaN to an integer
            total += tl.sum((e * scale).to(tl.int64), axis=0)
            nan = tl.maximum(nan, tl.max(bad.to(tl.int64), axis=0))
        tl.atomic_add(units_ptr + row, total)
        tl.atomic_max(nan_ptr + row, nan)

    @triton.jit
    def _log_s_kernel(units_ptr, nan_ptr, log_s_ptr, T, inv_scale, BLOCK: tl.constexpr):
        """log(s) of every row from its int64 sum and NaN flag (primitives.units_to_sum, then log): the one
        place the GPU computes it, so log_softmax (a rollout engine's path) and token_logprobs (a trainer's)
        subtract the same log(s) by construction."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < T
        rows = tl.where(inside, rows, 0).to(tl.int64)
        s = tl.load(units_ptr + rows).to(tl.float32) * inv_scale
        tl.store(log_s_ptr + rows, tl.where(tl.load(nan_ptr + rows) != 0, float("nan"), log_t(s)), mask=inside)

    @triton.jit
    def _log_softmax_kernel(l_ptr, max_ptr, log_s_ptr, y_ptr, V, stride_l, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(l_ptr + row * stride_l + cols, mask=cols < V, other=0.0).to(tl.float32) - tl.load(max_ptr + row)
        tl.store(y_ptr + row * stride_y + cols, z - tl.load(log_s_ptr + row), mask=cols < V)

    @triton.jit
    def _finish_kernel(picked_ptr, max_ptr, log_s_ptr, lp_ptr, lse_ptr, T, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = rows < T
        rows = tl.where(inside, rows, 0).to(tl.int64)
        m = tl.load(max_ptr + rows)
        log_s = tl.load(log_s_ptr + rows)
        tl.store(lp_ptr + rows, (tl.load(picked_ptr + rows).to(tl.float32) - m) - log_s, mask=inside)
        tl.store(lse_ptr + rows, m + log_s, mask=inside)


def _vocabulary_chunk(t, v, device):
    """Logits per program along V (a multiple of BLOCK_V): all of V once the rows alone fill the GPU twice,
    else V split so that rows x chunks does. The arithmetic is the same for any chunk (unit_sum is exact)."""
    blocks = cdiv(v, BLOCK_V)
    splits = INTERPRETER_SPLITS if device.type == "cpu" else cdiv(2 * sm_count(device), t)
    return cdiv(blocks, max(1, min(splits, blocks))) * BLOCK_V


def _row_max(l2):
    """max over V of l2 [T, V] (any float dtype, unit stride along V) -> fp32 [T]. Exact; a maximum of -0.0
    is returned as +0.0 on both backends."""
    if not use_triton(l2):
        return l2.float().amax(-1) + 0.0
    t, v = l2.shape
    m = torch.full((t,), float("-inf"), dtype=torch.float32, device=l2.device)
    chunk = _vocabulary_chunk(t, v, l2.device)
    _max_kernel[(t, cdiv(v, chunk))](l2, m, v, l2.stride(0), chunk, BLOCK=BLOCK_V, num_warps=8)
    return m


def _row_units(l2, m, scale):
    """primitives.unit_sum_units of exp(l2 - m[:, None]): (int64 [T], NaN flags int64 [T]). Exact, so the
    units of any split of V add up to the whole row's."""
    if not use_triton(l2):
        return unit_sum_units(exp(l2.float() - m[:, None]), scale)
    t, v = l2.shape
    units, nan = torch.zeros((2, t), dtype=torch.int64, device=l2.device)
    chunk = _vocabulary_chunk(t, v, l2.device)
    _units_kernel[(t, cdiv(v, chunk))](
        l2, m, units, nan, v, l2.stride(0), chunk, scale, BLOCK=BLOCK_V, num_warps=8, enable_fp_fusion=False
    )
    return units, nan


def _row_log_s(units, nan, scale):
    """log(s) [T] fp32 of each row from its unit_sum units [T] and NaN flags [T] (NaN where flagged)."""
    if not use_triton(units):
        return log(units_to_sum(units, nan, scale))
    t = units.shape[0]
    log_s = torch.empty(t, dtype=torch.float32, device=units.device)
    _log_s_kernel[(cdiv(t, 256),)](units, nan, log_s, t, 1.0 / scale, BLOCK=256, enable_fp_fusion=False)
    return log_s


def _finish(picked, m, units, nan, scale):
    """(log p = (picked - m) - log(s) [T], m + log(s) [T], the log-sum-exp for the backward pass), fp32, from
    the target logits [T] (any float dtype) and the row statistics."""
    log_s = _row_log_s(units, nan, scale)
    if not use_triton(picked):
        return (picked.float() - m) - log_s, m + log_s
    t = picked.shape[0]
    lp = torch.empty(t, dtype=torch.float32, device=picked.device)
    lse = torch.empty_like(lp)
    _finish_kernel[(cdiv(t, 256),)](picked, m, log_s, lp, lse, t, BLOCK=256, enable_fp_fusion=False)
    return lp, lse


def _log_softmax(l2):
    """fp32 log_softmax of l2 [T, V]."""
    scale = unit_sum_scale(l2.shape[1])
    m = _row_max(l2)
    log_s = _row_log_s(*_row_units(l2, m, scale), scale)
    if not use_triton(l2):
        return (l2.float() - m[:, None]) - log_s[:, None]
    y = torch.empty(l2.shape, dtype=torch.float32, device=l2.device)
    _log_softmax_kernel[(l2.shape[0], cdiv(l2.shape[1], BLOCK_V))](
        l2, m, log_s, y, l2.shape[1], l2.stride(0), y.stride(0), BLOCK=BLOCK_V, num_warps=8, enable_fp_fusion=False
    )
    return y


def _token_logprobs(l2, targets):
    """(logprobs [T], m + log(s) [T], the log-sum-exp of the logits, for the backward pass)."""
    scale = unit_sum_scale(l2.shape[1])
    m = _row_max(l2)
    return _finish(l2.gather(1, targets[:, None])[:, 0], m, *_row_units(l2, m, scale), scale)


def _log_softmax_forward(logits):
    """-> fp32 log_softmax of logits [..., V], in logits' shape."""
    return _log_softmax(logits.reshape(-1, logits.shape[-1]).contiguous()).reshape(logits.shape)


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


def _vocab_parallel_forward(shard, targets, vocab_start, vocab_size, group):
    """-> fp32 log p(target) in targets' shape and the per-row logsumexp [rows], from this rank's vocabulary
    shard: three all-reduces between the stages (the row max and the target logit, -inf on the ranks that do
    not hold it: MAX; the units: SUM; NaN flags and "some rank holds the target": MAX), every one exact. A
    target no rank holds (outside [0, vocab_size)) makes its row NaN."""
    import torch.distributed as dist

    l2 = shard.reshape(-1, shard.shape[-1]).contiguous()
    local = targets.reshape(-1) - vocab_start
    mine = (local >= 0) & (local < l2.shape[1])
    picked = l2.gather(1, local.clamp(0, l2.shape[1] - 1)[:, None])[:, 0].float()
    maxima = torch.stack([_row_max(l2), torch.where(mine, picked, float("-inf"))])
    dist.all_reduce(maxima, dist.ReduceOp.MAX, group=group)
    m, picked = maxima
    scale = unit_sum_scale(vocab_size)
    units, nan = _row_units(l2, m, scale)
    dist.all_reduce(units, dist.ReduceOp.SUM, group=group)
    flags = torch.stack([nan, mine.to(torch.int64)])
    dist.all_reduce(flags, dist.ReduceOp.MAX, group=group)
    lp, lse = _finish(picked, m, units, torch.maximum(flags[0], 1 - flags[1]), scale)
    return lp.reshape(targets.shape), lse


def _logprob_gradient(logits, targets, lse, g, vocab_start=0):
    """d log p(target) / d logits for the rows' logits [..., V'] (V' the whole vocabulary or one shard whose
    first entry is vocab_start): g * (onehot(target) - exp(l - lse)), fp32, returned in logits' dtype."""
    l2 = logits.reshape(-1, logits.shape[-1]).float()
    g2 = g.reshape(-1, 1).float()
    grad = -(l2 - lse[:, None]).exp() * g2
    local = targets.reshape(-1, 1) - vocab_start
    mine = (local >= 0) & (local < l2.shape[1])
    # -0.0, the additive identity for every value (+0.0 would turn a -0.0 gradient into +0.0)
    grad.scatter_add_(1, local.clamp(0, l2.shape[1] - 1), torch.where(mine, g2, -0.0))
    return grad.reshape(logits.shape).to(logits.dtype)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        lp, lse = _token_logprobs_forward(logits, targets)
        ctx.save_for_backward(logits, targets, lse)
        return lp

    @staticmethod
    def backward(ctx, g):
        return _logprob_gradient(*ctx.saved_tensors, g), None


class _TokenLogprobsVocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, targets, vocab_start, vocab_size, group):
        lp, lse = _vocab_parallel_forward(shard, targets, vocab_start, vocab_size, group)
        ctx.save_for_backward(shard, targets, lse)
        ctx.vocab_start = vocab_start
        return lp

    @staticmethod
    def backward(ctx, g):
        return _logprob_gradient(*ctx.saved_tensors, g, ctx.vocab_start), None, None, None, None


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Strict log_softmax over the last axis: logits [..., V] -> fp32 [..., V] (module docstring: the
    arithmetic). Raises ValueError for V > 2^20 (primitives.UNIT_SUM_MAX_TERMS)."""
    if compiling_inference(logits):
        return _log_softmax_op(logits)
    if no_gradient(logits):
        return _log_softmax_forward(logits)
    return _LogSoftmax.apply(logits)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Strict log p(target): logits [..., V], targets [...] (int64) -> fp32 [...]; equal bit for bit to
    ``log_softmax(logits).gather(-1, targets[..., None])``. Raises ValueError on a shape mismatch or for
    V > 2^20 (primitives.UNIT_SUM_MAX_TERMS)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}")
    if compiling_inference(logits):
        return _token_logprobs_op(logits, targets.long())
    if no_gradient(logits):
        return _token_logprobs_forward(logits, targets.long())[0]
    return _TokenLogprobs.apply(logits, targets.long())


def token_logprobs_vocab_parallel(
    shard: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group
) -> torch.Tensor:
    """Strict log p(target) with the vocabulary split over tensor-parallel ranks (Megatron's vocab-parallel
    layout), without gathering the logits: shard [..., V/t] holds vocabulary entries [vocab_start,
    vocab_start + V/t) of vocab_size; targets [...] (int64, global ids); group: a torch.distributed process
    group. Every rank returns the same fp32 [...], equal bit for bit to ``token_logprobs`` of the whole
    vocabulary on one rank, because max and unit_sum are exact, so the all-reduces between their stages
    (O(rows) numbers, where a gather moves rows x V) cannot change a bit. Backward: each rank's gradient for
    its shard. A target outside [0, vocab_size) gives NaN (checking it on the host would synchronize).
    Raises ValueError on a shape mismatch, a shard outside [0, vocab_size), or vocab_size >
    primitives.UNIT_SUM_MAX_TERMS."""
    if shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"token_logprobs_vocab_parallel: logits {tuple(shard.shape)} vs targets {tuple(targets.shape)}"
        )
    if vocab_start < 0 or vocab_start + shard.shape[-1] > vocab_size:
        raise ValueError(
            f"token_logprobs_vocab_parallel: a shard of {shard.shape[-1]} entries from {vocab_start} does "
            f"not fit a vocabulary of {vocab_size}"
        )
    if no_gradient(shard):
        return _vocab_parallel_forward(shard, targets.long(), vocab_start, vocab_size, group)[0]
    return _TokenLogprobsVocabParallel.apply(shard, targets.long(), vocab_start, vocab_size, group)


@opaque_op(
    "log_softmax",
    "(Tensor logits) -> Tensor",
    lambda logits: torch.empty(logits.shape, dtype=torch.float32, device=logits.device),
)
def _log_softmax_op(logits):
    return _log_softmax_forward(logits)


@opaque_op(
    "token_logprobs",
    "(Tensor logits, Tensor targets) -> Tensor",
    lambda logits, targets: torch.empty(targets.shape, dtype=torch.float32, device=logits.device),
)
def _token_logprobs_op(logits, targets):
    return _token_logprobs_forward(logits, targets)[0]
