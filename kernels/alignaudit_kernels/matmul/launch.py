"""How the Triton kernels of the strict linear run: the launch tile by batch-size class and layer width, the TMA
plans of Hopper and newer, the medium class, the split-K path, and the host wrappers that validate, allocate and
launch."""

from __future__ import annotations

import os

import torch

from alignaudit_kernels.primitives import (
    capability,
    cdiv,
    descriptor_scratch,
    sm_count,
    triton,
)

if triton is not None:
    from alignaudit_kernels.matmul.triton_kernels import (
        _matmul_kernel,
        _matmul_tma_device_kernel,
        _matmul_tma_kernel,
        _matmul_tma_split_kernel,
        _segment_tree_kernel,
    )


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
    torch.bfloat16: {
        "tiny": (16, 32, 128, 4, 3),
        "small": (64, 64, 64, 4, 4),
        "small_wide": (128, 128, 64, 8, 3),
        "large": (256, 128, 64, 8, 3),
    },
    torch.float16: {
        "tiny": (16, 32, 128, 4, 3),
        "small": (64, 64, 64, 4, 4),
        "small_wide": (128, 128, 64, 8, 3),
        "large": (256, 128, 64, 8, 3),
    },
    torch.float32: dict.fromkeys(("tiny", "small", "small_wide", "large"), (64, 64, 32, 4, 3)),
}
TINY_M = 16
SMALL_M = 256
WIDE_N = 16384
# The TMA kernel's (tile, persistent) by batch-size class (above TINY_M; up to SMALL_M or above it) and by
# whether the product is "narrow": K-segmented (two accumulators live, 128x256 spills) or stored as an fp32
# partial (128x256 with an fp32 output tile exceeds shared memory). The fastest on an H200 in
# bench/sweep_gpu.py --sections segments,small-m, each giving the pointer kernel's bits there (the measurements:
# docs/benchmarks.md, "Tile choices of the strict matmul").
TMA_PLANS = {
    ("small", False): ((128, 128, 64, 8, 6), True),
    ("small", True): ((64, 128, 64, 4, 6), False),
    ("large", False): ((128, 256, 64, 8, 3), True),
    ("large", True): ((128, 128, 64, 8, 4), True),
}
# A third class, TINY_M < rows <= MEDIUM_M (decode batches of 17-128 sequences; ALIGNAUDIT_MATMUL_MEDIUM=0 turns
# it off, the same bits either way): at those sizes the small-class plans' 128-row tiles leave most SMs idle (qkv
# at 32 rows: 48 programs on 132 SMs). Unsegmented products run 64x128 TMA tiles, persistent; K-segmented ones one
# program per (column tile, segment) over a single row tile (64 rows up to 64, 128 up to 128) and the tree launch
# (_triton_tma_split). Picked from bench/sweep_gpu.py --sections issue19, where each gave the pointer kernel's bits
# at every Qwen3-8B layer and M = 32, 64, 128 (docs/benchmarks.md, "Tile choices of the strict matmul").
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


