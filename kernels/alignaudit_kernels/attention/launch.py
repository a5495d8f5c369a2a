"""How the Triton kernels run: query tiles, launch configurations, KV-cache read modes, the split-KV choice and
the launch plans of the contiguous layouts, kept on the device per shape."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from alignaudit_kernels.attention.algorithm import BLOCK_N, CHUNK_N, DEFAULT_EXP, TILE_ROWS
from alignaudit_kernels.primitives import (
    cached_tensors,
    cdiv,
    descriptor_scratch,
    next_power_of_2,
    rocm,
    sm_count,
    to_device,
    triton,
    use_triton,
)

if triton is not None:
    from alignaudit_kernels.attention.triton_kernels import _attention_kernel, _combine_kernel


def _tiles(seqs, starts, counts, per_tile: int) -> torch.Tensor:
    """Split runs of consecutive query rows (one run per sequence) into tiles of ``per_tile`` tokens.

    seqs/starts/counts [runs] (CPU ints: tensors or arrays): sequence index, first row and row count of each run.
    Returns int32 [4, tiles] (CPU): sequence, first row, row count, and index of the first row within its run.
    Planned in numpy, not in torch CPU ops: an engine plans every step on the host, where small torch ops wait on
    busy cores for torch's intra-op threads. For 32 runs on a 2-core Xeon with both cores busy, the torch form took
    1.9-9.6 ms (2 threads) or 75 us (one thread), numpy 31-79 us (2026-12-06; no GPU).
    """
    seqs, starts, counts = (np.asarray(x, dtype=np.int64) for x in (seqs, starts, counts))
    n_tiles = (counts + per_tile - 1) // per_tile
    run = np.repeat(np.arange(n_tiles.shape[0]), n_tiles)
    offset = (np.arange(run.shape[0]) - (np.cumsum(n_tiles) - n_tiles)[run]) * per_tile
    rows = np.minimum(per_tile, counts[run] - offset)
    return torch.from_numpy(np.stack([seqs[run], starts[run] + offset, rows, offset]).astype(np.int32))


def runs_of(q_seq: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence, first row, row count) of each run of equal consecutive entries of ``q_seq`` [T] (int, read on the
    host), in numpy (``_tiles``)."""
    a = q_seq.cpu().numpy()
    starts = np.flatnonzero(np.concatenate([[a.shape[0] > 0], a[1:] != a[:-1]]))
    return a[starts], starts, np.diff(np.append(starts, a.shape[0]))


# Launch configurations (query rows per tile, warps, stages). The rows of a tile only decide which queries
# a program handles; the key block BLOCK_N and the key chunk CHUNK_N are the algorithm and never change.
# Every path uses 64-row tiles: on an H200 a 16-row tile (mma.sync rather than wgmma) gave decode rows 1-2
# ULP away from the same rows of a 64-row prefill tile (bf16 and fp32, 2026-11-30).
TILE_CONFIG = (TILE_ROWS, 4, 2)


# Decode steps pipeline one more key block: 3% faster at the generation shape of bench/vllm_generate.py (64
# sequences at 640 keys, pages of 16) on an H200, with the bits of every other configuration swept there
# (stages only schedule loads; docs/log/gpu-sessions.md 2026-12-04 third session).
DECODE_CONFIG = (TILE_ROWS, 4, 3)


SPLIT_BELOW_PROGRAMS_PER_SM = 32  # fewer (tile, KV head) programs than this per SM: one program per chunk

# The most fp32 scratch a split launch may take for its chunk states (m, l and the accumulator of every stored row,
# chunk, tile and KV head). A split's programs for chunks past a row's keys do nothing, but its scratch is sized by
# the key bound: in vLLM that is max_model_len for every decode step (a CUDA graph holds it), and a long one made a
# graph's scratch tens of times the step's work (Qwen3-8B, 512 sequences at max_model_len 40960: 10.9 GB before the
# decode scratch kept only its USED rows, 0.68 GB after). Memory vLLM's profile run never sees: strict attention
# computes nothing there. Past this, the launch runs unsplit: the same bits (module docstring), fewer programs.
SPLIT_SCRATCH_BYTES = 256 * 2**20


