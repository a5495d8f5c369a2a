"""The Triton kernels of strict attention (the package docstring is the algorithm; its steps are
alignaudit_kernels.attention.triton_steps, and alignaudit_kernels.attention.launch runs the kernels): each tile's rows,
the prefill and decode kernel, the split path's combine, and the output they end in. Defined only where Triton
imports."""

from __future__ import annotations

from alignaudit_kernels.primitives import (
    triton,
)

if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.attention.triton_steps import _chunk, _merge

    @triton.jit
    def _tile_rows(
        pos_ptr,
        tiles_ptr,
        n_tiles,
        tile,
        max_keys,
        TILE: tl.constexpr,
        GROUP: tl.constexpr,
        ROW_POS: tl.constexpr,
        DECODE: tl.constexpr,
        USED: tl.constexpr,
    ):
        """The tile's sequence, and per row: query token row, query head within the KV head's group, validity,
        position (-1 past the tile) and overflow: a position at or past ``max_keys``, clamped to max_keys - 1
        so no key past the bound is read (the caller stores NaN for those rows). DECODE: pos_ptr holds each
        sequence's key count, and the token's heads sit every TILE // USED rows (see triton_steps._rows)."""
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
    def _store_output(
        o_ptr,
        lse_ptr,
        acc,
        m,
        l,
        overflow,
        qrow,
        head,
        d,
        valid_row,
        stride_ot,
        stride_oh,
        stride_lh,
        HEAD_DIM: tl.constexpr,
        LSE: tl.constexpr,
    ):
        """The end of every path (unsplit kernel and split merge alike): acc / l in fp32, rounded once to the
        output dtype; NaN for a row past the key bound (``overflow``). LSE: also m + log(l) (fp32, the device's
        log: for the fused backward, not a strict value) at lse_ptr[head * stride_lh + row]."""
        l = tl.where(overflow, float("nan"), l)
        tl.store(
            o_ptr + qrow[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            (acc / l[:, None]).to(o_ptr.dtype.element_ty),
            mask=valid_row[:, None] & (d < HEAD_DIM)[None, :],
        )
        if LSE:
            lse = m + tl.log(tl.where(valid_row, l, 1.0))  # rows past the tile: log(1), not log(0), never stored
            tl.store(lse_ptr + head.to(tl.int64) * stride_lh + qrow, lse, mask=valid_row)

    @triton.jit(do_not_specialize=["n_tiles", "max_keys", "kv_rows"])  # per-step counts: one build for every value
    def _attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        lse_ptr,
        pos_ptr,
        bt_ptr,
        tiles_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_tiles,
        max_keys,
        kv_rows,
        scale,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_lh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        TILE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK_N: tl.constexpr,
        IEEE: tl.constexpr,
        KV: tl.constexpr,
        ROW_POS: tl.constexpr,
        DECODE: tl.constexpr,
        SPLIT: tl.constexpr,
        NATIVE_EXP: tl.constexpr,
        USED: tl.constexpr,
        TMA: tl.constexpr,
        WS: tl.constexpr,
        ONE_CHUNK: tl.constexpr,
        LSE: tl.constexpr,
    ):
        # The last tile first: in a causal prefill it visits the most key blocks (load balance only).
        tile = n_tiles - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        seq, qrow, group_head, valid_row, pos, overflow = _tile_rows(
            pos_ptr, tiles_ptr, n_tiles, tile, max_keys, TILE, GROUP, ROW_POS, DECODE, USED
        )
        r = tl.arange(0, TILE)
        head = kvh * GROUP + group_head
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(
            q_ptr + qrow[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=valid_row[:, None] & dmask[None, :],
            other=0.0,
        )
        last = tl.max(pos, axis=0)
        first = tl.min(tl.where(valid_row, pos, last), axis=0)
        first_page = tl.load(bt_ptr + seq * stride_bt).to(tl.int64)
        if TMA:  # KV_DIRECT, BLOCK_D == HEAD_DIM: K and V as [rows, KV heads x HEAD_DIM] matrices
            width = tl.num_programs(1) * BLOCK_D
            k_desc = tl.make_tensor_descriptor(
                k_ptr, shape=[kv_rows, width], strides=[stride_kb, 1], block_shape=[BLOCK_N, BLOCK_D]
            )
            v_desc = tl.make_tensor_descriptor(
                v_ptr, shape=[kv_rows, width], strides=[stride_vb, 1], block_shape=[BLOCK_N, BLOCK_D]
            )
        else:
            k_desc = None
            v_desc = None
        if SPLIT:  # this program: one chunk, its state to the scratch buffers for _combine_kernel
            c = tl.program_id(2)
            m, l, acc = _chunk(
                q,
                pos,
                first,
                last,
                c * CHUNK_N,
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
                BLOCK_SIZE,
                TILE,
                BLOCK_D,
                BLOCK_N,
                CHUNK_N,
                IEEE,
                KV,
                NATIVE_EXP,
                USED,
                TMA,
                WS,
            )
            # scratch rows: the USED rows that can hold a query (a decode tile's heads sit TILE // USED apart;
            # every row of any other tile), so a decode step's scratch is USED / TILE of a whole tile's
            slot = ((c.to(tl.int64) * n_tiles + tile) * tl.num_programs(1) + kvh) * USED + r // (TILE // USED)
            keep = valid_row & (c * CHUNK_N <= pos)
            tl.store(m_ptr + slot, m, mask=keep)
            tl.store(l_ptr + slot, l, mask=keep)
            tl.store(acc_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=keep[:, None])
        else:
            m, l, acc = _chunk(
                q,
                pos,
                first,
                last,
                0,
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
                BLOCK_SIZE,
                TILE,
                BLOCK_D,
                BLOCK_N,
                CHUNK_N,
                IEEE,
                KV,
                NATIVE_EXP,
                USED,
                TMA,
                WS,
            )
            # ONE_CHUNK: no row sees a key past the first chunk, and the kernel is built without the merge (its
            # second state spills 232 bytes a thread at sm_90 otherwise: Triton 3.8's cross-compiled cubin)
            if not ONE_CHUNK:
                for c0 in range(CHUNK_N, last + 1, CHUNK_N):
                    m_c, l_c, acc_c = _chunk(
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
                        BLOCK_SIZE,
                        TILE,
                        BLOCK_D,
                        BLOCK_N,
                        CHUNK_N,
                        IEEE,
                        KV,
                        NATIVE_EXP,
                        USED,
                        TMA,
                        WS,
                    )
                    m, l, acc = _merge(m, l, acc, m_c, l_c, acc_c, c0 <= pos, NATIVE_EXP)
            _store_output(
                o_ptr,
                lse_ptr,
                acc,
                m,
                l,
                overflow,
                qrow,
                head,
                d,
                valid_row,
                stride_ot,
                stride_oh,
                stride_lh,
                HEAD_DIM,
                LSE,
            )

    @triton.jit(do_not_specialize=["n_tiles", "max_keys", "n_chunks"])
    def _combine_kernel(
        o_ptr,
        lse_ptr,
        pos_ptr,
        tiles_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_tiles,
        max_keys,
        n_chunks,
        stride_ot,
        stride_oh,
        stride_lh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        TILE: tl.constexpr,
        CHUNK_N: tl.constexpr,
        ROW_POS: tl.constexpr,
        DECODE: tl.constexpr,
        NATIVE_EXP: tl.constexpr,
        USED: tl.constexpr,
        LSE: tl.constexpr,
    ):
        """The split path's second launch: the chunk states of each row merged left to right, as the
        unsplit kernel merges them in registers."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq, qrow, group_head, valid_row, pos, overflow = _tile_rows(
            pos_ptr, tiles_ptr, n_tiles, tile, max_keys, TILE, GROUP, ROW_POS, DECODE, USED
        )
        r = tl.arange(0, TILE)
        head = kvh * GROUP + group_head
        d = tl.arange(0, BLOCK_D)
        slot = (tile.to(tl.int64) * tl.num_programs(1) + kvh) * USED + r // (TILE // USED)  # _attention_kernel's
        chunk_stride = tl.num_programs(1).to(tl.int64) * n_tiles * USED
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
        _store_output(
            o_ptr,
            lse_ptr,
            acc,
            m,
            l,
            overflow,
            qrow,
            head,
            d,
            valid_row,
            stride_ot,
            stride_oh,
            stride_lh,
            HEAD_DIM,
            LSE,
        )
