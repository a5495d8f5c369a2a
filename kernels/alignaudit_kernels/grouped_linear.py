"""Grouped strict linear for mixture-of-experts dispatch: the (token, slot) pairs sorted by expert, each expert's
rows times that expert's weight, in one launch, with every routing-dependent quantity on the device.

Why: the gathered dispatch (kernels/alignaudit_kernels/moe.py) reads the routing on the host
(``torch.unique(...).tolist()``, ``nonzero``), which synchronizes every layer and which a CUDA graph cannot capture;
computing every expert for every token is capturable but does E / top_k times the work. This is the layout of vLLM's
fused MoE (``moe_align_block_size``: rows sorted by expert, each row tile owned by one expert;
vllm/model_executor/layers/fused_moe/), with the arithmetic of alignaudit_kernels.linear:

    plan       pairs p = t * top_k + r of ``chosen`` [T, top_k], sorted by expert (stable, so within an expert in
               increasing p: the order ``(chosen == e).nonzero()`` gives the gathered dispatch); expert e owns
               the sorted rows [start_e, start_{e+1}) and cdiv(count_e, BLOCK_M) row tiles; a fixed number of
               tiles (an upper bound of that sum, from T, top_k, E and BLOCK_M alone) is launched and the tiles
               past the sum return at once. One Triton launch (plan_experts_triton: a histogram, a prefix sum of
               a mask); plan_experts computes the same plan with torch.sort, searchsorted and cumsum. No host read.
    product    each output tile by matmul.triton_kernels._segment, the K loop of the pointer kernel (K increasing,
               tl.dot into one fp32 accumulator, IEEE products for fp32), on the expert's weight, at one of linear's
               tiles chosen by the mean rows per expert (grouped_tile); rounded once to x.dtype. A row's bits should be
               the strict linear's for that row: on an H200 the tensor cores' K order did not depend on the tile
               or the row's place in it for linear (bench/sweep_gpu.py, docs/benchmarks.md). Checked bit for bit
               against the gathered dispatch under the Triton interpreter and on an H200
               (tests/kernels/test_moe_kernel.py: bf16/fp16/fp32, and replayed from a captured CUDA graph;
               2026-12-05), every SWEEP_TILES tile on an H100 (bench/moe_gpu.py --tiles, 2026-12-05).
    ids        an expert id outside [0, E) is never covered by a tile: its rows come out NaN (the gathered
               dispatch raises IndexError; reading the ids on the host would end capturability).

Triton only (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), where it is the default dispatch; the CPU
backend keeps the gathered dispatch, which never runs in a CUDA graph. Forward only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignaudit_kernels.matmul.launch import TILES, fixed_tiles, tile_for
from alignaudit_kernels.primitives import cdiv, next_power_of_2, triton

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): launch tiles other than linear's choice, each with the same K loop, that
# bench/moe_gpu.py --tiles times and tests/kernels/test_moe_kernel.py checks bit for bit on a GPU (bf16/fp16)
SWEEP_TILES = (
    (16, 32, 128, 4, 3),
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
)


@dataclass(frozen=True)
class ExpertPlan:
    """Where each expert's rows sit once the (token, slot) pairs are sorted by expert. All tensors int64 on
    the routing's device; P = T * top_k pairs, G = ``tiles`` launched row tiles.

    pair: [P] the flat pair index t * top_k + r of sorted row i (stable: increasing within an expert).
    token: [P] the token of sorted row i (pair // top_k): the row of x that sorted row i reads.
    starts: [E + 1] sorted rows [starts[e], starts[e + 1]) belong to expert e.
    tile_expert: [G] the expert owning row tile g; E for the tiles past the last expert's (they do nothing).
    tile_row: [G] the first sorted row of tile g.
    block_m: rows per tile. tiles: G, fixed by (P, E, block_m), never by the routing. top_k: slots per token.
    """

    pair: torch.Tensor
    token: torch.Tensor
    starts: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    block_m: int
    tiles: int
    top_k: int


def tile_bound(pairs: int, experts: int, block_m: int) -> int:
    """The most row tiles ``pairs`` rows over ``experts`` experts can need: sum_e cdiv(c_e, B) over the
    non-empty experts (at most min(E, P) of them) is at most (P + min(E, P) * (B - 1)) // B."""
    return (pairs + min(experts, pairs) * (block_m - 1)) // block_m


def _check_plan(chosen: torch.Tensor, block_m: int, name: str) -> None:
    if chosen.dim() != 2 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(
            f"{name}: chosen must be [T, top_k] and block_m a power of two, got {tuple(chosen.shape)}, {block_m}"
        )


def plan_experts(chosen: torch.Tensor, num_experts: int, block_m: int) -> ExpertPlan:
    """The device-side dispatch plan of ``chosen`` [T, top_k] (int expert ids in [0, num_experts)) for row
    tiles of ``block_m`` rows. Capturable by a CUDA graph: no host read of ``chosen``.

    Raises:
        ValueError: ``chosen`` not 2-D, or block_m not a power of two (a Triton block).
    """
    _check_plan(chosen, block_m, "plan_experts")
    top_k = chosen.shape[1]
    device = chosen.device
    sorted_expert, pair = torch.sort(chosen.reshape(-1).to(torch.int64), stable=True)
    starts = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=device))
    counts = starts[1:] - starts[:-1]
    tiles_of = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_of, 0)
    tiles = tile_bound(pair.numel(), num_experts, block_m)
    g = torch.arange(tiles, device=device)
    tile_expert = torch.searchsorted(tile_end, g, right=True)
    owner = tile_expert.clamp(max=num_experts - 1)
    tile_row = starts[owner] + (g - (tile_end[owner] - tiles_of[owner])) * block_m
    return ExpertPlan(
        pair, torch.div(pair, top_k, rounding_mode="floor"), starts, tile_expert, tile_row, block_m, tiles, top_k
    )


