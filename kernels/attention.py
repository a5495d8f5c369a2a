"""Strict causal attention with GQA: ragged prefill and paged-KV decode produce the same bits per query.

One algorithm for every query row q at absolute position p, whatever else is in the batch:
    keys are visited in logical blocks of BLOCK_N = 64 positions starting at key 0: [0, 64), [64, 128), ...
    per block:   s     = (q . k_j) * scale                    fp32; key j > p masked to -inf
                 m_new = max(m, max_j s)                      exact
                 alpha = exp(m - m_new)                       kernels/primitives.exp (exp(0) = 1 exactly)
                 P     = exp(s - m_new)                       fp32
                 l     = l * alpha + sum_j P                  fp32
                 acc   = acc * alpha + sum_j round(P) * v_j   P rounded to the value dtype first
                                                              (FlashAttention's convention), products fp32
                 (a block with no key <= p leaves m, l, acc untouched, so a batch that visits more
                 blocks for other rows cannot change this row)
    out = acc / l                                             rounding point: once, fp32 -> dtype
Query head h reads KV head h // (num_heads / num_kv_heads) (GQA).

Reductions: the dot products over head_dim and the sums over the keys of a block. CPU: products in fp32,
kernels/primitives.fixed_sum (blocks of 32, pairwise tree, blocks left to right). GPU (Triton): tl.dot
on tensor cores (fp32 inputs use IEEE products, not TF32), row sums by tl.sum; one kernel for prefill and
decode, reading K/V through a block table, with a fixed tile of 64 query rows (tokens x heads of a KV
group), so a row's arithmetic does not depend on how many tokens share its tile.

Layouts: q [tokens, heads, head_dim]; K/V either contiguous per sequence [tokens, kv_heads, head_dim]
(training engines) or a paged cache [num_blocks, block_size, kv_heads, head_dim] with a block table
[sequences, max_blocks] (vLLM). Backward: through the plain-torch reference, in fp32.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import exp, fixed_sum, triton

BLOCK_N = 64
TILE_ROWS = 64
CPU_CHUNK_ELEMENTS = 1 << 24


def reference(q, k, v, scale, q_positions=None):
    """Plain torch causal attention for one sequence (float64 inputs for an accuracy reference)."""
    tq, h, d = q.shape
    tk, kvh, _ = k.shape
    pos = torch.arange(tk - tq, tk, device=q.device) if q_positions is None else q_positions
    group = h // kvh
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(torch.arange(tk, device=q.device)[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


def _cpu_attend(q, k, v, q_positions, scale):
    """One sequence on the CPU: q [Tq, H, D], k/v [Tk, KVH, D] at key positions 0..Tk-1."""
    tq, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    out = torch.empty(tq, h, d, dtype=torch.float32)
    rows = max(1, CPU_CHUNK_ELEMENTS // max(1, h * BLOCK_N * d))
    for start in range(0, tq, rows):
        pos = q_positions[start: start + rows].cpu()
        out[start: start + rows] = _cpu_rows(q[start: start + rows].float().view(-1, kvh, group, d), k, v, pos,
                                             scale).view(-1, h, d)
    return out.to(q.dtype)


def _cpu_rows(qf, k, v, pos, scale):
    n, kvh, group, d = qf.shape
    m = torch.full((n, kvh, group), float("-inf"))
    l = torch.zeros(n, kvh, group)
    acc = torch.zeros(n, kvh, group, d)
    blocks = (int(pos.max()) + BLOCK_N) // BLOCK_N
    for b in range(blocks):
        j0 = b * BLOCK_N
        kb = _block(k, j0)  # [BLOCK_N, KVH, D] fp32, zero past the end
        vb = _block(v, j0)
        s = fixed_sum(qf[:, :, :, None, :] * kb.permute(1, 0, 2)[None, :, None, :, :], dim=-1) * scale
        visible = (j0 + torch.arange(BLOCK_N))[None, :] <= pos[:, None]  # [n, BLOCK_N]
        s = torch.where(visible[:, None, None, :], s, float("-inf"))
        active = (j0 <= pos)[:, None, None]
        m_new = torch.maximum(m, s.amax(-1))
        alpha = exp(m - m_new)
        p = exp(s - m_new[..., None])
        p_rounded = p.to(v.dtype).float()
        pv = fixed_sum(p_rounded[..., None] * vb.permute(1, 0, 2)[None, :, None, :, :], dim=-2)
        l = torch.where(active, l * alpha + fixed_sum(p), l)
        acc = torch.where(active[..., None], acc * alpha[..., None] + pv, acc)
        m = torch.where(active, m_new, m)
    return acc / l[..., None]


def _block(x, j0):
    blk = x[j0: j0 + BLOCK_N].float()
    if blk.shape[0] < BLOCK_N:
        blk = torch.nn.functional.pad(blk, (0, 0, 0, 0, 0, BLOCK_N - blk.shape[0]))
    return blk


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import exp_t

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, bt_ptr, tile_seq_ptr, tile_row_ptr, tile_n_ptr,
                                scale, stride_qt, stride_qh, stride_ot, stride_oh,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                                BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                                BLOCK_D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                                CONTIG: tl.constexpr, DIRECT: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
        row0 = tl.load(tile_row_ptr + tile).to(tl.int64)
        nrows = tl.load(tile_n_ptr + tile)
        r = tl.arange(0, TILE)
        tok = r // GROUP
        head = kvh * GROUP + r % GROUP
        valid_row = tok < nrows
        qrow = row0 + tok
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=valid_row[:, None] & dmask[None, :], other=0.0)
        pos = tl.load(pos_ptr + qrow, mask=valid_row, other=-1)
        last = tl.max(pos, axis=0)
        m = tl.full((TILE,), float("-inf"), tl.float32)
        l = tl.zeros((TILE,), tl.float32)
        acc = tl.zeros((TILE, BLOCK_D), tl.float32)
        n = tl.arange(0, BLOCK_N)
        first_page = tl.load(bt_ptr + seq * stride_bt).to(tl.int64)
        for j0 in range(0, last + 1, BLOCK_N):
            key = j0 + n
            if DIRECT:  # the sequence's pages are consecutive from its first page: affine addresses
                page = first_page + (key // BLOCK_SIZE).to(tl.int64)
                slot = (key % BLOCK_SIZE).to(tl.int64)
            elif CONTIG:  # pages hold whole key blocks: one page lookup, contiguous rows
                page = tl.load(bt_ptr + seq * stride_bt + j0 // BLOCK_SIZE).to(tl.int64)
                slot = (j0 % BLOCK_SIZE + n).to(tl.int64)
            else:
                page = tl.load(bt_ptr + seq * stride_bt + key // BLOCK_SIZE, mask=key <= last, other=0).to(tl.int64)
                slot = (key % BLOCK_SIZE).to(tl.int64)
            kmask = (key <= last)[:, None] & dmask[None, :]
            kb = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                         mask=kmask, other=0.0)
            vb = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                         mask=kmask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(kb), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kb))
            s = s * scale
            s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))
            active = j0 <= pos
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = exp_t(m - m_new)
            p = exp_t(s - m_new[:, None])
            if IEEE:
                pv = tl.dot(p, vb, input_precision="ieee")
            else:
                pv = tl.dot(p.to(vb.dtype), vb)
            l = tl.where(active, l * alpha + tl.sum(p, axis=1), l)
            acc = tl.where(active[:, None], acc * alpha[:, None] + pv, acc)
            m = tl.where(active, m_new, m)
        out = acc / l[:, None]
        tl.store(o_ptr + qrow[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=valid_row[:, None] & dmask[None, :])


def _tiles(q_seq: torch.Tensor, group: int, tile: int = TILE_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split query rows into tiles of consecutive rows of one sequence, ``tile // group`` tokens each.

    Returns (sequence, first row, row count) per tile, int32. Rows of one sequence must be consecutive.
    """
    per_tile = tile // group
    seqs, counts = torch.unique_consecutive(q_seq.long(), return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    n_tiles = (counts + per_tile - 1) // per_tile
    tile_seq = seqs.repeat_interleave(n_tiles)
    first_tile = torch.cumsum(n_tiles, 0) - n_tiles
    index_in_run = torch.arange(int(n_tiles.sum())) - first_tile.repeat_interleave(n_tiles)
    tile_row = starts.repeat_interleave(n_tiles) + index_in_run * per_tile
    tile_n = torch.minimum(torch.full_like(tile_row, per_tile), counts.repeat_interleave(n_tiles) - index_in_run * per_tile)
    return tile_seq.int(), tile_row.int(), tile_n.int()


# Launch configuration (rows per tile, warps, stages). The rows of a tile only decide which queries a
# program handles; the key-block size BLOCK_N is the algorithm and never changes.
TILE_CONFIG = (TILE_ROWS, 4, 2)


def _triton_paged(q, k_cache, v_cache, block_table, q_positions, q_seq, scale, config=None, direct=False):
    """``direct``: every sequence's pages are consecutive in the cache, starting at block_table[s, 0]."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    group = h // kvh
    tile, warps, stages = config or TILE_CONFIG
    if tile % group:
        raise ValueError(f"strict attention needs {tile} divisible by the GQA group size {group}")
    q = q.contiguous()
    out = torch.empty_like(q)
    tile_seq, tile_row, tile_n = (x.to(q.device) for x in _tiles(q_seq.cpu(), group, tile))
    _paged_attention_kernel[(tile_seq.shape[0], kvh)](
        q, k_cache, v_cache, out, q_positions.to(torch.int32).contiguous(), block_table.to(torch.int32).contiguous(),
        tile_seq, tile_row, tile_n, float(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0) if block_table.dim() == 2 else 0,
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), TILE=tile,
        BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, CONTIG=k_cache.shape[1] % BLOCK_N == 0, DIRECT=direct,
        num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out


def _use_triton(x):
    from alignaudit_kernels.matmul import _interpreting

    return x.is_cuda or _interpreting()


def paged_attention(q, k_cache, v_cache, block_table, q_positions, q_seq, scale):
    """Strict attention over a paged KV cache (inference engines; prefill and decode alike).

    Args:
        q: [T, H, D] query rows of any number of sequences (bf16/fp16/fp32).
        k_cache, v_cache: [num_blocks, block_size, KVH, D]; keys of sequence i at positions 0..p are in
            blocks block_table[i, 0], block_table[i, 1], ... (already written, the current token included).
        block_table: [num_sequences, max_blocks] int. q_positions: [T] absolute position of each row.
        q_seq: [T] sequence index of each row (rows of one sequence consecutive). scale: float.
    Returns: [T, H, D] in q.dtype.
    """
    if _use_triton(q):
        return _triton_paged(q, k_cache, v_cache, block_table, q_positions, q_seq, scale)
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    for seq in torch.unique_consecutive(q_seq).tolist():
        rows = (q_seq == seq).nonzero()[:, 0]
        n_keys = int(q_positions[rows].max()) + 1
        pages = block_table[seq, : (n_keys + bs - 1) // bs].long()
        k = k_cache[pages].flatten(0, 1)[:n_keys]
        v = v_cache[pages].flatten(0, 1)[:n_keys]
        out[rows] = _cpu_attend(q[rows], k, v, q_positions[rows], scale)
    return out


def causal_attention(q, k, v, q_positions, scale):
    """Strict attention for one sequence with contiguous K/V (e.g. a training engine's KV cache).

    q [Tq, H, D] at absolute positions ``q_positions`` [Tq] (int); k/v [Tk, KVH, D] hold positions
    0..Tk-1. Returns [Tq, H, D] in q.dtype, equal bit for bit to the same rows of a prefill.
    Forward only (decode does not need gradients).
    """
    if not _use_triton(q):
        return _cpu_attend(q, k, v, q_positions.cpu(), scale)
    pages = (k.shape[0] + BLOCK_N - 1) // BLOCK_N
    pad = pages * BLOCK_N - k.shape[0]
    kc = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(pages, BLOCK_N, *k.shape[1:])
    vc = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(pages, BLOCK_N, *v.shape[1:])
    table = torch.arange(pages, device=q.device, dtype=torch.int32)[None]
    return _triton_paged(q, kc, vc, table, q_positions, torch.zeros(q.shape[0], dtype=torch.long), scale, direct=True)


def _contiguous_forward(q, k, v, cu_seqlens, scale):
    """Ragged batch of whole sequences (prefill from position 0), K/V contiguous [T, KVH, D]."""
    bounds = cu_seqlens.tolist()
    if not _use_triton(q):
        out = torch.empty_like(q)
        for a, b in zip(bounds[:-1], bounds[1:]):
            out[a:b] = _cpu_attend(q[a:b], k[a:b], v[a:b], torch.arange(b - a), scale)
        return out
    # The GPU kernel reads K/V through a block table: lay each sequence out in pages of BLOCK_N tokens.
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    pages = [(n + BLOCK_N - 1) // BLOCK_N for n in lengths]
    kvh, d = k.shape[1], k.shape[2]
    k_cache = k.new_zeros(sum(pages), BLOCK_N, kvh, d)
    v_cache = v.new_zeros(sum(pages), BLOCK_N, kvh, d)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    first = 0
    for i, (a, n, p) in enumerate(zip(bounds[:-1], lengths, pages)):
        k_cache[first: first + p].flatten(0, 1)[:n] = k[a: a + n]
        v_cache[first: first + p].flatten(0, 1)[:n] = v[a: a + n]
        table[i, :p] = torch.arange(first, first + p)
        first += p
    positions = torch.cat([torch.arange(n) for n in lengths]).to(q.device)
    seq_of_row = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return _triton_paged(q, k_cache, v_cache, table.to(q.device), positions, seq_of_row, scale, direct=True)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        return _contiguous_forward(q, k, v, cu_seqlens, scale)

    @staticmethod
    def backward(ctx, g):
        q, k, v, cu_seqlens = ctx.saved_tensors
        grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            with torch.enable_grad():
                qs, ks, vs = (t[a:b].detach().float().requires_grad_() for t in (q, k, v))
                out = reference(qs, ks, vs, ctx.scale)
                gq, gk, gv = torch.autograd.grad(out, (qs, ks, vs), g[a:b].float())
            grads[0][a:b], grads[1][a:b], grads[2][a:b] = gq, gk, gv
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), None, None


def varlen_attention(q, k, v, cu_seqlens, scale):
    """Strict causal attention for a ragged batch of whole sequences (training engines, prefill).

    q [T, H, D], k/v [T, KVH, D], cu_seqlens [B + 1] (int, sequence i is rows cu[i]:cu[i+1], positions
    0..len-1). Returns [T, H, D] in q.dtype; differentiable (backward through the reference).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]}")
    return _VarlenAttention.apply(q, k, v, cu_seqlens.cpu(), float(scale))