def split_scratch_bytes(chunks: int, n_tiles: int, kv_heads: int, rows: int, block_d: int) -> int:
    """Bytes of the split path's fp32 scratch: m and l [chunks, n_tiles, kv_heads, rows] and the accumulator
    [chunks, n_tiles, kv_heads, rows, block_d], ``rows`` the stored rows of a tile (``_used_rows``)."""
    return 4 * chunks * n_tiles * kv_heads * rows * (block_d + 2)


def split_scratch(
    chunks: int, n_tiles: int, kv_heads: int, rows: int, block_d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split path's chunk states, uninitialized: m, l [chunks, n_tiles, kv_heads, rows] and acc [..., block_d],
    fp32 (``split_scratch_bytes`` in all)."""
    m = torch.empty(chunks, n_tiles, kv_heads, rows, dtype=torch.float32, device=device)
    return m, torch.empty_like(m), torch.empty(*m.shape, block_d, dtype=torch.float32, device=device)


def choose_split(chunks: int, n_tiles: int, kv_heads: int, rows: int, block_d: int, sms: int) -> bool:
    """Whether a launch splits its keys into one program per chunk: where there is more than one chunk, the (tile,
    KV head) programs alone would give each of ``sms`` SMs fewer than SPLIT_BELOW_PROGRAMS_PER_SM, and the scratch
    stays within SPLIT_SCRATCH_BYTES. Only speed and memory depend on it, never a bit."""
    return (
        chunks > 1
        and n_tiles * kv_heads < SPLIT_BELOW_PROGRAMS_PER_SM * sms
        and split_scratch_bytes(chunks, n_tiles, kv_heads, rows, block_d) <= SPLIT_SCRATCH_BYTES
    )


KV_GATHER, KV_PAGE_ALIGNED, KV_DIRECT = 0, 1, 2


def _launch(
    q,
    k_cache,
    v_cache,
    block_table,
    tiles,
    q_positions,
    scale,
    *,
    kv_mode,
    max_keys,
    config=TILE_CONFIG,
    row_pos=False,
    split=None,
    block_n=BLOCK_N,
    chunk_n=CHUNK_N,
    exp=DEFAULT_EXP,
    out=None,
    tma=False,
    ws=False,
    lse=None,
):
    """Run the Triton kernel(s).

    tiles: from ``_tiles`` (CPU, or already on q's device from a cached plan), or None for a decode step (row
    i is the one query of sequence i, and q_positions holds each sequence's key count: its seq_lens);
    q_positions: [T] on q's device, or None with ``row_pos`` (rows are whole sequences from position 0).
    max_keys: a bound on the keys any row sees (host int, sets the chunk count of the split grid); a row
    past it is NaN, and no key past it is read.
    out: [T, H, D] of q's dtype with unit stride along D to write into (vLLM's output buffer), or None.
    split: one program per (tile, KV head, chunk) and a second launch that merges the chunks (True), one
    program per (tile, KV head) merging in registers (False), or chosen by occupancy and scratch (None:
    ``choose_split``): the same bits either way. ``block_n`` / ``chunk_n`` other than BLOCK_N / CHUNK_N:
    benchmarks only (another algorithm).
    tma / ws: the whole key blocks of a KV_DIRECT launch read by the TMA unit, and that loop warp-specialized
    (``_chunk``): the same bits, a candidate for speed (bench/sweep_gpu.py --sections attention-tma); ValueError
    where the layout cannot take descriptors.
    lse: fp32 [H, T] with unit stride along T, filled with each row's log-sum-exp m + log(l) (flash_gradients),
    or None; the output's bits are the same either way.
    """
    t, h, d = q.shape
    if ws and not tma:
        raise ValueError("strict attention: warp specialization applies to the TMA loop only (pass tma=True)")
    if tma:
        _check_descriptors(k_cache, v_cache, kv_mode)
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
    block_d = max(16, next_power_of_2(d))
    used = _used_rows(decode, group, tile)
    if split is None:
        split = choose_split(chunks, n_tiles, kvh, used, block_d, sm_count(q.device) if q.is_cuda else 1)
    shared = dict(
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        TILE=tile,
        CHUNK_N=chunk_n,
        ROW_POS=row_pos,
        DECODE=decode,
        NATIVE_EXP=exp == "native",
        USED=used,
    )
    if lse is not None and (
        lse.shape != (h, t) or lse.dtype != torch.float32 or lse.stride(1) != 1 or (h > 1 and lse.stride(0) < t)
    ):
        raise ValueError(
            f"strict attention: lse {tuple(lse.shape)} {lse.dtype} stride {lse.stride()} must be fp32 "
            f"[{h}, {t}] with unit stride along the rows and heads that do not overlap"
        )
    lse_args = (out, 0, False) if lse is None else (lse, lse.stride(0), True)  # (pointer, head stride, LSE)
    if split:
        m, l, acc = split_scratch(chunks, n_tiles, kvh, used, block_d, q.device)
    else:
        m = l = acc = out  # not read
    # ONE_CHUNK only for whole-sequence prefill, whose max_keys is exact per call: a paged launch's bound grows during
    # generation, and crossing CHUNK_N there would build a second kernel inside a timed step
    with descriptor_scratch(tma, q.device):
        _attention_kernel[(n_tiles, kvh, chunks if split else 1)](
            q,
            k_cache,
            v_cache,
            out,
            lse_args[0],
            positions,
            block_table,
            tiles,
            m,
            l,
            acc,
            n_tiles,
            max_keys,
            k_cache.shape[0],
            float(scale),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            lse_args[1],
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_table.stride(0),
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32,
            KV=kv_mode,
            SPLIT=split,
            **shared,
            TMA=tma,
            WS=ws,
            ONE_CHUNK=row_pos and chunks == 1,
            LSE=lse_args[2] and not split,
            num_warps=warps,
            num_stages=stages,
            enable_fp_fusion=False,
        )
    if split:
        _combine_kernel[(n_tiles, kvh)](
            out,
            lse_args[0],
            positions,
            tiles,
            m,
            l,
            acc,
            n_tiles,
            max_keys,
            chunks,
            out.stride(0),
            out.stride(1),
            lse_args[1],
            **shared,
            LSE=lse_args[2],
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out


def _check_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_mode: int) -> None:
    """ValueError unless K and V can be read as [rows, KV heads x head_dim] matrices by the TMA unit: contiguous
    one-token pages (KV_DIRECT), a power-of-two head_dim (the block is the head, nothing of the next head
    read), 16-byte aligned bases and row strides (CUDA's cuTensorMapEncodeTiled rules)."""
    d = k_cache.shape[-1]
    for name, x in (("k", k_cache), ("v", v_cache)):
        row_bytes = x.stride(0) * x.element_size()
        if (
            kv_mode != KV_DIRECT
            or x.shape[1] != 1
            or d < 16
            or d & (d - 1)
            or x.stride(2) != d
            or x.data_ptr() % 16
            or row_bytes % 16
        ):
            raise ValueError(
                f"strict attention: TMA reads need contiguous pages of one token, a power-of-two "
                f"head_dim of at least 16 and 16-byte aligned rows ({name}: shape {tuple(x.shape)}, "
                f"strides {x.stride()}, head_dim {d})"
            )


def _used_rows(decode: bool, group: int, tile: int) -> int:
    """Rows of a tile that can hold a query: a decode tile holds one token, its ``group`` heads (rounded up
    to a power of two); any other tile, all of them."""
    return min(tile, next_power_of_2(group)) if decode else tile


def _check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless k_cache and v_cache are [blocks, block_size, KVH, D] alike, with q's head_dim D and a KVH
    that divides q's heads, and, on the Triton backends, unit stride along D (the kernel steps by one element
    there; blocks, slots and heads may have any strides)."""
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"strict attention: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must "
            f"be [blocks, block_size, kv_heads, {q.shape[-1]}] alike, kv_heads dividing q's {q.shape[1]}"
        )
    if use_triton(q) and (k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):
        raise ValueError(
            f"strict attention: k_cache and v_cache need unit stride along head_dim (strides "
            f"{k_cache.stride()} and {v_cache.stride()}); lay the cache out with head_dim innermost"
        )


def _kv_mode(k_cache: torch.Tensor) -> int:
    return KV_PAGE_ALIGNED if k_cache.shape[1] % BLOCK_N == 0 else KV_GATHER


@dataclass(frozen=True)
class QueryTiles:
    """The query tiles of a paged_attention call: which rows each GPU program computes.

    Attributes:
        tiles: int32 [4, tiles] on the queries' device (``_tiles``: sequence, first row, row count, row in its run).
        group: the query heads per KV head it was planned for (a tile holds TILE_ROWS // group tokens).
        rows: the query rows it covers (the kernel reads and writes the rows its tiles name, unchecked).
    """

    tiles: torch.Tensor
    group: int
    rows: int


def paged_tiles(q_seq: torch.Tensor, group: int, device: torch.device) -> QueryTiles:
    """The query tiles of ``paged_attention`` over rows whose sequences are ``q_seq`` [T] (int, rows of one
    sequence consecutive; read on the host: a CPU tensor costs no synchronization), for ``group`` query heads per
    KV head, copied to ``device``. An engine plans once per step and passes the plan to every layer's call
    (``paged_attention(tiles=...)``): the same tiles each layer would plan, without each layer's host work and
    host-to-device copy. On CUDA the copy leaves from pinned memory, so the host does not wait for it."""
    tiles = _tiles(*runs_of(q_seq), TILE_CONFIG[0] // group)
    return QueryTiles(to_device(tiles, device), group, q_seq.shape[0])


def _check_tiles(tiles: QueryTiles | None, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """ValueError for query tiles planned for another number of query rows than q's, or of query heads per KV head
    than q's over k_cache's."""
    if tiles is None:
        return
    group = q.shape[1] // k_cache.shape[2]
    if tiles.rows != q.shape[0] or tiles.group != group:
        raise ValueError(
            f"strict attention: query tiles planned for {tiles.rows} rows at {tiles.group} query heads "
            f"per KV head, used for {q.shape[0]} rows at {group}; plan them with paged_tiles for these "
            "rows and this layer's heads"
        )


def _triton_paged(
    q,
    k_cache,
    v_cache,
    block_table,
    q_positions,
    q_seq,
    scale,
    exp=DEFAULT_EXP,
    max_keys=None,
    out=None,
    tiles: QueryTiles | None = None,
):
    group = q.shape[1] // k_cache.shape[2]
    if tiles is None:
        tiles = paged_tiles(q_seq, group, q.device)
    table = block_table.to(device=q.device, dtype=torch.int32).contiguous()
    if max_keys is None:
        max_keys = int(q_positions.max()) + 1
    return _launch(
        q,
        k_cache,
        v_cache,
        table,
        tiles.tiles,
        q_positions.to(q.device),
        scale,
        kv_mode=_kv_mode(k_cache),
        max_keys=max_keys,
        exp=exp,
        out=out,
    )


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


def _check_out(q, out):
    """``out`` if it can hold the result for q (same shape and dtype, unit stride along head_dim: what the
    Triton kernel writes through), else ValueError; a new tensor for None."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"strict attention: out {tuple(out.shape)} {out.dtype} stride {out.stride()} cannot hold "
            f"q {tuple(q.shape)} {q.dtype} (same shape and dtype, unit stride along head_dim)"
        )
    return out


def _launch_varlen(
    q,
    k,
    v,
    cu_seqlens,
    scale,
    config=TILE_CONFIG,
    block_n=BLOCK_N,
    chunk_n=CHUNK_N,
    exp=DEFAULT_EXP,
    split=None,
    tma=False,
    ws=False,
    lse=None,
):
    """GPU prefill of whole sequences. Each sequence's keys are consecutive rows of k/v: one-token pages,
    the first page at the sequence's start, so nothing is copied. lse: as ``_launch``."""
    tiles, table, max_keys = _varlen_plan(tuple(cu_seqlens.tolist()), config[0] // (q.shape[1] // k.shape[1]), q.device)
    return _launch(
        q,
        _as_pages(k),
        _as_pages(v),
        table,
        tiles,
        None,
        scale,
        kv_mode=KV_DIRECT,
        row_pos=True,
        max_keys=max_keys,
        config=config,
        block_n=block_n,
        chunk_n=chunk_n,
        exp=exp,
        split=split,
        tma=tma,
        ws=ws,
        lse=lse,
    )
