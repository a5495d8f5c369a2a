"""The matmul sections of bench/sweep_gpu.py (matmul, tma, segments, small-m, medium-m, issue19): the tiles each
sweeps and its sweep at Qwen3-8B's linear shapes; and try_config, which checks, times and records one candidate
(sweep_gpu.py's attention-tma and rmsnorm-rows use it too). Not a script: run the sections by
`python3 bench/sweep_gpu.py --sections ...` (its docstring tells each).
"""

from __future__ import annotations

import torch

from alignaudit_kernels import matmul
from alignaudit_kernels.matmul import launch
from bench.timing import graph_ms, ms

DT = torch.bfloat16
MATMUL_TILES = [
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (16, 32, 64, 4, 4),
    (16, 64, 64, 4, 4),
    (32, 32, 64, 4, 4),
    (16, 32, 64, 2, 4),
    (16, 16, 64, 2, 4),
    (16, 32, 128, 4, 3),
]
SMALL = 4  # index of the 64x64 tile, the one a single row is checked in


def sweep_matmul(rows):
    x = torch.randn(300, 4096, dtype=DT, device="cuda")
    w = torch.randn(6144, 4096, dtype=DT, device="cuda") * 0.02
    outs = [launch._triton(x, w, None, tile=t) for t in MATMUL_TILES]
    same = [torch.equal(outs[0], o) for o in outs]
    one = launch._triton(x[:1], w, None, tile=MATMUL_TILES[SMALL])
    same_row = torch.equal(one[0], outs[0][0])
    print(
        f"matmul: bits equal across tiles {same}; row alone in the small tile == in the big tile: {same_row}",
        flush=True,
    )
    for k, n in ((4096, 6144), (4096, 24576), (12288, 4096)):
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        for m in (1, 16, 256, 4096):
            x = torch.randn(m, k, dtype=DT, device="cuda")
            base = ms(lambda: torch.nn.functional.linear(x, w))
            for t in MATMUL_TILES:
                strict = ms(lambda: launch._triton(x, w, None, tile=t))
                rows.append(
                    {
                        "op": f"matmul {k}x{n}",
                        "M": m,
                        "config": list(t),
                        "default_ms": base,
                        "strict_ms": strict,
                        "ratio": base / strict,
                    }
                )
    return {"tiles_bitwise_equal": all(same), "small_vs_large_row_equal": same_row}


TMA_TILES = [
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
]


def try_config(rows, same, fn, expected, timer, **row):
    """Check ``fn``'s bits against ``expected`` (into ``same``; None: no check), time it with ``timer`` and add
    ``row`` with the time and ratio; a configuration that does not compile or fit is printed and skipped."""
    try:
        if expected is not None:
            same.append(torch.equal(fn(), expected))
        strict = timer(fn)
    except Exception as e:  # noqa: BLE001 - a sweep reports what failed and goes on
        print(f"{row['op']} M={row['M']} {row['config']}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return
    rows.append({**row, "strict_ms": strict, "ratio": row["default_ms"] / strict})


def sweep_matmul_tma(rows):
    """The TMA-descriptor kernel (plain and persistent) at large M, against cuBLAS and for equal bits."""
    same = []
    for k, n, m in (
        (4096, 6144, 4096),
        (4096, 24576, 4096),
        (12288, 4096, 4096),
        (4096, 24576, 256),
        (4096, 4096, 16384),
    ):
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        x = torch.randn(m, k, dtype=DT, device="cuda")
        expected = launch._triton(x, w, None, tile=launch.TILES[DT]["large"])  # the pointer kernel
        base = ms(lambda: torch.nn.functional.linear(x, w))
        for t in TMA_TILES:
            for persistent in (False, True):
                try_config(
                    rows,
                    same,
                    lambda: launch._triton_tma(x, w, t, persistent),
                    expected,
                    ms,
                    op=f"matmul-tma {k}x{n}",
                    M=m,
                    config=[*t, "persistent" if persistent else "grid"],
                    default_ms=base,
                )
    print(f"tma: bits equal to the pointer kernel {all(same)} ({len(same)} checks)", flush=True)
    return {"tma_bitwise_equal_to_pointer_kernel": all(same)}


SEGMENT_TMA_TILES = [
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 64, 4, 6),
]


