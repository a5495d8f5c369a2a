"""Strict linear layer: y = x @ W^T (+ b), one fixed reduction order over K for every row.

Contract (both backends):
    inputs        x [..., K] and W [N, K] in bf16, fp16 or fp32 (one dtype); optional bias [N]
    precision     products and accumulation in fp32; bias added in fp32
    rounding      once, fp32 -> x.dtype, at the end
    reduction     over K only; the order for an output element depends on K and ``k_segments`` alone, never
                  on the number of rows, the row's position, or the other rows
    segments      ``k_segments`` S (1, 2, 4 or 8; K divisible by S): K is cut into S equal contiguous
                  segments, each accumulated from zero in the order below, and the S fp32 partials are
                  added by a pairwise tree ((p0 + p1) + (p2 + p3)). A row-parallel layer at tensor-parallel
                  size t holds S/t consecutive segments on each rank: ``linear_partial`` gives its subtree,
                  unrounded, and ``combine_partials`` adds the ranks' partials in rank order by the top of
                  the same tree, then adds the bias and rounds once. So t = 1, 2, 4 (dividing S) give the
                  same bits as each other and as ``linear(..., k_segments=S)`` on one rank.
    CPU order     K in blocks of 32 (zero-padded), each block a pairwise tree, blocks added left to right
                  (alignaudit_kernels.primitives.fixed_sum); products x*w rounded to fp32 (exact for bf16/fp16)
    GPU order     Triton: each (BLOCK_M x BLOCK_N) output tile by one program, K in increasing order, tl.dot
                  accumulating into one fp32 accumulator (tensor cores; fp32 inputs use IEEE fp32
                  products, not TF32); tiles fixed per dtype and batch-size class (TILES, TMA_PLANS), no
                  autotuning. Segments: the tree inside the program (the TMA kernel keeps finished subtrees in
                  fp32 scratch tiles), or one program per (tile, segment) and a launch adding the tree
                  (_split_k; _triton_tma_split by the TMA unit): the same additions in the same order
                  either way.
                  The tensor cores add K in steps of their instruction (16 for bf16/fp16) into the
                  accumulator, so BLOCK_K only groups steps: on an H200, BLOCK_K 64 and 128 give the same
                  bits (bench/sweep_gpu.py), and tests/kernels/ re-checks rows across every switch
Backward: plain torch matmuls in the inputs' dtype (correct, not strict: ``linear_backward``).
"""

from __future__ import annotations

import os

import torch

from alignaudit_kernels.primitives import (
    BLOCK,
    as_dtype,
    as_rows,
    block_sums,
    capability,
    cdiv,
    compiling_inference,
    descriptor_scratch,
    no_gradient,
    opaque_op,
    sm_count,
    triton,
    use_triton,
)