def plan_experts_triton(chosen: torch.Tensor, num_experts: int, block_m: int) -> ExpertPlan:
    """``plan_experts`` in one Triton launch instead of about fifteen torch launches (sort, searchsorted, cumsum,
    gathers): the grouped dispatch's plan (moe._grouped). In graph replays at the Qwen3-30B-A3B layer on an H100
    it took 0.0044 / 0.0047 / 0.0098 / 0.0598 ms at 8 / 64 / 512 / 4096 tokens against plan_experts' 0.0415 /
    0.0618 / 0.0701 / 0.103, every field equal (bench/moe_gpu.py, docs/log/gpu-sessions.md 2026-12-05 eighth session).
    Program e < E counts every expert's pairs with tl.histogram, places expert e's pairs at starts[e] + their rank
    by increasing pair index (a prefix sum of a mask, chunk by chunk), and writes its row tiles; program E places
    pairs whose id is outside [0, E) after starts[E] (their rows are never covered: NaN, as plan_experts leaves
    them) and writes the tiles past the last expert's as plan_experts does. For ids in [0, E) every field equals
    plan_experts' (tests/kernels/test_moe_kernel.py); for others ``starts[0]`` is 0 where plan_experts counts the
    negative ids before it.

    Raises:
        ValueError: as plan_experts, or without the Triton backend.
    """
    _check_plan(chosen, block_m, "plan_experts_triton")
    if triton is None:
        raise ValueError("plan_experts_triton needs Triton (a CUDA tensor, or TRITON_INTERPRET=1)")
    top_k = chosen.shape[1]
    ids = chosen.reshape(-1).to(torch.int64).contiguous()
    pairs = ids.numel()
    tiles = tile_bound(pairs, num_experts, block_m)
    new = lambda n: torch.empty(n, dtype=torch.int64, device=chosen.device)  # noqa: E731
    pair, token, starts, tile_expert, tile_row = new(pairs), new(pairs), new(num_experts + 1), new(tiles), new(tiles)
    _plan_kernel[(num_experts + 1,)](
        ids,
        pair,
        token,
        starts,
        tile_expert,
        tile_row,
        pairs,
        num_experts,
        top_k,
        tiles,
        BINS=next_power_of_2(num_experts),
        BLOCK_M=block_m,
        BLOCK=1024,
    )
    return ExpertPlan(pair, token, starts, tile_expert, tile_row, block_m, tiles, top_k)


# Mean rows per expert from which the grouped products launch 128 x 128 tiles (TILES' "small_wide"). bench/moe_gpu.py
# --tiles, Qwen3-30B-A3B layer, graph replays, H100 2026-12-05 (docs/log/gpu-sessions.md): at 256 rows an expert
# 128x128x64 (8 warps) 1.262 ms against linear's 64x64x64 1.673 (vLLM's fused MoE 0.977); at 32 rows 64x64x64 stays the
# fastest (0.562 against 0.570), at 4 and 0.5 rows linear's 16-row tile. Every swept tile gave the same bits. 128 lies
# between the measured 32 and 256 (not itself measured), and nothing above 256 rows an expert was.
TALL_ROWS = 128