def _triton(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile=None,
    segments: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
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
    _matmul_kernel[grid](
        x2,
        weight,
        bias if bias is not None else x2,
        y,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        0,
        HAS_BIAS=bias is not None,
        IEEE=x2.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        SEGMENTS=segments,
        num_warps=warps,
        num_stages=stages,
    )
    return y


SPLIT_K_BLOCK = 1024  # elements per program of _segment_tree_kernel


def _split_k(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, segments: int, out_dtype: torch.dtype | None
) -> torch.Tensor:
    """A segmented product off the TMA kernel (up to TINY_M rows, or a GPU without it) with one program per
    (output tile, K segment), each storing its segment's fp32 accumulator, then one launch that adds the
    segments by the tree, adds the bias and rounds. x2 [M, K] and weight [N, K] with unit stride along K.
    Each segment is accumulated by the same _segment loop as inside the in-kernel tree and the tree is the
    same, so the bits are the in-kernel tree's (tests/kernels/ checks it); the point is SEGMENTS times
    as many programs, where a decode batch's few row tiles leave most SMs idle (on an H200 Qwen3-8B's down
    projection at 16 rows went from 0.59x to 0.89x of cuBLAS, docs/log/gpu-sessions.md 2026-11-30 morning)."""
    m, k = x2.shape
    n = weight.shape[0]
    parts = torch.empty(segments, m, n, dtype=torch.float32, device=x2.device)
    bm, bn, bk, warps, stages = tile_for(m, n, x2.dtype)
    grid = (cdiv(m, bm) * cdiv(n, bn), segments)
    _matmul_kernel[grid](
        x2,
        weight,
        x2,
        parts,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        n,
        m * n,
        HAS_BIAS=False,
        IEEE=x2.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        SEGMENTS=segments,
        SPLIT_K=True,
        num_warps=warps,
        num_stages=stages,
    )
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    _segment_tree_kernel[(cdiv(m * n, SPLIT_K_BLOCK),)](
        parts,
        bias if bias is not None else parts,
        y,
        m * n,
        n,
        HAS_BIAS=bias is not None,
        SEGMENTS=segments,
        BLOCK=SPLIT_K_BLOCK,
    )
    return y


def _tma_available(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The TMA path needs a Hopper-or-newer GPU, bf16/fp16 without bias, and 16-byte aligned rows."""
    return (
        bias is None
        and x2.is_cuda
        and x2.dtype in (torch.bfloat16, torch.float16)
        and os.environ.get("ALIGNAUDIT_MATMUL_TMA", "1") != "0"
        and not fixed_tiles()
        and capability(x2.device)[0] >= 9
        and x2.shape[1] % 8 == 0
        and weight.shape[0] % 8 == 0
        and x2.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def _triton_tma(
    x2: torch.Tensor,
    weight: torch.Tensor,
    tile,
    persistent: bool = True,
    segments: int = 1,
    out_dtype: torch.dtype | None = None,
    descriptors: str | None = None,
) -> torch.Tensor:
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
            raise ValueError(
                f"strict linear: TMA descriptors need 16-byte aligned bases and rows (x "
                f"{tuple(x2.shape)}, weight {tuple(weight.shape)}, out {y.dtype})"
            )
        with descriptor_scratch(True, x2.device):
            _matmul_tma_device_kernel[(programs,)](x2, weight, y, scratch, m, n, k, programs, **meta)
    else:
        _matmul_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(x2, [bm, bk]),
            TensorDescriptor.from_tensor(weight, [bn, bk]),
            TensorDescriptor.from_tensor(y, [bm, bn]),
            scratch,
            m,
            n,
            k,
            programs,
            **meta,
        )
    return y


def _triton_tma_split(
    x2: torch.Tensor, weight: torch.Tensor, tile, segments: int, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A segmented bf16/fp16 product by _matmul_tma_split_kernel (one program per tile and segment, fp32
    partials) and _segment_tree_kernel (the tree, rounded once): the in-kernel tree's bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x2.shape
    n = weight.shape[0]
    x2, weight = x2.contiguous(), weight.contiguous()
    bm, bn, bk, warps, stages = tile
    parts = torch.empty(segments, m, n, dtype=torch.float32, device=x2.device)
    _matmul_tma_split_kernel[(cdiv(m, bm) * cdiv(n, bn), segments)](
        TensorDescriptor.from_tensor(x2, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(parts, [1, bm, bn]),
        m,
        n,
        k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        SEGMENTS=segments,
        num_warps=warps,
        num_stages=stages,
    )
    y = torch.empty(m, n, dtype=out_dtype or x2.dtype, device=x2.device)
    _segment_tree_kernel[(cdiv(m * n, SPLIT_K_BLOCK),)](
        parts, parts, y, m * n, n, HAS_BIAS=False, SEGMENTS=segments, BLOCK=SPLIT_K_BLOCK
    )
    return y
