"""The Triton device functions of strict attention's algorithm (the package docstring), step by step: a key block's
K and V, one key block of the online softmax, a chunk of blocks from a fresh state, and the fold of a later chunk's
state into the running one. alignaudit_kernels.attention.triton_kernels builds its kernels from them. Defined only
where Triton imports."""

from __future__ import annotations

from alignaudit_kernels.primitives import (
    triton,
)

if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.primitives import exp_t_up_to_overflow

    @triton.jit
    def _kv_block(
        k_ptr,
        v_ptr,
        bt_ptr,
        seq,
        first_page,
        kvh,
        j0,
        last,
        d,
        dmask,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KV: tl.constexpr,
        MASKED: tl.constexpr,
    ):
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
        return (
            tl.load(k_ptr + k_off, mask=dmask[None, :], other=0.0),
            tl.load(v_ptr + v_off, mask=dmask[None, :], other=0.0),
        )

    @triton.jit
    def _exp(x, NATIVE_EXP: tl.constexpr):
        """exp of a difference from a running maximum (<= 0 or NaN), so the portable exp's overflow check is left
        out (primitives.exp_t_up_to_overflow: the same bits there)."""
        if NATIVE_EXP:  # the GPU's exp2 instruction (MUFU.EX2 on NVIDIA): bits fixed per architecture
            return tl.exp(x)
        return exp_t_up_to_overflow(x)

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
    def _block_step(
        q,
        kb,
        vb,
        m,
        l,
        acc,
        pos,
        row_pos,
        j0,
        scale,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        NATIVE_EXP: tl.constexpr,
        MASKED: tl.constexpr,
        TILE: tl.constexpr,
        USED: tl.constexpr,
    ):
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
    def _chunk(
        q,
        pos,
        first,
        last,
        c0,
        k_ptr,
        v_ptr,
        bt_ptr,
        seq,
        first_page,
        kvh,
        d,
        dmask,
        scale,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        k_desc,
        v_desc,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK_N: tl.constexpr,
        IEEE: tl.constexpr,
        KV: tl.constexpr,
        NATIVE_EXP: tl.constexpr,
        USED: tl.constexpr,
        TMA: tl.constexpr,
        WS: tl.constexpr,
    ):
        """The softmax state (m, l, acc) of the tile's rows over keys c0 .. c0 + CHUNK_N - 1, from a fresh
        state. Key blocks that every row sees whole are visited without masks (same bits, see above).
        USED < TILE: see _block_step; m and l come back spread over the tile (rows past USED: copies).
        TMA (KV_DIRECT only): the whole blocks' K and V come through the tensor descriptors k_desc / v_desc
        ([rows, KV heads x HEAD_DIM], blocks [BLOCK_N, BLOCK_D]): the same values as the pointer loads, as
        every key of a whole block belongs to the tile's sequence; WS: that loop warp-specialized (the
        compiler's partition into a loading and computing warps; scheduling only). The masked blocks keep
        pointer loads, which give zeros past the sequence (a descriptor would read the next sequence's rows,
        and an infinity there times a zero weight would be NaN)."""
        m = tl.full((USED,), float("-inf"), tl.float32)
        l = tl.zeros((USED,), tl.float32)
        if USED < TILE:
            row_pos = _entries(pos, TILE, USED)
        else:
            row_pos = pos
        acc = tl.zeros((TILE, BLOCK_D), tl.float32)
        end = tl.minimum(c0 + CHUNK_N, last + 1)
        whole = tl.minimum(tl.maximum((first + 1) // BLOCK_N * BLOCK_N, c0), end)
        if TMA:
            row0 = first_page.to(tl.int32)
            col = kvh * BLOCK_D
            for j0 in tl.range(c0, whole, BLOCK_N, warp_specialize=WS):
                kb = k_desc.load([row0 + j0, col])
                vb = v_desc.load([row0 + j0, col])
                m, l, acc = _block_step(
                    q, kb, vb, m, l, acc, pos, row_pos, j0, scale, BLOCK_N, IEEE, NATIVE_EXP, False, TILE, USED
                )
        else:
            for j0 in range(c0, whole, BLOCK_N):
                kb, vb = _kv_block(
                    k_ptr,
                    v_ptr,
                    bt_ptr,
                    seq,
                    first_page,
                    kvh,
                    j0,
                    last,
                    d,
                    dmask,
                    stride_kb,
                    stride_ks,
                    stride_kh,
                    stride_vb,
                    stride_vs,
                    stride_vh,
                    stride_bt,
                    BLOCK_SIZE,
                    BLOCK_N,
                    KV,
                    False,
                )
                m, l, acc = _block_step(
                    q, kb, vb, m, l, acc, pos, row_pos, j0, scale, BLOCK_N, IEEE, NATIVE_EXP, False, TILE, USED
                )
        for j0 in range(whole, end, BLOCK_N):
            kb, vb = _kv_block(
                k_ptr,
                v_ptr,
                bt_ptr,
                seq,
                first_page,
                kvh,
                j0,
                last,
                d,
                dmask,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                stride_bt,
                BLOCK_SIZE,
                BLOCK_N,
                KV,
                True,
            )
            m, l, acc = _block_step(
                q, kb, vb, m, l, acc, pos, row_pos, j0, scale, BLOCK_N, IEEE, NATIVE_EXP, True, TILE, USED
            )
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