def grouped_tile(pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a layer's grouped products, from the mean rows per expert:
    TILES' "small_wide" from TALL_ROWS rows, linear's tile (tile_for) below, and linear's one tile at every size
    under ALIGNAUDIT_MATMUL_TILES=fixed. One plan serves the layer's products, so the tile does not depend on
    their widths."""
    rows = cdiv(pairs, num_experts)
    return TILES[dtype]["small_wide"] if rows >= TALL_ROWS and not fixed_tiles() else tile_for(rows, 0, dtype)


def block_m_for(pairs: int, num_experts: int, dtype: torch.dtype) -> int:
    """The row-tile height of a layer's grouped products (grouped_tile's BLOCK_M)."""
    return grouped_tile(pairs, num_experts, dtype)[0]


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, plan: ExpertPlan, gather: bool, tile=None, scatter: bool = False
) -> torch.Tensor:
    """Sorted row i of the result is ``linear(src_i, weight[e_i])`` for the expert e_i owning it (with ``scatter``,
    row plan.pair[i] of the result: the routing's pair order).

    Args:
        x: [R, K] bf16/fp16/fp32. With ``gather``, the T tokens of the routing (sorted row i reads
            x[plan.token[i]]); without, already in sorted order (R = P: the previous grouped product's output).
        weight: [E, N, K] in x.dtype, each expert's matrix with unit stride along K.
        plan: plan_experts (or plan_experts_triton) of the routing, with block_m = the tile height used here.
        tile: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) to launch with instead of grouped_tile's (benchmarks:
            bench/moe_gpu.py --tiles); BLOCK_M must be plan.block_m. The K loop is the
            same at every tile, so on a GPU whose tensor cores keep their K order across tiles the bits are too.
        scatter: store each row at its pair's place (row t * top_k + r) instead of its sorted place: what
            ``torch.empty_like(y).index_copy_(0, plan.pair, y)`` of the sorted result gives, in the same launch.
    Returns:
        [P, N] in x.dtype, in sorted-row order (pair order with ``scatter``); NaN rows for expert ids outside
        [0, E) (module docstring).
    Raises:
        ValueError: shapes or dtypes that do not match, a tile whose height is not the plan's, or the Triton backend
            unavailable.
    """
    if triton is None:
        raise ValueError("grouped_linear needs Triton (a CUDA tensor, or TRITON_INTERPRET=1)")
    experts, n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != weight.dtype or plan.starts.numel() != experts + 1:
        raise ValueError(
            f"grouped_linear: x {x.dtype}{tuple(x.shape)}, weight {weight.dtype}{tuple(weight.shape)}, "
            f"plan over {plan.starts.numel() - 1} experts"
        )
    pairs = plan.pair.numel()
    if x.shape[0] * (plan.top_k if gather else 1) != pairs:
        raise ValueError(
            f"grouped_linear: x has {x.shape[0]} rows for a plan of {pairs} pairs (top_k {plan.top_k}, gather={gather})"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(2) == 1 else weight.contiguous()
    bm, bn, bk, warps, stages = tile or grouped_tile(pairs, experts, x.dtype)
    if bm != plan.block_m:
        raise ValueError(
            f"grouped_linear: a tile of {bm} rows for a plan of {plan.block_m}-row tiles"
            + ("" if tile else "; plan with block_m_for(pairs, experts, dtype)")
        )
    y = torch.full((pairs, n), float("nan"), dtype=x.dtype, device=x.device)  # rows no tile covers stay NaN
    if plan.tiles == 0:
        return y
    tiles_n = cdiv(n, bn)
    _grouped_kernel[(plan.tiles * tiles_n,)](
        x,
        weight,
        y,
        plan.token,
        plan.pair,
        plan.starts,
        plan.tile_expert,
        plan.tile_row,
        x.shape[0],
        n,
        k,
        experts,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        GATHER=gather,
        SCATTER=scatter,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=plan.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return y


if triton is not None:
    import triton.language as tl

    from alignaudit_kernels.matmul.triton_kernels import _segment

    @triton.jit(do_not_specialize=["rows_x"])
    def _grouped_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        token_ptr,
        pair_ptr,
        starts_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        rows_x,
        N,
        K,
        E,
        stride_xm,
        stride_we,
        stride_wn,
        stride_ym,
        GATHER: tl.constexpr,
        SCATTER: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Program (g, j): row tile g (one expert's rows) times that expert's column tile j."""
        tiles_n = tl.cdiv(N, BLOCK_N)
        g = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        e = tl.load(tile_expert_ptr + g)
        if e < E:
            rows = tl.load(tile_row_ptr + g) + tl.arange(0, BLOCK_M)
            live = rows < tl.load(starts_ptr + e + 1)
            if GATHER:
                src = tl.load(token_ptr + rows, mask=live, other=0)
            else:
                src = rows
            src = tl.where(live, src, rows_x).to(tl.int64)  # row rows_x is past x: _segment's mask zero-fills it
            rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            acc = _segment(
                x_ptr,
                w_ptr + e.to(tl.int64) * stride_we,
                src,
                rn,
                0,
                K,
                rows_x,
                N,
                stride_xm,
                stride_wn,
                IEEE,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            if SCATTER:
                dst = tl.load(pair_ptr + rows, mask=live, other=0).to(tl.int64)
            else:
                dst = rows.to(tl.int64)
            tl.store(
                y_ptr + dst[:, None] * stride_ym + rn[None, :],
                acc.to(y_ptr.dtype.element_ty),
                mask=live[:, None] & (rn[None, :] < N),
            )

    @triton.jit
    def _plan_kernel(
        ids_ptr,
        pair_ptr,
        token_ptr,
        starts_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        P,
        E,
        top_k,
        G,
        BINS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program e < E: expert e's pairs and row tiles; program E: the pairs of no expert and the spare tiles."""
        e = tl.program_id(0)
        bins = tl.arange(0, BINS)
        hist = tl.zeros([BINS], dtype=tl.int32)
        for start in range(0, P, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
            valid = (offs < P) & (x >= 0) & (x < E)
            hist += tl.histogram(tl.where(valid, x, 0).to(tl.int32), BINS, mask=valid)
        tiles_of = (hist + BLOCK_M - 1) // BLOCK_M
        below = bins < e
        first = tl.sum(tl.where(below, hist, 0), axis=0)  # sorted row where expert e's pairs start
        first_tile = tl.sum(tl.where(below, tiles_of, 0), axis=0)
        mine = tl.sum(tl.where(bins == e, hist, 0), axis=0)
        tl.store(starts_ptr + e, first.to(tl.int64))
        placed = first
        for start in range(0, P, BLOCK):  # each pair of the program's kind at its place, in increasing pair order
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(ids_ptr + offs, mask=offs < P, other=0)
            if e < E:
                take = (offs < P) & (x == e)
            else:
                take = (offs < P) & ((x < 0) | (x >= E))
            rank = tl.cumsum(take.to(tl.int32), axis=0) - 1
            where = (placed + rank).to(tl.int64)
            tl.store(pair_ptr + where, offs.to(tl.int64), mask=take)
            tl.store(token_ptr + where, (offs // top_k).to(tl.int64), mask=take)
            placed += tl.sum(take.to(tl.int32), axis=0)
        if e < E:
            own = (mine + BLOCK_M - 1) // BLOCK_M
            for t0 in range(0, own, BLOCK):
                j = t0 + tl.arange(0, BLOCK)
                tl.store(tile_expert_ptr + first_tile + j, tl.full([BLOCK], 0, tl.int64) + e, mask=j < own)
                tl.store(tile_row_ptr + first_tile + j, (first + j * BLOCK_M).to(tl.int64), mask=j < own)
        else:  # past the last expert's tiles: owner E, rows as plan_experts computes them (never read)
            last = bins == E - 1
            last_first = tl.sum(tl.where(bins < E - 1, hist, 0), axis=0)
            last_tiles = tl.sum(tl.where(last, tiles_of, 0), axis=0)
            for t0 in range(first_tile, G, BLOCK):
                g = t0 + tl.arange(0, BLOCK)
                tl.store(tile_expert_ptr + g, tl.full([BLOCK], 0, tl.int64) + E, mask=g < G)
                tl.store(
                    tile_row_ptr + g, (last_first + (g - first_tile + last_tiles) * BLOCK_M).to(tl.int64), mask=g < G
                )