def sweep_segments(rows):
    """The row-parallel layers' K-segmented product (ROW_PARALLEL_SEGMENTS, the tree of
    kernels/alignaudit_kernels/matmul/) at Qwen3-8B's o and down shapes, every way it can run, as CUDA-graph replays:
    the tree inside one pointer-kernel program (the reference bits), one program per (tile, segment) plus a tree launch
    (_split_k), and the TMA kernel with scratch tiles (tiles, grid or persistent); beside cuBLAS and the unsegmented
    strict product."""
    s = matmul.ROW_PARALLEL_SEGMENTS
    same = []
    for k, n in ((4096, 4096), (12288, 4096)):
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        for m in (16, 256, 4096):
            x = torch.randn(m, k, dtype=DT, device="cuda")
            expected = launch._triton(x, w, None, tile=launch.tile_for(m, n, DT), segments=s)
            base = graph_ms(lambda: torch.nn.functional.linear(x, w))
            ways = {
                "unsegmented (strict, default path)": lambda: launch._triton(x, w, None),
                "in-kernel tree (pointer)": lambda: launch._triton(
                    x, w, None, tile=launch.tile_for(m, n, DT), segments=s
                ),
                "split_k": lambda: launch._split_k(x, w, None, s, None),
                "default path": lambda: launch._triton(x, w, None, segments=s),
            }
            for t in SEGMENT_TMA_TILES:
                for persistent in (False, True):
                    ways[f"tma {t} {'persistent' if persistent else 'grid'}"] = lambda t=t, persistent=persistent: (
                        launch._triton_tma(x, w, t, persistent, segments=s)
                    )
            for name, fn in ways.items():
                try_config(
                    rows,
                    same,
                    fn,
                    None if name.startswith("unsegmented") else expected,
                    graph_ms,
                    op=f"matmul {k}x{n} {s} K segments (graph)",
                    M=m,
                    config=name,
                    default_ms=base,
                )
    print(f"segments: every way gives the in-kernel tree's bits {all(same)} ({len(same)} checks)", flush=True)
    return {"segments_bitwise_equal": all(same)}


SMALL_M_TMA_TILES = [
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 6),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (64, 64, 64, 4, 4),
]


def sweep_small_m(rows):
    """M = 256 (a prefill chunk or a large decode batch) for the unsegmented layers: the pointer kernel's tile
    for that size, the default path (the TMA plan) and the TMA kernel at other tiles, as CUDA-graph replays,
    bits against the pointer kernel's."""
    same = []
    m = 256
    for k, n in ((4096, 6144), (4096, 24576), (4096, 151936)):
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        x = torch.randn(m, k, dtype=DT, device="cuda")
        pointer_tile = launch.tile_for(m, n, DT)
        expected = launch._triton(x, w, None, tile=pointer_tile)
        base = graph_ms(lambda: torch.nn.functional.linear(x, w))
        row = {"op": f"matmul {k}x{n} (graph)", "M": m, "default_ms": base}
        try_config(
            rows,
            same,
            lambda: launch._triton(x, w, None, tile=pointer_tile),
            None,
            graph_ms,
            config=f"pointer {pointer_tile}",
            **row,
        )
        try_config(rows, same, lambda: launch._triton(x, w, None), expected, graph_ms, config="default path", **row)
        for t in SMALL_M_TMA_TILES:
            for persistent in (False, True):
                try_config(
                    rows,
                    same,
                    lambda t=t, persistent=persistent: launch._triton_tma(x, w, t, persistent),
                    expected,
                    graph_ms,
                    config=f"tma {t} {'persistent' if persistent else 'grid'}",
                    **row,
                )
    print(f"small-m: TMA bits equal to the pointer kernel {all(same)} ({len(same)} checks)", flush=True)
    return {"small_m_tma_bitwise_equal": all(same)}


MEDIUM_M_POINTER_TILES = [(16, 32, 128, 4, 3), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4)]
MEDIUM_M_TMA_TILES = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 6), (128, 128, 64, 8, 6)]