CPU_CHUNK_ELEMENTS = 1 << 24  # rows are independent: process as many as fit in this many fp32 products


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, in the inputs' dtype (pass float64 for an accuracy reference)."""
    y = x @ weight.T
    return y + bias if bias is not None else y


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Pairwise tree over a power-of-two number of fp32 tensors: ((p0 + p1) + (p2 + p3)) ..."""
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"a pairwise tree needs a power of two of partials, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _cpu_partial(x2: torch.Tensor, weight: torch.Tensor, segments: int) -> torch.Tensor:
    """fp32 [M, N]: the tree over ``segments`` segment accumulations (no bias, no rounding)."""
    seg = x2.shape[1] // segments
    return tree_sum([_cpu_segment(x2[:, s * seg:(s + 1) * seg], weight[:, s * seg:(s + 1) * seg])
                     for s in range(segments)])


def _cpu_segment(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m, k = x2.shape
    n = weight.shape[0]
    pad = (-k) % BLOCK
    xf = torch.nn.functional.pad(x2.float(), (0, pad)).unflatten(-1, (-1, BLOCK))  # [M, KB, 32]
    wf = torch.nn.functional.pad(weight.float(), (0, pad)).unflatten(-1, (-1, BLOCK))  # [N, KB, 32]
    out = torch.empty(m, n, dtype=torch.float32)
    rows = max(1, CPU_CHUNK_ELEMENTS // max(1, n * BLOCK))
    for start in range(0, m, rows):
        xs = xf[start: start + rows]
        acc = block_sums(xs[:, None, 0, :] * wf[None, :, 0, :])
        for b in range(1, xf.shape[1]):
            acc = acc + block_sums(xs[:, None, b, :] * wf[None, :, b, :])
        out[start: start + rows] = acc
    return out


def _cpu(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int = 1) -> torch.Tensor:
    out = _cpu_partial(x2, weight, segments)
    return as_dtype(out if bias is None else out + bias.float(), x2.dtype)


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
    def _segment(x_ptr, w_ptr, rm, rn, k_lo, k_hi, M, N, stride_xm, stride_wn, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 accumulation of K in [k_lo, k_hi), increasing, from zero."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < k_hi), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit(do_not_specialize=["M"])  # the batch size: one build for every M
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SEGMENTS: tl.constexpr = 1,
                       SPLIT_K: tl.constexpr = False):
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
            acc = (_segment(*args, 0, seg, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
                   + _segment(*args, seg, K, M, N, stride_xm, stride_wn, IEEE, BLOCK_M, BLOCK_N, BLOCK_K))
        else:  # 4 or 8: pairs, then pairs of pairs (the tree of tree_sum)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            left = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for q in tl.static_range(SEGMENTS // 2):
                pair = (_segment(*args, 2 * q * seg, (2 * q + 1) * seg, M, N, stride_xm, stride_wn, IEEE, BLOCK_M,
                                 BLOCK_N, BLOCK_K)
                        + _segment(*args, (2 * q + 1) * seg, (2 * q + 2) * seg, M, N, stride_xm, stride_wn, IEEE,
                                   BLOCK_M, BLOCK_N, BLOCK_K))
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
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _segment_pair(p_ptr, q, total, offs, mask):
        return (tl.load(p_ptr + (2 * q) * total + offs, mask=mask, other=0.0)
                + tl.load(p_ptr + (2 * q + 1) * total + offs, mask=mask, other=0.0))

    @triton.jit
    def _segment_tree_kernel(p_ptr, b_ptr, y_ptr, total, N, HAS_BIAS: tl.constexpr, SEGMENTS: tl.constexpr,
                             BLOCK: tl.constexpr):
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
    def _tma_segment(x_desc, w_desc, pid_m, pid_n, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            b = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, b.T, acc)
        return acc

    @triton.jit
    def _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, q, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        """Segments 2q and 2q + 1, each from zero, added: one pair of the segment tree."""
        left = _tma_segment(x_desc, w_desc, pid_m, pid_n, 2 * q * seg, (2 * q + 1) * seg, BLOCK_M, BLOCK_N, BLOCK_K)
        return left + _tma_segment(x_desc, w_desc, pid_m, pid_n, (2 * q + 1) * seg, (2 * q + 2) * seg, BLOCK_M,
                                   BLOCK_N, BLOCK_K)

    @triton.jit
    def _slot(scratch_ptr, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The pointers of scratch tile ``slot`` ([BLOCK_M, BLOCK_N] fp32, row-major)."""
        return (scratch_ptr + slot * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
                + tl.arange(0, BLOCK_N)[None, :])

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
    def _tma_tiles(x_desc, w_desc, y_desc, scratch_ptr, M, N, K, programs, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SEGMENTS: tl.constexpr):
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
                _park(scratch_ptr, slot, _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 0, BLOCK_M, BLOCK_N, BLOCK_K),
                      BLOCK_M, BLOCK_N)
                right = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 1, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = _unpark(scratch_ptr, slot, BLOCK_M, BLOCK_N) + right
            else:  # 8: (p01 + p23) + (p45 + p67)
                _park(scratch_ptr, slot, _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 0, BLOCK_M, BLOCK_N, BLOCK_K),
                      BLOCK_M, BLOCK_N)
                right = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 1, BLOCK_M, BLOCK_N, BLOCK_K)
                _park(scratch_ptr, slot, _unpark(scratch_ptr, slot, BLOCK_M, BLOCK_N) + right, BLOCK_M, BLOCK_N)
                _park(scratch_ptr, slot + 1,
                      _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 2, BLOCK_M, BLOCK_N, BLOCK_K), BLOCK_M, BLOCK_N)
                right = _tma_pair(x_desc, w_desc, pid_m, pid_n, seg, 3, BLOCK_M, BLOCK_N, BLOCK_K)
                right = _unpark(scratch_ptr, slot + 1, BLOCK_M, BLOCK_N) + right
                acc = _unpark(scratch_ptr, slot, BLOCK_M, BLOCK_N) + right
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))

    @triton.jit(do_not_specialize=["M", "programs"])
    def _matmul_tma_kernel(x_desc, w_desc, y_desc, scratch_ptr, M, N, K, programs, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           SEGMENTS: tl.constexpr = 1):
        """_tma_tiles with the descriptors built on the host (triton.tools.tensor_descriptor.TensorDescriptor), which
        Triton's launcher encodes again at every launch."""
        _tma_tiles(x_desc, w_desc, y_desc, scratch_ptr, M, N, K, programs, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                   SEGMENTS)

    @triton.jit(do_not_specialize=["M", "programs"])
    def _matmul_tma_device_kernel(x_ptr, w_ptr, y_ptr, scratch_ptr, M, N, K, programs, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                  SEGMENTS: tl.constexpr = 1):
        """_tma_tiles with the descriptors made by each program on the device, over contiguous x [M, K], W [N, K]
        and y [M, N]: the same tiles, boxes and zero fill, without the host's descriptor work at every launch
        (three TensorDescriptors specialized, encoded by cuTensorMapEncodeTiled and passed by value)."""
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        _tma_tiles(x_desc, w_desc, y_desc, scratch_ptr, M, N, K, programs, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                   SEGMENTS)

    @triton.jit(do_not_specialize=["M"])
    def _matmul_tma_split_kernel(x_desc, w_desc, p_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SEGMENTS: tl.constexpr):
        """Program (tile, s): K segment s of one output tile from zero, by the TMA unit, its fp32 accumulator
        stored as p[s] (p_desc over [SEGMENTS, M, N]); _segment_tree_kernel adds the tree afterwards. The
        segment loop is _tma_segment's, so the bits are the in-kernel tree's (as _split_k's for the pointer
        kernel), with SEGMENTS times the programs of one per tile."""
        pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        s = tl.program_id(1)
        seg = K // SEGMENTS
        acc = _tma_segment(x_desc, w_desc, pid_m, pid_n, s * seg, (s + 1) * seg, BLOCK_M, BLOCK_N, BLOCK_K)
        p_desc.store([s, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.reshape(1, BLOCK_M, BLOCK_N))


# Tiles: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Never chosen by timing at run time; chosen by
# batch size: up to TINY_M rows (decode) a 16-row tile with narrow columns, so that enough programs stream
# W; up to SMALL_M rows 64x64 (128x128 for wide layers, N >= WIDE_N: gate/up, lm_head); above, 256x128.
# On Hopper and newer (bf16/fp16 without bias) every batch above TINY_M runs the TMA kernel instead
# (_matmul_tma_kernel, tiles in TMA_PLANS; ALIGNAUDIT_MATMUL_TMA=0 turns it off). A K-segmented product that
# does not run there runs one program per tile and segment (_split_k). A tile only decides which outputs
# a program computes: on an H200 every tile in bench/sweep_gpu.py (fifteen bf16 tiles from 16x16 to
# 256x128, BLOCK_K 64 and 128, and the TMA kernel, 2026-11-29) gave every element the same bits, and a
# row alone in a small tile equals the same row in a large one; tests/kernels/ re-checks across the
# switches. ALIGNAUDIT_MATMUL_TILES=fixed forces the large pointer-kernel tile for every batch size (one
# code path) on hardware where that has not been verified.
TILES = {
    torch.bfloat16: {"tiny": (16, 32, 128, 4, 3), "small": (64, 64, 64, 4, 4), "small_wide": (128, 128, 64, 8, 3),
                     "large": (256, 128, 64, 8, 3)},
    torch.float16: {"tiny": (16, 32, 128, 4, 3), "small": (64, 64, 64, 4, 4), "small_wide": (128, 128, 64, 8, 3),
                    "large": (256, 128, 64, 8, 3)},
    torch.float32: dict.fromkeys(("tiny", "small", "small_wide", "large"), (64, 64, 32, 4, 3)),
}
TINY_M = 16
SMALL_M = 256
WIDE_N = 16384
# The TMA kernel's (tile, persistent) by batch-size class (above TINY_M; up to SMALL_M or above it) and by
# whether the product is "narrow": K-segmented (two accumulators live, 128x256 spills) or stored as an fp32
# partial (128x256 with an fp32 output tile exceeds shared memory). The fastest on an H200 in
# bench/sweep_gpu.py --sections segments,small-m, each giving the pointer kernel's bits there (the measurements:
# docs/benchmarks.md, "Tile choices of kernels/alignaudit_kernels/matmul.py").
TMA_PLANS = {("small", False): ((128, 128, 64, 8, 6), True), ("small", True): ((64, 128, 64, 4, 6), False),
             ("large", False): ((128, 256, 64, 8, 3), True), ("large", True): ((128, 128, 64, 8, 4), True)}
# A third class, TINY_M < rows <= MEDIUM_M (decode batches of 17-128 sequences; ALIGNAUDIT_MATMUL_MEDIUM=0 turns
# it off, the same bits either way): at those sizes the small-class plans' 128-row tiles leave most SMs idle (qkv
# at 32 rows: 48 programs on 132 SMs). Unsegmented products run 64x128 TMA tiles, persistent; K-segmented ones one
# program per (column tile, segment) over a single row tile (64 rows up to 64, 128 up to 128) and the tree launch
# (_triton_tma_split). Picked from bench/sweep_gpu.py --sections issue19, where each gave the pointer kernel's bits
# at every Qwen3-8B layer and M = 32, 64, 128 (docs/benchmarks.md, "Tile choices of
# kernels/alignaudit_kernels/matmul.py").
MEDIUM_M = 128
MEDIUM_TILE = ((64, 128, 64, 4, 6), True)
MEDIUM_SPLIT_TILES = ((64, (64, 128, 64, 4, 6)), (MEDIUM_M, (128, 128, 64, 8, 6)))  # (up to rows, tile)
# Where _triton_tma's descriptors are made: "host" (_matmul_tma_kernel: three TensorDescriptors that Triton's launcher
# specializes and encodes on the host at every launch: the likely cause of the launch's 43 us of host time at 2048
# rows against 23 us at one row, H100, 2026-12-06, not separated) or "device" (_matmul_tma_device_kernel: each
# program makes them in global scratch). The same tiles and boxes, so the same bits expected; "host" until a GPU run
# shows them (tests/kernels/test_linear.py) and the host time saved (bench/launch_overhead.py).
TMA_DESCRIPTORS = "host"


def medium_class_enabled() -> bool:
    """Whether TINY_M < rows <= MEDIUM_M runs the medium-class plans (default on; ALIGNAUDIT_MATMUL_MEDIUM=0: off)."""
    return os.environ.get("ALIGNAUDIT_MATMUL_MEDIUM", "1") == "1"


def fixed_tiles() -> bool:
    """ALIGNAUDIT_MATMUL_TILES=fixed: one pointer-kernel tile for every batch size (TILES' comment)."""
    return os.environ.get("ALIGNAUDIT_MATMUL_TILES", "by_m") == "fixed"


def tile_for(m: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """The launch tile for an [m, K] x [K, n] product (see TILES)."""
    tiles = TILES[dtype]
    if fixed_tiles() or m > SMALL_M:
        return tiles["large"]
    if m <= TINY_M:
        return tiles["tiny"]
    return tiles["small_wide"] if n >= WIDE_N else tiles["small"]


def _triton(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile=None, segments: int = 1,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The pointer kernel (or, for large bf16/fp16 batches on Hopper, the TMA kernel); ``out_dtype`` float32
    stores the unrounded accumulator (a partial)."""
    m, k = x2.shape
    n = weight.shape[0]
    # the pointer kernel reads rows through their stride: only the K axis must be contiguous
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if tile is None and TINY_M < m <= MEDIUM_M and medium_class_enabled() and _tma_available(x2, weight, bias):
        if segments == 1:
            return _triton_tma(x2, weight, *MEDIUM_TILE, out_dtype=out_dtype)
        split_tile = next(t for rows, t in MEDIUM_SPLIT_TILES if m <= rows)
        if (k // segments) % split_tile[2] == 0:  # no TMA load may cross a segment boundary
            return _triton_tma_split(x2, weight, split_tile, segments, out_dtype)
    if tile is None and m > TINY_M and _tma_available(x2, weight, bias):
        narrow = segments > 1 or out_dtype == torch.float32
        tma_tile, persistent = TMA_PLANS["large" if m > SMALL_M else "small", narrow]
        if (k // segments) % tma_tile[2] == 0:  # no TMA load may cross a segment boundary
            return _triton_tma(x2, weight, tma_tile, persistent, segments=segments, out_dtype=out_dtype)
    if tile is None and segments > 1:
        return _split_k(x2, weight, bias, segments, out_dtype)
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    bm, bn, bk, warps, stages = tile or tile_for(m, n, x2.dtype)
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _matmul_kernel[grid](x2, weight, bias if bias is not None else x2, y, m, n, k, x2.stride(0), weight.stride(0),
                         y.stride(0), 0, HAS_BIAS=bias is not None, IEEE=x2.dtype == torch.float32,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SEGMENTS=segments, num_warps=warps,
                         num_stages=stages)
    return y


SPLIT_K_BLOCK = 1024  # elements per program of _segment_tree_kernel


def _split_k(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int,
             out_dtype: torch.dtype | None) -> torch.Tensor:
    """A segmented product off the TMA kernel (up to TINY_M rows, or a GPU without it) with one program per
    (output tile, K segment), each storing its segment's fp32 accumulator, then one launch that adds the
    segments by the tree, adds the bias and rounds. x2 [M, K] and weight [N, K] with unit stride along K.
    Each segment is accumulated by the same _segment loop as inside the in-kernel tree and the tree is the
    same, so the bits are the in-kernel tree's (tests/kernels/ checks it); the point is SEGMENTS times
    as many programs, where a decode batch's few row tiles leave most SMs idle (on an H200 Qwen3-8B's down
    projection at 16 rows went from 0.59x to 0.89x of cuBLAS, docs/benchmarks.md 2026-11-30 morning)."""
    m, k = x2.shape
    n = weight.shape[0]
    parts = torch.empty(segments, m, n, dtype=torch.float32, device=x2.device)
    bm, bn, bk, warps, stages = tile_for(m, n, x2.dtype)
    grid = (cdiv(m, bm) * cdiv(n, bn), segments)
    _matmul_kernel[grid](x2, weight, x2, parts, m, n, k, x2.stride(0), weight.stride(0), n, m * n,
                         HAS_BIAS=False, IEEE=x2.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         GROUP_M=8, SEGMENTS=segments, SPLIT_K=True, num_warps=warps, num_stages=stages)
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    _segment_tree_kernel[(cdiv(m * n, SPLIT_K_BLOCK),)](
        parts, bias if bias is not None else parts, y, m * n, n, HAS_BIAS=bias is not None, SEGMENTS=segments,
        BLOCK=SPLIT_K_BLOCK)
    return y


def _tma_available(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The TMA path needs a Hopper-or-newer GPU, bf16/fp16 without bias, and 16-byte aligned rows."""
    return (bias is None and x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("ALIGNAUDIT_MATMUL_TMA", "1") != "0"
            and not fixed_tiles() and capability(x2.device)[0] >= 9
            and x2.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0
            and x2.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def _triton_tma(x2: torch.Tensor, weight: torch.Tensor, tile, persistent: bool = True, segments: int = 1,
                out_dtype: torch.dtype | None = None, descriptors: str | None = None) -> torch.Tensor:
    """Every batch above TINY_M rows on Hopper and newer: _matmul_tma_kernel (same bits as _matmul_kernel) at
    ``tile``, ``persistent`` programs or one per tile; ``out_dtype`` float32 stores the unrounded accumulator
    (a partial). ``descriptors``: "host" or "device" (_matmul_tma_device_kernel), default TMA_DESCRIPTORS.
    x2 [M, K] and weight [N, K] bf16/fp16 (one dtype); the TMA unit needs 16-byte aligned bases and rows
    (_tma_available checks it for linear's calls).

    Raises:
        ValueError: an unknown ``descriptors``; with "device", a base or row that is not 16-byte aligned (the
            host descriptors assert it when they are made; a device-made one would read or write out of place).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    descriptors = descriptors or TMA_DESCRIPTORS
    if descriptors not in ("host", "device"):
        raise ValueError(f"strict linear: descriptors={descriptors!r}; use 'host' or 'device'")
    m, k = x2.shape
    n = weight.shape[0]
    x2, weight = x2.contiguous(), weight.contiguous()
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    bm, bn, bk, warps, stages = tile
    tiles = cdiv(m, bm) * cdiv(n, bn)
    programs = min(tiles, sm_count(x2.device)) if persistent else tiles
    # two fp32 scratch tiles per program for the tree's left halves; up to two segments the kernel never reads it
    scratch = torch.empty(programs * 2 * bm * bn, dtype=torch.float32, device=x2.device) if segments > 2 else y
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SEGMENTS=segments, num_warps=warps, num_stages=stages)
    if descriptors == "device":
        if any(t.data_ptr() % 16 or t.shape[1] * t.element_size() % 16 for t in (x2, weight, y)):
            raise ValueError(f"strict linear: TMA descriptors need 16-byte aligned bases and rows (x "
                             f"{tuple(x2.shape)}, weight {tuple(weight.shape)}, out {y.dtype})")
        with descriptor_scratch(True, x2.device):
            _matmul_tma_device_kernel[(programs,)](x2, weight, y, scratch, m, n, k, programs, **meta)
    else:
        _matmul_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(y, [bm, bn]), scratch, m, n, k, programs, **meta)
    return y


def _triton_tma_split(x2: torch.Tensor, weight: torch.Tensor, tile, segments: int,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A segmented bf16/fp16 product by _matmul_tma_split_kernel (one program per tile and segment, fp32
    partials) and _segment_tree_kernel (the tree, rounded once): the in-kernel tree's bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x2.shape
    n = weight.shape[0]
    x2, weight = x2.contiguous(), weight.contiguous()
    bm, bn, bk, warps, stages = tile
    parts = torch.empty(segments, m, n, dtype=torch.float32, device=x2.device)
    _matmul_tma_split_kernel[(cdiv(m, bm) * cdiv(n, bn), segments)](
        TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(parts, [1, bm, bn]), m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        SEGMENTS=segments, num_warps=warps, num_stages=stages)
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    _segment_tree_kernel[(cdiv(m * n, SPLIT_K_BLOCK),)](parts, parts, y, m * n, n, HAS_BIAS=False,
                                                        SEGMENTS=segments, BLOCK=SPLIT_K_BLOCK)
    return y


SEGMENT_COUNTS = (1, 2, 4, 8)
# The K segments of every row-parallel layer (attention output and MLP down projections) in every engine's
# strict path: tensor-parallel sizes 1, 2 and 4 then give identical bits (docs/kernels.md).
ROW_PARALLEL_SEGMENTS = 4


def _check(x: torch.Tensor, weight: torch.Tensor, segments: int) -> None:
    if x.dtype != weight.dtype:
        raise TypeError(f"strict linear needs one dtype: x is {x.dtype}, weight is {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"strict linear: x has K={x.shape[-1]}, weight has K={weight.shape[1]}")
    if segments not in SEGMENT_COUNTS or x.shape[-1] % segments:
        raise ValueError(f"strict linear: k_segments={segments} must be one of {SEGMENT_COUNTS} "
                         f"and divide K={x.shape[-1]}")


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int = 1) -> torch.Tensor:
    _check(x, weight, segments)
    x2 = as_rows(x)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    if use_triton(x):
        y = _triton(x2, weight, bias, segments=segments)
    else:
        y = _cpu(x2, weight, bias, segments)
    return y if x2 is x else y.reshape(*x.shape[:-1], weight.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, segments):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, segments)

    @staticmethod
    def backward(ctx, grad):
        return (*linear_backward(grad, *ctx.saved_tensors, ctx.has_bias), None)


def linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool):
    """Gradients of y = x @ W^T (+ b) with respect to x, W and b: plain torch matmuls in the inputs' dtype
    (cuBLAS on CUDA, fp32 accumulation, as torch's own linear backward and Megatron's; correct and
    deterministic, not strict: nothing compares gradient bits across engines). grad [..., N], x [..., K],
    weight [N, K], one dtype (grad is cast to it); b's gradient (summed in fp32) None without a bias.

    In fp32 on the H200 these products were 0.55 of the 0.95 s of a strict Qwen3-1.7B-shape update of 4096
    tokens (fp32 SIMT GEMMs; bench/train_step_profile.py, 2026-12-02)."""
    g = grad.to(weight.dtype).reshape(-1, weight.shape[0])
    gx = (g @ weight).reshape(x.shape)
    gw = g.T @ x.reshape(-1, x.shape[-1])
    return gx, gw, g.float().sum(0).to(weight.dtype) if has_bias else None


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None, k_segments: int = 1) -> torch.Tensor:
    """Strict ``x @ weight.T + bias``: x [..., K], weight [N, K], bias [N] or None -> [..., N] in x.dtype.
    ``k_segments`` > 1 reduces K as a tree of that many segments (the row-parallel form; module docstring).

    Raises:
        TypeError: x and weight of different dtypes. ValueError: K mismatch, or k_segments not in
            SEGMENT_COUNTS or not dividing K.
    """
    if compiling_inference(x, weight, bias):
        return _linear_op(x, weight, bias, k_segments)
    if no_gradient(x, weight, bias):
        return _forward(x, weight, bias, k_segments)
    return _Linear.apply(x, weight, bias, k_segments)


@opaque_op("linear", "(Tensor x, Tensor weight, Tensor? bias, int segments) -> Tensor",
           lambda x, weight, bias, segments: x.new_empty(*x.shape[:-1], weight.shape[0]))
def _linear_op(x, weight, bias, segments):
    return _forward(x, weight, bias, segments)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> torch.Tensor:
    """One rank's share of a row-parallel strict linear: x [..., K/t], weight [N, K/t] holding ``k_segments``
    (= S/t) consecutive segments -> fp32 [..., N], their tree, unrounded, without bias. Forward only.

    Raises:
        as ``linear``.
    """
    _check(x, weight, k_segments)
    x2 = as_rows(x)
    if use_triton(x):
        y = _triton(x2, weight, None, segments=k_segments, out_dtype=torch.float32)
    else:
        y = _cpu_partial(x2, weight, k_segments)
    return y if x2 is x else y.reshape(*x.shape[:-1], weight.shape[0])


def combine_partials(parts: list[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' fp32 partials, in rank order, by the top of the segment tree; + bias (fp32); rounded once
    to ``dtype``. With ``linear_partial`` this equals ``linear(..., k_segments=S)`` bit for bit."""
    out = tree_sum([p.float() for p in parts])
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)
