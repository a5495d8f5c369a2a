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
    keys are grouped in chunks of CHUNK_N = 512 positions (8 blocks); each chunk's blocks run the steps
    above from a fresh state (m = -inf, l = 0, acc = 0), and the chunk states are folded in left to right:
                 M = max(M, m_c);  a = exp(M_old - M);  b = exp(m_c - M)
                 L = L * a + l_c * b;  A = A * a + acc_c * b  (a chunk with no key <= p is skipped)
    out = A / L                                               rounding point: once, fp32 -> dtype
Query head h reads KV head h // (num_heads / num_kv_heads) (GQA). The chunks are what lets a decode step
split its keys over many programs (split-KV, one program per chunk and a second launch that folds the
states in the same order) and still give the bits of a prefill, which folds them in registers.

exp: "portable" (the default) is kernels/primitives.exp, the same bits on the CPU and on every GPU backend;
"native" is the GPU's exp2 instruction (tl.exp: MUFU.EX2 after a multiply by log2(e) on NVIDIA), 1.4-1.8x
faster prefill on an H200 (docs/benchmarks.md) and the same bits wherever one GPU architecture runs every
engine, but not the CPU backend's bits (it refuses "native").

Reductions: the dot products over head_dim and the sums over the keys of a block. CPU: products in fp32,
kernels/primitives.fixed_sum (blocks of 32, pairwise tree, blocks left to right). GPU (Triton): tl.dot
on tensor cores (fp32 inputs use IEEE products, not TF32), row sums by tl.sum; one kernel for prefill and
decode, reading K/V through a block table, with a tile of 64 query rows (floor(64 / group) tokens x the
group's heads; rows past that masked, so any group size up to 64 works), so a row's arithmetic does not
depend on how many tokens share its tile. A decode tile holds one token: its heads sit 64 / USED rows apart
(USED: the group size rounded up to a power of two) and only their scores are exponentiated (``_rows``);
P's row sums and P.V still run over the whole tile, so the bits are a prefill's. The key blocks that every
row of a tile sees whole are visited without masks, the others with them: the same steps with every mask true,
so a row gets the same bits whichever loop visits a block (tests/kernels/ checks prefill against
decode on the GPU). Contiguous K/V (training engines) are read in place as one-token pages.

Layouts: q [tokens, heads, head_dim]; K/V either contiguous per sequence [tokens, kv_heads, head_dim]
(training engines) or a paged cache [num_blocks, block_size, kv_heads, head_dim] with a block table
[sequences, max_blocks] (vLLM). Backward: through the plain-torch reference, in fp32.
"""

from __future__ import annotations

import torch

from alignaudit_kernels.primitives import (
    cached_tensors,
    cdiv,
    compiling_inference,
    exp,
    fixed_sum,
    no_gradient,
    opaque_op,
    rocm,
    sm_count,
    triton,
    use_triton,
)

BLOCK_N = 64
CHUNK_N = 512
TILE_ROWS = 64
CPU_CHUNK_ELEMENTS = 1 << 24
EXP_CHOICES = ("portable", "native")
DEFAULT_EXP = "portable"


def reference(q, k, v, scale, q_positions=None):
    """Plain torch causal attention for one sequence (float64 inputs for an accuracy reference): q [Tq, H, D],
    k/v [Tk, KVH, D] at key positions 0..Tk-1, queries at ``q_positions`` [Tq] (default: the last Tq)."""
    tq, tk = q.shape[0], k.shape[0]
    pos = torch.arange(tk - tq, tk, device=q.device) if q_positions is None else q_positions
    return batched_reference(q[None], k[None], v[None], scale, pos[None])[0]


def batched_reference(q, k, v, scale, q_positions):
    """``reference`` for B sequences at once: q [B, Tq, H, D], k/v [B, Tk, KVH, D], q_positions [B, Tq]
    -> [B, Tq, H, D] in q's dtype (its fp32 scores take B * H * Tq * Tk elements)."""
    h, kvh = q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(h // kvh, 2), v.repeat_interleave(h // kvh, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    keys = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(keys[None, None, None, :] > q_positions[:, None, :, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)


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
    m, l, acc = _cpu_chunk(qf, k, v, pos, scale, 0)
    for c0 in range(CHUNK_N, int(pos.max()) + 1, CHUNK_N):
        m, l, acc = _cpu_merge((m, l, acc), _cpu_chunk(qf, k, v, pos, scale, c0), (c0 <= pos)[:, None, None])
    return acc / l[..., None]


def _cpu_chunk(qf, k, v, pos, scale, c0):
    """The softmax state of rows qf [n, KVH, group, D] over keys c0 .. c0 + CHUNK_N - 1, from a fresh state."""
    n, kvh, group, d = qf.shape
    m = torch.full((n, kvh, group), float("-inf"))
    l = torch.zeros(n, kvh, group)
    acc = torch.zeros(n, kvh, group, d)
    for j0 in range(c0, min(c0 + CHUNK_N, int(pos.max()) + 1), BLOCK_N):
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
    return m, l, acc


def _cpu_merge(state, chunk, active):
    """Fold a later chunk's (m, l, acc) into the running state where ``active`` [n, 1, 1]."""
    (m, l, acc), (m_c, l_c, acc_c) = state, chunk
    m_new = torch.maximum(m, m_c)
    a, b = exp(m - m_new), exp(m_c - m_new)
    return (torch.where(active, m_new, m), torch.where(active, l * a + l_c * b, l),
            torch.where(active[..., None], acc * a[..., None] + acc_c * b[..., None], acc))


def _block(x, j0):
    blk = x[j0: j0 + BLOCK_N].float()
    if blk.shape[0] < BLOCK_N:
        blk = torch.nn.functional.pad(blk, (0, 0, 0, 0, 0, BLOCK_N - blk.shape[0]))
    return blk


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import exp_t

    @triton.jit
    def _kv_block(k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, j0, last, d, dmask,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV: tl.constexpr, MASKED: tl.constexpr):
        """Keys j0 .. j0 + BLOCK_N - 1 of one sequence and KV head: K and V [BLOCK_N, BLOCK_D]."""
        key = j0 + tl.arange(0, BLOCK_N)
        if KV == 2:  # the sequence's pages are consecutive from its first page: affine addresses
            page = first_page + (key // BLOCK_SIZE).to(tl.int64)
            slot = (key % BLOCK_SIZE).to(tl.int64)
        elif KV == 1:  # pages hold whole key blocks: one page lookup, contiguous rows
            page = tl.load(bt_ptr + seq * stride_bt + j0 // BLOCK_SIZE).to(tl.int64)
            slot = (j0 % BLOCK_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        else:
            page = tl.load(bt_ptr + seq * stride_bt + key // BLOCK_SIZE, mask=key <= last, other=0).to(tl.int64)
            slot = (key % BLOCK_SIZE).to(tl.int64)
        k_off = page[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        v_off = page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :]
        if MASKED:
            kmask = (key <= last)[:, None] & dmask[None, :]
            return tl.load(k_ptr + k_off, mask=kmask, other=0.0), tl.load(v_ptr + v_off, mask=kmask, other=0.0)
        return (tl.load(k_ptr + k_off, mask=dmask[None, :], other=0.0),
                tl.load(v_ptr + v_off, mask=dmask[None, :], other=0.0))

    @triton.jit
    def _exp(x, NATIVE_EXP: tl.constexpr):
        if NATIVE_EXP:  # the GPU's exp2 instruction (MUFU.EX2 on NVIDIA): bits fixed per architecture
            return tl.exp(x)
        return exp_t(x)

    @triton.jit
    def _scores(q, kb, scale, IEEE: tl.constexpr):
        if IEEE:
            s = tl.dot(q, tl.trans(kb), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kb))
        return s * scale

    @triton.jit
    def _weighted_values(p, vb, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(p, vb, input_precision="ieee")
        return tl.dot(p.to(vb.dtype), vb)

    # A decode tile holds one token: its GROUP query heads at rows 0, TILE // USED, 2 * TILE // USED, ... (one
    # per warp for GROUP = 4 at 4 warps: in the wgmma accumulator's layout the rows between them live in the
    # same warp, so the sums below reduce across lanes of one warp, not across warps).
    @triton.jit
    def _rows(x, TILE: tl.constexpr, USED: tl.constexpr):
        """Rows 0, TILE // USED, 2 * TILE // USED, ... of x [TILE, N] as [USED, N]: a sum with zeros, so every
        value is kept exactly (NaN and infinities included; -0.0 becomes +0.0, which no later step tells
        apart: it only enters differences and maxima)."""
        x3 = tl.reshape(x, [USED, TILE // USED, x.shape[1]])
        first = tl.arange(0, TILE // USED)[None, :, None] == 0
        return tl.sum(tl.where(first, x3, tl.zeros_like(x3)), axis=1)

    @triton.jit
    def _entries(x, TILE: tl.constexpr, USED: tl.constexpr):
        """Entries 0, TILE // USED, ... of x [TILE] as [USED], exactly (as _rows)."""
        x2 = tl.reshape(x, [USED, TILE // USED])
        return tl.sum(tl.where(tl.arange(0, TILE // USED)[None, :] == 0, x2, tl.zeros_like(x2)), axis=1)

    @triton.jit
    def _spread_rows(x, TILE: tl.constexpr, USED: tl.constexpr):
        """x [USED, N] -> [TILE, N], row r holding row r // (TILE // USED)."""
        return tl.reshape(tl.broadcast_to(x[:, None, :], [USED, TILE // USED, x.shape[1]]), [TILE, x.shape[1]])

    @triton.jit
    def _spread_entries(x, TILE: tl.constexpr, USED: tl.constexpr):
        """x [USED] -> [TILE], entry r holding entry r // (TILE // USED)."""
        return tl.reshape(tl.broadcast_to(x[:, None], [USED, TILE // USED]), [TILE])

    @triton.jit
    def _block_step(q, kb, vb, m, l, acc, pos, row_pos, j0, scale, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                    NATIVE_EXP: tl.constexpr, MASKED: tl.constexpr, TILE: tl.constexpr, USED: tl.constexpr):
        """One key block of the online softmax. MASKED: keys past a row's position count as -inf and a
        row with no key in the block keeps its state; unmasked: the same steps with every mask true.
        USED < TILE (decode: only the USED rows that _rows takes can hold a query): m and l hold those rows
        only, and only their scores are exponentiated; the scores, the row sums of P and the product with V
        are computed over the whole tile, as a prefill tile computes them, so every row gets a prefill's
        bits. pos [TILE], row_pos: pos of the USED rows; acc [TILE, BLOCK_D]."""
        s = _scores(q, kb, scale, IEEE)
        if USED < TILE:
            s = _rows(s, TILE, USED)
        if MASKED:
            key = j0 + tl.arange(0, BLOCK_N)
            s = tl.where(key[None, :] <= row_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = _exp(m - m_new, NATIVE_EXP)
        p = _exp(s - m_new[:, None], NATIVE_EXP)
        if USED < TILE:
            p = _spread_rows(p, TILE, USED)
            p_sum = _entries(tl.sum(p, axis=1), TILE, USED)
            acc_alpha = _spread_entries(alpha, TILE, USED)
        else:
            p_sum = tl.sum(p, axis=1)
            acc_alpha = alpha
        l_new = l * alpha + p_sum
        acc_new = acc * acc_alpha[:, None] + _weighted_values(p, vb, IEEE)
        if MASKED:
            l = tl.where(j0 <= row_pos, l_new, l)
            acc = tl.where((j0 <= pos)[:, None], acc_new, acc)
            m = tl.where(j0 <= row_pos, m_new, m)
        else:
            l = l_new
            acc = acc_new
            m = m_new
        return m, l, acc

    @triton.jit
    def _chunk(q, pos, first, last, c0, k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, d, dmask, scale,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
               BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               CHUNK_N: tl.constexpr, IEEE: tl.constexpr, KV: tl.constexpr, NATIVE_EXP: tl.constexpr,
               USED: tl.constexpr):
        """The softmax state (m, l, acc) of the tile's rows over keys c0 .. c0 + CHUNK_N - 1, from a fresh
        state. Key blocks that every row sees whole are visited without masks (same bits, see above).
        USED < TILE: see _block_step; m and l come back spread over the tile (rows past USED: copies)."""
        m = tl.full((USED,), float("-inf"), tl.float32)
        l = tl.zeros((USED,), tl.float32)
        if USED < TILE:
            row_pos = _entries(pos, TILE, USED)
        else:
            row_pos = pos
        acc = tl.zeros((TILE, BLOCK_D), tl.float32)
        end = tl.minimum(c0 + CHUNK_N, last + 1)
        whole = tl.minimum(tl.maximum((first + 1) // BLOCK_N * BLOCK_N, c0), end)
        for j0 in range(c0, whole, BLOCK_N):
            kb, vb = _kv_block(k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, j0, last, d, dmask, stride_kb, stride_ks,
                               stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, BLOCK_SIZE, BLOCK_N, KV, False)
            m, l, acc = _block_step(q, kb, vb, m, l, acc, pos, row_pos, j0, scale, BLOCK_N, IEEE, NATIVE_EXP, False,
                                    TILE, USED)
        for j0 in range(whole, end, BLOCK_N):
            kb, vb = _kv_block(k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, j0, last, d, dmask, stride_kb, stride_ks,
                               stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, BLOCK_SIZE, BLOCK_N, KV, True)
            m, l, acc = _block_step(q, kb, vb, m, l, acc, pos, row_pos, j0, scale, BLOCK_N, IEEE, NATIVE_EXP, True,
                                    TILE, USED)
        if USED < TILE:
            m_tile = _spread_entries(m, TILE, USED)
            l_tile = _spread_entries(l, TILE, USED)
        else:
            m_tile = m
            l_tile = l
        return m_tile, l_tile, acc

    @triton.jit
    def _merge(m, l, acc, m_c, l_c, acc_c, active, NATIVE_EXP: tl.constexpr):
        """Fold a later chunk's state into the running one (rows where ``active``; the others keep theirs)."""
        m_new = tl.maximum(m, m_c)
        a = _exp(m - m_new, NATIVE_EXP)
        b = _exp(m_c - m_new, NATIVE_EXP)
        l_new = l * a + l_c * b
        acc_new = acc * a[:, None] + acc_c * b[:, None]
        return tl.where(active, m_new, m), tl.where(active, l_new, l), tl.where(active[:, None], acc_new, acc)

    @triton.jit
    def _tile_rows(pos_ptr, tiles_ptr, n_tiles, tile, max_keys, TILE: tl.constexpr, GROUP: tl.constexpr,
                   ROW_POS: tl.constexpr, DECODE: tl.constexpr, USED: tl.constexpr):
        """The tile's sequence, and per row: query token row, query head within the KV head's group, validity,
        position (-1 past the tile) and overflow: a position at or past ``max_keys``, clamped to max_keys - 1
        so no key past the bound is read (the caller stores NaN for those rows). DECODE: pos_ptr holds each
        sequence's key count, and the token's heads sit every TILE // USED rows (see _rows)."""
        r = tl.arange(0, TILE)
        if DECODE:  # one query token per sequence: tile i is row i of sequence i
            tok = r % (TILE // USED)
            group_head = r // (TILE // USED)
            seq = tile.to(tl.int64)
            valid_row = (tok < 1) & (group_head < GROUP)
            qrow = seq + tok
        else:
            tok = r // GROUP
            group_head = r % GROUP
            seq = tl.load(tiles_ptr + tile).to(tl.int64)
            valid_row = tok < tl.load(tiles_ptr + 2 * n_tiles + tile)
            qrow = tl.load(tiles_ptr + n_tiles + tile).to(tl.int64) + tok
        if ROW_POS:  # rows of a whole-sequence prefill: position = first position of the tile + token index
            pos = tl.where(valid_row, tl.load(tiles_ptr + 3 * n_tiles + tile) + tok, -1)
        elif DECODE:  # the query is the sequence's last key
            pos = tl.load(pos_ptr + qrow, mask=valid_row, other=0) - 1
        else:
            pos = tl.load(pos_ptr + qrow, mask=valid_row, other=-1)
        overflow = pos >= max_keys
        return seq, qrow, group_head, valid_row, tl.where(overflow, max_keys - 1, pos), overflow

    @triton.jit
    def _store_output(o_ptr, acc, l, overflow, qrow, head, d, valid_row, stride_ot, stride_oh,
                      HEAD_DIM: tl.constexpr):
        """The end of every path (unsplit kernel and split merge alike): acc / l in fp32, rounded once to the
        output dtype; NaN for a row past the key bound (``overflow``)."""
        l = tl.where(overflow, float("nan"), l)
        tl.store(o_ptr + qrow[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=valid_row[:, None] & (d < HEAD_DIM)[None, :])

    @triton.jit(do_not_specialize=["n_tiles", "max_keys"])  # per-step counts: one build for every value
    def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, bt_ptr, tiles_ptr, m_ptr, l_ptr, acc_ptr, n_tiles,
                          max_keys, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                          BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr,
                          IEEE: tl.constexpr, KV: tl.constexpr, ROW_POS: tl.constexpr, DECODE: tl.constexpr,
                          SPLIT: tl.constexpr, NATIVE_EXP: tl.constexpr, USED: tl.constexpr):
        # The last tile first: in a causal prefill it visits the most key blocks (load balance only).
        tile = n_tiles - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        seq, qrow, group_head, valid_row, pos, overflow = _tile_rows(pos_ptr, tiles_ptr, n_tiles, tile, max_keys,
                                                                     TILE, GROUP, ROW_POS, DECODE, USED)
        r = tl.arange(0, TILE)
        head = kvh * GROUP + group_head
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=valid_row[:, None] & dmask[None, :], other=0.0)
        last = tl.max(pos, axis=0)
        first = tl.min(tl.where(valid_row, pos, last), axis=0)
        first_page = tl.load(bt_ptr + seq * stride_bt).to(tl.int64)
        if SPLIT:  # this program: one chunk, its state to the scratch buffers for _combine_kernel
            c = tl.program_id(2)
            m, l, acc = _chunk(q, pos, first, last, c * CHUNK_N, k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, d, dmask,
                               scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                               BLOCK_SIZE, TILE, BLOCK_D, BLOCK_N, CHUNK_N, IEEE, KV, NATIVE_EXP, USED)
            slot = ((c.to(tl.int64) * n_tiles + tile) * tl.num_programs(1) + kvh) * TILE + r
            keep = valid_row & (c * CHUNK_N <= pos)
            tl.store(m_ptr + slot, m, mask=keep)
            tl.store(l_ptr + slot, l, mask=keep)
            tl.store(acc_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=keep[:, None])
        else:
            m, l, acc = _chunk(q, pos, first, last, 0, k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, d, dmask,
                               scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                               BLOCK_SIZE, TILE, BLOCK_D, BLOCK_N, CHUNK_N, IEEE, KV, NATIVE_EXP, USED)
            for c0 in range(CHUNK_N, last + 1, CHUNK_N):
                m_c, l_c, acc_c = _chunk(q, pos, first, last, c0, k_ptr, v_ptr, bt_ptr, seq, first_page, kvh, d,
                                         dmask, scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                         stride_vh, stride_bt, BLOCK_SIZE, TILE, BLOCK_D, BLOCK_N, CHUNK_N, IEEE, KV,
                                         NATIVE_EXP, USED)
                m, l, acc = _merge(m, l, acc, m_c, l_c, acc_c, c0 <= pos, NATIVE_EXP)
            _store_output(o_ptr, acc, l, overflow, qrow, head, d, valid_row, stride_ot, stride_oh, HEAD_DIM)

    @triton.jit(do_not_specialize=["n_tiles", "max_keys", "n_chunks"])
    def _combine_kernel(o_ptr, pos_ptr, tiles_ptr, m_ptr, l_ptr, acc_ptr, n_tiles, max_keys, n_chunks, stride_ot,
                        stride_oh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                        CHUNK_N: tl.constexpr, ROW_POS: tl.constexpr, DECODE: tl.constexpr,
                        NATIVE_EXP: tl.constexpr, USED: tl.constexpr):
        """The split path's second launch: the chunk states of each row merged left to right, as the
        unsplit kernel merges them in registers."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq, qrow, group_head, valid_row, pos, overflow = _tile_rows(pos_ptr, tiles_ptr, n_tiles, tile, max_keys,
                                                                     TILE, GROUP, ROW_POS, DECODE, USED)
        r = tl.arange(0, TILE)
        head = kvh * GROUP + group_head
        d = tl.arange(0, BLOCK_D)
        slot = (tile.to(tl.int64) * tl.num_programs(1) + kvh) * TILE + r
        chunk_stride = tl.num_programs(1).to(tl.int64) * n_tiles * TILE
        stored = valid_row & (pos >= 0)  # a row with no key (a decode slot of length 0) stored no state
        m = tl.load(m_ptr + slot, mask=stored, other=float("-inf"))
        l = tl.load(l_ptr + slot, mask=stored, other=0.0)
        acc = tl.load(acc_ptr + slot[:, None] * BLOCK_D + d[None, :], mask=stored[:, None], other=0.0)
        for c in range(1, tl.minimum(tl.max(pos, axis=0) // CHUNK_N + 1, n_chunks)):  # never past the scratch
            active = valid_row & (c * CHUNK_N <= pos)
            at = c * chunk_stride + slot
            m_c = tl.load(m_ptr + at, mask=active, other=float("-inf"))
            l_c = tl.load(l_ptr + at, mask=active, other=0.0)
            acc_c = tl.load(acc_ptr + at[:, None] * BLOCK_D + d[None, :], mask=active[:, None], other=0.0)
            m, l, acc = _merge(m, l, acc, m_c, l_c, acc_c, active, NATIVE_EXP)
        _store_output(o_ptr, acc, l, overflow, qrow, head, d, valid_row, stride_ot, stride_oh, HEAD_DIM)


def _tiles(seqs: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, per_tile: int) -> torch.Tensor:
    """Split runs of consecutive query rows (one run per sequence) into tiles of ``per_tile`` tokens.

    seqs/starts/counts [runs] (CPU int): sequence index, first row and row count of each run.
    Returns int32 [4, tiles] (CPU): sequence, first row, row count, and index of the first row within its run.
    """
    n_tiles = (counts + per_tile - 1) // per_tile
    first_tile = torch.cumsum(n_tiles, 0) - n_tiles
    offset = (torch.arange(int(n_tiles.sum())) - first_tile.repeat_interleave(n_tiles)) * per_tile
    rows = torch.minimum(torch.full_like(offset, per_tile), counts.repeat_interleave(n_tiles) - offset)
    return torch.stack([seqs.repeat_interleave(n_tiles), starts.repeat_interleave(n_tiles) + offset, rows,
                        offset]).int()


# Launch configurations (query rows per tile, warps, stages). The rows of a tile only decide which queries
# a program handles; the key block BLOCK_N and the key chunk CHUNK_N are the algorithm and never change.
# Every path uses 64-row tiles: on an H200 a 16-row tile (mma.sync rather than wgmma) gave decode rows 1-2
# ULP away from the same rows of a 64-row prefill tile (bf16 and fp32, 2026-11-30).
TILE_CONFIG = (TILE_ROWS, 4, 2)
# Decode steps pipeline one more key block: 3% faster at the generation shape of bench/vllm_generate.py (64
# sequences at 640 keys, pages of 16) on an H200, with the bits of every other configuration swept there
# (stages only schedule loads; docs/benchmarks.md 2026-12-04 third session).
DECODE_CONFIG = (TILE_ROWS, 4, 3)
SPLIT_BELOW_PROGRAMS_PER_SM = 32  # fewer (tile, KV head) programs than this per SM: one program per chunk
KV_GATHER, KV_PAGE_ALIGNED, KV_DIRECT = 0, 1, 2


def _check_exp(exp: str, q: torch.Tensor) -> None:
    if exp not in EXP_CHOICES:
        raise ValueError(f"exp must be one of {', '.join(EXP_CHOICES)}, not {exp!r}")
    if exp == "native" and not use_triton(q):
        raise ValueError("exp='native' is a GPU instruction; the CPU backend computes the portable exp only")


def _launch(q, k_cache, v_cache, block_table, tiles, q_positions, scale, *, kv_mode, max_keys, config=TILE_CONFIG,
            row_pos=False, split=None, block_n=BLOCK_N, chunk_n=CHUNK_N, exp=DEFAULT_EXP, out=None):
    """Run the Triton kernel(s).

    tiles: from ``_tiles`` (CPU, or already on q's device from a cached plan), or None for a decode step (row
    i is the one query of sequence i, and q_positions holds each sequence's key count: its seq_lens);
    q_positions: [T] on q's device, or None with ``row_pos`` (rows are whole sequences from position 0).
    max_keys: a bound on the keys any row sees (host int, sets the chunk count of the split grid); a row
    past it is NaN, and no key past it is read.
    out: [T, H, D] of q's dtype with unit stride along D to write into (vLLM's output buffer), or None.
    split: one program per (tile, KV head, chunk) and a second launch that merges the chunks (True), one
    program per (tile, KV head) merging in registers (False), or chosen by occupancy (None): the same bits
    either way. ``block_n`` / ``chunk_n`` other than BLOCK_N / CHUNK_N: benchmarks only (another algorithm).
    """
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    group = h // kvh
    tile, warps, stages = config
    if rocm() and q.dtype == torch.float32:
        stages = 1  # fp32 at head dim 128, 4 warps, 2 stages aborts LLVM's AMDGPU register allocator (triton 3.8)
    if group > tile:  # a tile holds tile // group tokens; the rows past tokens * group stay masked
        raise ValueError(f"strict attention holds at most {tile} query heads per KV head, not {group}")
    q = q.contiguous()
    out = _check_out(q, out)
    positions = None if q_positions is None else q_positions.to(torch.int32).contiguous()
    decode = tiles is None
    if decode:
        n_tiles, tiles = t, positions
    else:
        tiles = tiles.to(q.device, non_blocking=True).contiguous()
        n_tiles = tiles.shape[1]
    positions = tiles if positions is None else positions
    chunks = cdiv(max_keys, chunk_n)
    if split is None:
        split = chunks > 1 and n_tiles * kvh < SPLIT_BELOW_PROGRAMS_PER_SM * (sm_count(q.device) if q.is_cuda else 1)
    block_d = max(16, triton.next_power_of_2(d))
    shared = dict(GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, TILE=tile, CHUNK_N=chunk_n, ROW_POS=row_pos,
                  DECODE=decode, NATIVE_EXP=exp == "native", USED=_used_rows(decode, group, tile))
    if split:
        m = torch.empty(chunks, n_tiles, kvh, tile, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(chunks, n_tiles, kvh, tile, block_d, dtype=torch.float32, device=q.device)
    else:
        m = l = acc = out  # not read
    _attention_kernel[(n_tiles, kvh, chunks if split else 1)](
        q, k_cache, v_cache, out, positions, block_table, tiles, m, l, acc, n_tiles, max_keys, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        KV=kv_mode, SPLIT=split, **shared, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if split:
        _combine_kernel[(n_tiles, kvh)](out, positions, tiles, m, l, acc, n_tiles, max_keys, chunks, out.stride(0),
                                        out.stride(1), **shared, num_warps=4, enable_fp_fusion=False)
    return out


def _used_rows(decode: bool, group: int, tile: int) -> int:
    """Rows of a tile that can hold a query: a decode tile holds one token, its ``group`` heads (rounded up
    to a power of two); any other tile, all of them."""
    return min(tile, triton.next_power_of_2(group)) if decode else tile


def _check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless k_cache and v_cache are [blocks, block_size, KVH, D] alike, with q's head_dim D and a KVH
    that divides q's heads, and, on the Triton backends, unit stride along D (the kernel steps by one element
    there; blocks, slots and heads may have any strides)."""
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"strict attention: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
                         f"be [blocks, block_size, kv_heads, {q.shape[-1]}] alike, kv_heads dividing q's {q.shape[1]}")
    if use_triton(q) and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError(f"strict attention: k_cache and v_cache need unit stride along head_dim (strides "
                         f"{k_cache.stride()} and {v_cache.stride()}); lay the cache out with head_dim innermost")


def _kv_mode(k_cache: torch.Tensor) -> int:
    return KV_PAGE_ALIGNED if k_cache.shape[1] % BLOCK_N == 0 else KV_GATHER


def _triton_paged(q, k_cache, v_cache, block_table, q_positions, q_seq, scale, config=None, exp=DEFAULT_EXP,
                  max_keys=None, out=None):
    group = q.shape[1] // k_cache.shape[2]
    seqs, counts = torch.unique_consecutive(q_seq.cpu().long(), return_counts=True)
    config = config or TILE_CONFIG
    tiles = _tiles(seqs, torch.cumsum(counts, 0) - counts, counts, config[0] // group)
    table = block_table.to(device=q.device, dtype=torch.int32).contiguous()
    if max_keys is None:
        max_keys = int(q_positions.max()) + 1
    return _launch(q, k_cache, v_cache, table, tiles, q_positions.to(q.device), scale, kv_mode=_kv_mode(k_cache),
                   max_keys=max_keys, config=config, exp=exp, out=out)


# Launch plans of the contiguous layouts, kept on the device per shape: a training step or a forward at a
# fixed batch shape plans once, and later calls pay no host work or host-to-device copy for it.
@cached_tensors(maxsize=64)
def _varlen_plan(bounds: tuple[int, ...], per_tile: int, device: torch.device):
    """(tiles, block table, longest sequence) of a ragged prefill with cu_seqlens ``bounds``."""
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    tiles = _tiles(torch.arange(len(bounds) - 1), starts, lengths, per_tile).to(device)
    return tiles, starts.to(device=device, dtype=torch.int32)[:, None], int(lengths.max())


@cached_tensors(maxsize=64)
def _batch_plan(b: int, tq: int, tk: int, per_tile: int, device: torch.device):
    """(tiles, block table) of ``b`` sequences of ``tq`` query rows over ``tk`` contiguous keys each."""
    runs = torch.arange(b)
    tiles = _tiles(runs, runs * tq, torch.full((b,), tq), per_tile).to(device)
    return tiles, (torch.arange(b, device=device, dtype=torch.int32) * tk)[:, None]


def _as_pages(x):
    """[T, KVH, D] -> a paged view [T, 1, KVH, D] (one token per page) without copying."""
    return x.contiguous().unsqueeze(1)


def paged_attention(q, k_cache, v_cache, block_table, q_positions, q_seq, scale, exp=DEFAULT_EXP, max_keys=None,
                    out=None):
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
    Returns: ``out`` or a new [T, H, D] in q.dtype. Plans its tiles on the host from q_seq: not capturable in a
    CUDA graph; ``paged_decode`` is.
    Raises: ValueError for an unknown ``exp``, "native" on the CPU backend, an ``out`` that cannot hold the
    result, or caches that the kernel cannot read as given (``_check_caches``).
    """
    _check_exp(exp, q)
    _check_caches(q, k_cache, v_cache)
    if use_triton(q):
        return _triton_paged(q, k_cache, v_cache, block_table, q_positions, q_seq, scale, exp=exp, max_keys=max_keys,
                             out=out)
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


def _check_out(q, out):
    """``out`` if it can hold the result for q (same shape and dtype, unit stride along head_dim: what the
    Triton kernel writes through), else ValueError; a new tensor for None."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"strict attention: out {tuple(out.shape)} {out.dtype} stride {out.stride()} cannot hold "
                         f"q {tuple(q.shape)} {q.dtype} (same shape and dtype, unit stride along head_dim)")
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
            raise ValueError(f"paged_decode: a sequence of {int(seq_lens.max())} keys, longer than max_seq_len "
                             f"{max_seq_len}")
        return paged_attention(q, k_cache, v_cache, block_table, seq_lens - 1, torch.arange(q.shape[0]), scale,
                               out=out)  # checks the caches
    _check_caches(q, k_cache, v_cache)
    table = block_table.to(torch.int32)
    if table.stride(1) != 1:  # the kernel steps along a row by one entry (vLLM's tables: always so, no copy)
        table = table.contiguous()
    return _launch(q, k_cache, v_cache, table, None, seq_lens, scale, kv_mode=_kv_mode(k_cache),
                   max_keys=int(max_seq_len), exp=exp, out=out, config=DECODE_CONFIG)


def causal_attention(q, k, v, q_positions, scale, exp=DEFAULT_EXP):
    """Strict attention for a batch of sequences with contiguous K/V (e.g. a training engine's KV cache).

    q [B, Tq, H, D] (or [Tq, H, D] for one sequence) at absolute positions ``q_positions`` [B, Tq] (int;
    [Tq] for one sequence); k/v [B, Tk, KVH, D] hold positions 0..Tk-1 of each sequence. Returns q's shape
    in q.dtype, each row equal bit for bit to the same row of a prefill or a decode. Differentiable:
    backward through the plain-torch reference in fp32, as varlen_attention (an HF trainer's forward).
    exp: "portable" or "native" (module docstring).
    Raises: ValueError for an unknown ``exp`` or "native" on the CPU backend.
    """
    _check_exp(exp, q)
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
            grads = _reference_gradients(q[None], k[None], v[None], g[None], ctx.scale, positions.reshape(1, -1))
            return (*(t[0] for t in grads), None, None, None)
        return (*_reference_gradients(q, k, v, g, ctx.scale, positions.reshape(q.shape[:2])), None, None, None)


REFERENCE_GRAD_ELEMENTS = 1 << 27  # fp32 score elements per batched reference in the backward (512 MiB)


def _reference_gradients(q, k, v, g, scale, q_positions):
    """Gradients of q, k, v [B, T, heads, D] (g: q's shape) through ``batched_reference`` in fp32, rounded once to
    their dtypes; as many sequences at a time as keep the fp32 scores within REFERENCE_GRAD_ELEMENTS (it built
    one autograd graph per sequence and layer: about 900 a training step at the Qwen3-1.7B shape, 32 sequences x
    28 layers)."""
    per_sequence = q.shape[2] * q.shape[1] * k.shape[1]
    chunk = max(1, REFERENCE_GRAD_ELEMENTS // per_sequence)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    positions = q_positions.to(q.device)
    for start in range(0, q.shape[0], chunk):
        rows = slice(start, start + chunk)
        with torch.enable_grad():
            qs, ks, vs = (t[rows].detach().float().requires_grad_() for t in (q, k, v))
            out = batched_reference(qs, ks, vs, scale, positions[rows])
            for grad, part in zip(grads, torch.autograd.grad(out, (qs, ks, vs), g[rows].float()), strict=True):
                grad[rows] = part
    return grads


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
    out = _launch(q.reshape(b * tq, h, d), _as_pages(k.reshape(b * tk, kvh, d)), _as_pages(v.reshape(b * tk, kvh, d)),
                  table, tiles, q_positions.reshape(-1).to(q.device), scale, kv_mode=KV_DIRECT, max_keys=tk, exp=exp)
    return out.view(b, tq, h, d)


@opaque_op("causal_attention", "(Tensor q, Tensor k, Tensor v, Tensor q_positions, float scale, str exp) -> Tensor",
           lambda q, k, v, q_positions, scale, exp: q.new_empty(q.shape))
def _causal_attention_op(q, k, v, q_positions, scale, exp):
    return causal_attention(q, k, v, q_positions, scale, exp)


def _contiguous_forward(q, k, v, cu_seqlens, scale, exp=DEFAULT_EXP):
    """Ragged batch of whole sequences (prefill from position 0), K/V contiguous [T, KVH, D]."""
    bounds = cu_seqlens.tolist()
    if not use_triton(q):
        out = torch.empty_like(q)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            out[a:b] = _cpu_attend(q[a:b], k[a:b], v[a:b], torch.arange(b - a), scale)
        return out
    return _launch_varlen(q, k, v, cu_seqlens, scale, exp=exp)


def _launch_varlen(q, k, v, cu_seqlens, scale, config=TILE_CONFIG, block_n=BLOCK_N, chunk_n=CHUNK_N, exp=DEFAULT_EXP,
                   split=None):
    """GPU prefill of whole sequences. Each sequence's keys are consecutive rows of k/v: one-token pages,
    the first page at the sequence's start, so nothing is copied."""
    tiles, table, max_keys = _varlen_plan(tuple(cu_seqlens.tolist()), config[0] // (q.shape[1] // k.shape[1]), q.device)
    return _launch(q, _as_pages(k), _as_pages(v), table, tiles, None, scale, kv_mode=KV_DIRECT, row_pos=True,
                   max_keys=max_keys, config=config, block_n=block_n, chunk_n=chunk_n, exp=exp, split=split)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, exp):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        return _contiguous_forward(q, k, v, cu_seqlens, scale, exp)

    @staticmethod
    def backward(ctx, g):
        """Sequences of one length go through the reference together, gathered into [n, length, heads, D]."""
        q, k, v, cu_seqlens = ctx.saved_tensors
        bounds = cu_seqlens.tolist()
        starts: dict[int, list[int]] = {}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            starts.setdefault(b - a, []).append(a)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for length, firsts in starts.items():
            rows = (torch.tensor(firsts)[:, None] + torch.arange(length)[None, :]).to(q.device)  # [n, length]
            positions = torch.arange(length, device=q.device).expand(len(firsts), length)
            parts = _reference_gradients(q[rows], k[rows], v[rows], g[rows], ctx.scale, positions)
            for grad, part in zip(grads, parts, strict=True):
                grad[rows] = part
        return (*grads, None, None, None)


def varlen_attention(q, k, v, cu_seqlens, scale, exp=DEFAULT_EXP):
    """Strict causal attention for a ragged batch of whole sequences (training engines, prefill).

    q [T, H, D], k/v [T, KVH, D], cu_seqlens [B + 1] (int, sequence i is rows cu[i]:cu[i+1], positions
    0..len-1). Returns [T, H, D] in q.dtype; differentiable (backward through the reference).
    exp: "portable" or "native" (module docstring).
    Raises: ValueError when H is not a multiple of KVH, for an unknown ``exp``, or "native" on the CPU backend.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]}")
    _check_exp(exp, q)
    if no_gradient(q, k, v):
        return _contiguous_forward(q, k, v, cu_seqlens.cpu(), float(scale), exp)
    return _VarlenAttention.apply(q, k, v, cu_seqlens.cpu(), float(scale), exp)