def sweep_medium_m(rows):
    """M = 32, 64 and 128 (decode batches above the 16-row class), where the small-class TMA plans measured
    0.41-0.69 of cuBLAS on 2026-11-30: every Qwen3-8B layer (o and down with their K segments) by the
    pointer kernel at small tiles, by _split_k for the segmented ones, and by the TMA kernel, as CUDA-graph
    replays; bits against the pointer kernel's largest tile (candidates for a third batch-size class)."""
    same = []
    s = matmul.ROW_PARALLEL_SEGMENTS
    for k, n, segments in ((4096, 6144, 1), (4096, 4096, s), (4096, 24576, 1), (12288, 4096, s), (4096, 151936, 1)):
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        for m in (32, 64, 128):
            x = torch.randn(m, k, dtype=DT, device="cuda")
            expected = launch._triton(x, w, None, tile=launch.TILES[DT]["large"], segments=segments)
            base = graph_ms(lambda: torch.nn.functional.linear(x, w))
            row = {
                "op": f"matmul {k}x{n}" + (f" {segments} K segments" if segments > 1 else "") + " (graph)",
                "M": m,
                "default_ms": base,
            }
            ways = {"default path": lambda: launch._triton(x, w, None, segments=segments)}
            for t in MEDIUM_M_POINTER_TILES:
                ways[f"pointer {t}"] = lambda t=t: launch._triton(x, w, None, tile=t, segments=segments)
            if segments > 1:
                ways["split_k"] = lambda: launch._split_k(x, w, None, segments, None)
            for t in MEDIUM_M_TMA_TILES:
                for persistent in (False, True):
                    ways[f"tma {t} {'persistent' if persistent else 'grid'}"] = lambda t=t, persistent=persistent: (
                        launch._triton_tma(x, w, t, persistent, segments=segments)
                    )
            for name, fn in ways.items():
                try_config(rows, same, fn, expected, graph_ms, config=name, **row)
    print(f"medium-m: every way gives the pointer kernel's bits {all(same)} ({len(same)} checks)", flush=True)
    return {"medium_m_bitwise_equal": all(same)}


ISSUE19_TMA_TILES = [
    (128, 128, 64, 8, 6),
    (64, 128, 64, 4, 6),
    (64, 64, 64, 4, 6),
    (64, 64, 64, 4, 8),
    (64, 32, 64, 4, 8),
    (64, 64, 128, 4, 4),
]
ISSUE19_SPLIT_TILES = [(64, 128, 64, 4, 6), (64, 64, 64, 4, 6), (64, 64, 64, 4, 8), (128, 128, 64, 8, 6)]


def sweep_issue19(rows):
    """Candidates for issue [19]'s linear targets (every Qwen3-8B layer, M = 32-256 and 4096), as CUDA-graph
    replays, each with its bits checked against the pointer kernel's (tree inside one program): unsegmented
    qkv and gate_up by the TMA kernel at narrower tiles (more programs at small M); the segmented o and
    down by the TMA kernel with one program per (tile, segment) plus the tree launch (_triton_tma_split).
    The 2026-12-02 run also swept a kernel with one flattened (tile, segment) loop (at 1fca074, since removed:
    slower at M = 4096 and below; docs/benchmarks.md)."""
    same = []
    s = matmul.ROW_PARALLEL_SEGMENTS
    for name, k, n, segments in (
        ("qkv", 4096, 6144, 1),
        ("gate_up", 4096, 24576, 1),
        ("o", 4096, 4096, s),
        ("down", 12288, 4096, s),
    ):
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        for m in (32, 64, 128, 256, 4096):
            if segments == 1 and m == 4096:
                continue
            x = torch.randn(m, k, dtype=DT, device="cuda")
            expected = launch._triton(x, w, None, tile=launch.TILES[DT]["large"], segments=segments)
            base = graph_ms(lambda: torch.nn.functional.linear(x, w))
            row = {
                "op": f"{name} {k}x{n}" + (f" {segments} seg" if segments > 1 else "") + " (graph)",
                "M": m,
                "default_ms": base,
            }
            ways = {"default path": lambda: launch._triton(x, w, None, segments=segments)}
            for t in ISSUE19_TMA_TILES if m <= 256 else ():
                for persistent in (False, True):
                    ways[f"tma {t} {'persistent' if persistent else 'grid'}"] = lambda t=t, persistent=persistent: (
                        launch._triton_tma(x, w, t, persistent, segments=segments)
                    )
            if segments > 1:
                for t in ISSUE19_SPLIT_TILES if m <= 256 else ():
                    ways[f"tma-split {t}"] = lambda t=t: launch._triton_tma_split(x, w, t, segments)
            for way, fn in ways.items():
                try_config(rows, same, fn, expected, graph_ms, config=way, **row)
    print(
        f"issue19: every way gives the pointer kernel's bits {all(same)} ({len(same)} checks, "
        f"{same.count(False)} unequal)",
        flush=True,
    )
    return {"issue19_bitwise_equal": all(same), "issue19_checks": len(same), "issue19_unequal": same.count(False)}
