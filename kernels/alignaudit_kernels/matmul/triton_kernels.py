"""The Triton kernels of the strict linear (the package docstring is the contract; alignaudit_kernels.matmul.launch
runs them): the pointer kernel and its segment tree, and the TMA kernels of Hopper and newer. Defined only where
Triton imports."""

from __future__ import annotations

from alignaudit_kernels.primitives import (
    triton,
)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        # Tile order: groups of GROUP_M row-tiles sweep the columns together (L2 reuse of W); the order in
        # which tiles run never changes what a tile computes.
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        group = tile // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (tile % (GROUP_M * tiles_n)) % size_m, (tile % (GROUP_M * tiles_n)) // size_m

    @triton.jit
    def _segment(
        x_ptr,
        w_ptr,
        rm,
        rn,
        k_lo,
        k_hi,
        M,
        N,
        stride_xm,
        stride_wn,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp32 accumulation of K in [k_lo, k_hi), increasing, from zero."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0
            )
            b = tl.load(
                w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < k_hi), other=0.0
            )
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit(do_not_specialize=["M"])  # the batch size: one build for every M
    def _matmul_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        stride_ys,
        HAS_BIAS: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SEGMENTS: tl.constexpr = 1,
        SPLIT_K: tl.constexpr = False,
    ):
        """y = x @ w^T (+ b) for one output tile. SEGMENTS > 1: K as a tree of segments, inside the program;
        SPLIT_K: program (tile, s) stores segment s's fp32 accumulator at y + s * stride_ys instead (no bias),
        and _segment_tree_kernel adds the segments afterwards."""
        pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        seg = K // SEGMENTS
        args = (x_ptr, w_ptr, rm, rn)
        if SPLIT_K:
            s = tl.program_id(1)
            acc = _segment(*args, s * seg, (s + 1) * seg, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
            y_ptr += s.to(tl.int64) * stride_ys
        elif SEGMENTS == 1:
            acc = _segment(*args, 0, K, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        elif SEGMENTS == 2:
            acc = _segment(*args, 0, seg, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K) + _segment(
                *args, seg, K, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K
            )
        else:  # 4 or 8: pairs, then pairs of pairs (the tree of tree_sum)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            left = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for q in tl.static_range(SEGMENTS // 2):
                pair = _segment(
                    *args, 2 * q * seg, (2 * q + 1) * seg, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K
                ) + _segment(
                    *args,
                    (2 * q + 1) * seg,
                    (2 * q + 2) * seg,
                    M,
                    N,
                    stride_xm,
                    stride_wn,
                    IEEE,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
                if SEGMENTS == 4:
                    if q == 0:
                        acc = pair
                    else:
                        acc = acc + pair
                else:  # 8: ((p01 + p23) + (p45 + p67))
                    if q % 2 == 0:
                        left = pair
                    elif q == 1:
                        acc = left + pair
                    else:
                        acc = acc + (left + pair)
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    @triton.jit
    def _segment_pair(p_ptr, q, total, offs, mask):
        return tl.load(p_ptr + (2 * q) * total + offs, mask=mask, other=0.0) + tl.load(
            p_ptr + (2 * q + 1) * total + offs, mask=mask, other=0.0
        )

    @triton.jit
    def _segment_tree_kernel(
        p_ptr, b_ptr, y_ptr, total, N, HAS_BIAS: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """y = the SEGMENTS fp32 partials p [SEGMENTS, total] added by tree_sum's tree ((p0 + p1) + (p2 + p3))
        ..., + bias (fp32, column = index % N), stored in y's dtype: the end of _matmul_kernel's tree."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = _segment_pair(p_ptr, 0, total, offs, mask)
        if SEGMENTS >= 4:
            acc = acc + _segment_pair(p_ptr, 1, total, offs, mask)
        if SEGMENTS == 8:
            acc = acc + (_segment_pair(p_ptr, 2, total, offs, mask) + _segment_pair(p_ptr, 3, total, offs, mask))
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tma_segment(
        x_desc, w_desc, pid_m, pid_n, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            b = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, b.T, acc)
        return acc

    @triton.jit
    def _tma_pair(
        x_desc, w_desc, pid_m, pid_n, seg, q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        """Segments 2q and 2q + 1, each from zero, added: one pair of the segment tree."""
        left = _tma_segment(x_desc, w_desc, pid_m, pid_n, 2 * q * seg, (2 * q + 1) * seg, BLOCK_M, BLOCK_N, BLOCK_K)
        return left + _tma_segment(
            x_desc, w_desc, pid_m, pid_n, (2 * q + 1) * seg, (2 * q + 2) * seg, BLOCK_M, BLOCK_N, BLOCK_K
        )

    @triton.jit
    def _slot(scratch_ptr, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The pointers of scratch tile ``slot`` ([BLOCK_M, BLOCK_N] fp32, row-major)."""
        return (
            scratch_ptr
            + slot * (BLOCK_M * BLOCK_N)
            + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
            + tl.arange(0, BLOCK_N)[None, :]
        )

    @triton.jit
    def _park(scratch_ptr, slot, acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Store a finished fp32 subtree in the program's scratch slot, so that the next pair needs no third
        accumulator in registers (the barrier: no thread may overwrite a slot another still reads)."""
        tl.debug_barrier()
        tl.store(_slot(scratch_ptr, slot, BLOCK_M, BLOCK_N), acc)

    @triton.jit
    def _unpark(scratch_ptr, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        tl.debug_barrier()  # every thread's part of the slot written before any thread reads it
        return tl.load(_slot(scratch_ptr, slot, BLOCK_M, BLOCK_N))

    @triton.jit
    def _tma_tiles(
        x_desc,
        w_desc,
        y_desc,
        scratch_ptr,
        M,
        N,
        K,
        programs,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SEGMENTS: tl.constexpr,
    ):
        """The same arithmetic as _matmul_kernel (bf16/fp16, no bias), with tiles moved by the TMA unit
        (out-of-range rows and K zero-filled, as the masked loads do) and ``programs`` persistent programs
        walking the tiles in the same grouped order. With SEGMENTS > 1 each segment is a whole number of
        BLOCK_K steps (the caller checks), so no load crosses a segment boundary, and the tree's finished
        left halves wait in two fp32 scratch tiles per program (scratch_ptr, [programs, 2, BLOCK_M, BLOCK_N]),
        so that at most two accumulators are live."""
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        seg = K // SEGMENTS
        slot = tl.program_id(0).to(tl.int64) * 2
        for tile in tl.range(tl.program_id(0), tiles, programs, flatten=True):
            pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            if SEGMENTS == 1:
                acc = _tma_segment(x_desc, w_desc, pid_m, pid_n, 0, K, BLOCK_M, BLOCK_N, BLOCK_K)
            elif SEGMENTS == 2:
                acc = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 0, BLOCK_M, BLOCK_N, BLOCK_K)
            elif SEGMENTS == 4:  # p01 + p23
                _park(
                    scratch_ptr,
                    slot,
                    _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 0, BLOCK_M, BLOCK_N, BLOCK_K),
                    BLOCK_M,
                    BLOCK_N,
                )
                right = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 1, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = _unpark(scratch_ptr, slot, BLOCK_M, BLOCK_N) + right
            else:  # 8: (p01 + p23) + (p45 + p67)
                _park(
                    scratch_ptr,
                    slot,
                    _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 0, BLOCK_M, BLOCK_N, BLOCK_K),
                    BLOCK_M,
                    BLOCK_N,
                )
                right = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 1, BLOCK_M, BLOCK_N, BLOCK_K)
                _park(scratch_ptr, slot, _unpark(scratch_ptr, slot, BLOCK_M, BLOCK_N) + right, BLOCK_M, BLOCK_N)
                _park(
                    scratch_ptr,
                    slot + 1,
                    _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 2, BLOCK_M, BLOCK_N, BLOCK_K),
                    BLOCK_M,
                    BLOCK_N,
                )
                right = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 3, BLOCK_M, BLOCK_N, BLOCK_K)
                right = _unpark(scratch_ptr, slot + 1, BLOCK_M, BLOCK_N) + right
                acc = _unpark(scratch_ptr, slot, BLOCK_M, BLOCK_N) + right
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))

    @triton.jit(do_not_specialize=["M", "programs"])
    def _matmul_tma_kernel(
        x_desc,
        w_desc,
        y_desc,
        scratch_ptr,
        M,
        N,
        K,
        programs,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SEGMENTS: tl.constexpr = 1,
    ):
        """_tma_tiles with the descriptors built on the host (triton.tools.tensor_descriptor.TensorDescriptor), which
        Triton's launcher encodes again at every launch."""
        _tma_tiles(x_desc, w_desc, y_desc, scratch_ptr, M, N, K, programs, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SEGMENTS)

    @triton.jit(do_not_specialize=["M", "programs"])
    def _matmul_tma_device_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        scratch_ptr,
        M,
        N,
        K,
        programs,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SEGMENTS: tl.constexpr = 1,
    ):
        """_tma_tiles with the descriptors made by each program on the device, over contiguous x [M, K], W [N, K]
        and y [M, N]: the same tiles, boxes and zero fill, without the host's descriptor work at every launch
        (three TensorDescriptors specialized, encoded by cuTensorMapEncodeTiled and passed by value)."""
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        _tma_tiles(x_desc, w_desc, y_desc, scratch_ptr, M, N, K, programs, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SEGMENTS)

    @triton.jit(do_not_specialize=["M"])
    def _matmul_tma_split_kernel(
        x_desc,
        w_desc,
        p_desc,
        M,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SEGMENTS: tl.constexpr,
    ):
        """Program (tile, s): K segment s of one output tile from zero, by the TMA unit, its fp32 accumulator
        stored as p[s] (p_desc over [SEGMENTS, M, N]); _segment_tree_kernel adds the tree afterwards. The
        segment loop is _tma_segment's, so the bits are the in-kernel tree's (as _split_k's for the pointer
        kernel), with SEGMENTS times the programs of one per tile."""
        pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        s = tl.program_id(1)
        seg = K // SEGMENTS
        acc = _tma_segment(x_desc, w_desc, pid_m, pid_n, s * seg, (s + 1) * seg, BLOCK_M, BLOCK_N, BLOCK_K)
        p_desc.store([s, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.reshape(1, BLOCK_M, BLOCK_N))
