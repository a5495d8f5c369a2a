"""Strict kernels, the strict linear: batch invariance across batch-size classes and launch tiles, K segments and
tensor-parallel partials, accuracy against fp64, and the stock matmul as the negative control.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import alignaudit_kernels as K
from alignaudit_kernels import matmul
from alignaudit_kernels.matmul import launch
from helpers import (
    EXAMPLES,
    assert_bitwise_equal,
    assert_within,
    needs_hardware_dot,
    randn,
    rows_everywhere,
    ulp_of,
)


@needs_hardware_dot
@EXAMPLES
@given(seed=st.integers(0, 10**6))
def test_linear_is_batch_invariant(device, dtype, seed):
    k, n = 80, 96
    w = randn(n, k, dtype=dtype, device=device, seed=seed)
    row = randn(k, dtype=dtype, device=device, seed=seed + 1)
    alone, outs = rows_everywhere(
        lambda x: K.linear(x, w), row, lambda b: randn(b, k, dtype=dtype, device=device, seed=seed + b), device
    )
    for where, out in outs:
        assert_bitwise_equal(f"linear row at {where}", out, alone)


@needs_hardware_dot
def test_every_launch_tile_gives_the_same_bits(device, dtype):
    """tile_for picks a tile by batch size and layer width; each must compute every element the same way."""
    if device == "cpu":
        pytest.skip("launch tiles are a Triton property")
    x, w = randn(300, 200, dtype=dtype, device=device, seed=4), randn(160, 200, dtype=dtype, device=device, seed=5)
    outs = {name: launch._triton(x, w, None, tile=tile) for name, tile in launch.TILES[dtype].items()}
    if launch._tma_available(x, w, None):  # Hopper and newer: the TMA kernel, grid and persistent
        for persistent in (False, True):
            for plan, (tile, _) in launch.TMA_PLANS.items():
                for descriptors in ("host", "device"):
                    outs[f"tma {plan} persistent={persistent} {descriptors} descriptors"] = launch._triton_tma(
                        x, w, tile, persistent, descriptors=descriptors
                    )
        assert_bitwise_equal("linear() at 300 rows (TMA path) vs large tile", K.linear(x, w), outs["large"])
    for name, out in outs.items():
        assert_bitwise_equal(f"tile {name} vs large", out, outs["large"])


def test_linear_accuracy_and_bias(device, dtype):
    k, n = 300, 64
    x, w = randn(37, k, dtype=dtype, device=device, seed=1), randn(n, k, dtype=dtype, device=device, seed=2, scale=0.1)
    b = randn(n, dtype=dtype, device=device, seed=3)
    got = K.linear(x, w, b)
    ref = matmul.reference(x.double(), w.double(), b.double())
    bound = ulp_of(ref, dtype) + k * 2**-23 * (x.double().abs() @ w.double().abs().T + b.double().abs())
    assert got.dtype == dtype and got.shape == (37, n)
    assert_within("linear", got, ref, bound)


def test_linear_negative_control_stock_matmul_varies_with_batch(device):
    """torch's fp32 GEMM takes another path for one row than for many: the problem linear() removes."""
    w = randn(512, 384, dtype=torch.float32, device=device, seed=5)
    x = randn(300, 384, dtype=torch.float32, device=device, seed=6)
    stock = torch.nn.functional.linear
    assert not torch.equal(stock(x[:1], w), stock(x, w)[:1])
    assert torch.equal(K.linear(x[:1], w), K.linear(x, w)[:1])


@pytest.mark.parametrize("rows", [3, 300])
def test_row_parallel_partials_combine_to_the_single_rank_result(device, dtype, rows):
    """Tensor-parallel row split of K at t = 1, 2, 4 ranks (k_segments = 4 / t each), partials combined in
    rank order: the bits of linear(..., k_segments=4) on one rank; within fp32 rounding of fp64. At 300 rows
    bf16/fp16 on Hopper the single-rank result comes from the TMA kernel, the partials from the pointer one."""
    k, n, s = 1024, 96, matmul.ROW_PARALLEL_SEGMENTS
    x, w = (
        randn(rows, k, dtype=dtype, device=device, seed=11),
        randn(n, k, dtype=dtype, device=device, seed=12, scale=0.1),
    )
    b = randn(n, dtype=dtype, device=device, seed=13)
    full = K.linear(x, w, b, k_segments=s)
    for t in (1, 2, 4):
        width = k // t
        parts = [
            K.linear_partial(x[:, r * width : (r + 1) * width], w[:, r * width : (r + 1) * width], s // t)
            for r in range(t)
        ]
        assert_bitwise_equal(f"tp={t}", K.combine_partials(parts, b, dtype), full)
    ref = matmul.reference(x.double(), w.double(), b.double())
    assert_within(
        "segmented linear",
        full,
        ref,
        ulp_of(ref, dtype) + k * 2**-23 * (x.double().abs() @ w.double().abs().T + b.double().abs()),
    )


@pytest.mark.parametrize("m", [3, launch.SMALL_M + 44])
@pytest.mark.parametrize("segments", [2, 4, 8])
def test_segments_split_across_launches_give_the_in_kernel_tree(request, device, dtype, segments, m):
    """Without a launch tile a segmented product runs split (launch._split_k: one program per tile and
    segment, then a tree launch) or, on Hopper above TINY_M rows, in the TMA kernel with scratch tiles; a
    launch tile given explicitly keeps the tree inside one pointer-kernel program. Same bits, with and
    without bias (bias: never the TMA kernel), and as an fp32 partial."""
    if request.config.getoption("--kernel-device") == "cpu":
        pytest.skip("compares two Triton paths (interpret or cuda)")
    k, n = 1024, 96
    x, w = randn(m, k, dtype=dtype, device=device, seed=16), randn(n, k, dtype=dtype, device=device, seed=17, scale=0.1)
    b = randn(n, dtype=dtype, device=device, seed=18)
    tile = launch.tile_for(m, n, dtype)
    for bias in (None, b):
        assert_bitwise_equal(
            f"bias={bias is not None}",
            launch._triton(x, w, bias, segments=segments),
            launch._triton(x, w, bias, tile=tile, segments=segments),
        )
    assert_bitwise_equal(
        "partial",
        launch._triton(x, w, None, segments=segments, out_dtype=torch.float32),
        launch._triton(x, w, None, tile=tile, segments=segments, out_dtype=torch.float32),
    )


@pytest.mark.parametrize("segments", [1, 2, 4, 8])
def test_tma_kernel_segment_tree_gives_the_pointer_kernel_bits(request, monkeypatch, device, dtype, segments):
    """The TMA kernel parks the tree's finished left halves in scratch tiles (two accumulators live at most):
    grid and persistent (fewer programs than tiles, so a program walks several with the same descriptors), at its
    tiles, with its descriptors made on the host or on the device, rounded and as an fp32 partial, the bits of the
    pointer kernel's tree inside one program. The interpreter runs it too (fp32, at the pointer kernel's tile: its
    numpy dot depends on the tile)."""
    where = request.config.getoption("--kernel-device")
    if where == "cpu":
        pytest.skip("compares two Triton paths (interpret or cuda)")
    m, k, n = (300, 1024, 96) if where == "cuda" else (70, 256, 96)
    x, w = randn(m, k, dtype=dtype, device=device, seed=19), randn(n, k, dtype=dtype, device=device, seed=20, scale=0.1)
    if where == "cuda":
        if not launch._tma_available(x, w, None):
            pytest.skip("the TMA kernel needs Hopper or newer and bf16/fp16")
        reference_tile = launch.TILES[dtype]["large"]
        # an fp32 partial only at the "narrow" plans (128x256 with an fp32 output tile exceeds shared memory)
        tiles = {
            out: [tile for (_, narrow), (tile, _) in launch.TMA_PLANS.items() if narrow or out is None]
            for out in (None, torch.float32)
        }
        monkeypatch.setattr(launch, "sm_count", lambda device: 2)  # persistent: 2 programs walk 3 tiles or more
    else:
        monkeypatch.setattr(launch, "sm_count", lambda device: 3)  # persistent: 3 programs walk 30 tiles
        reference_tile = (32, 32, 16, 4, 1)
        tiles = dict.fromkeys((None, torch.float32), [reference_tile])
    for out_dtype in (None, torch.float32):
        expected = launch._triton(x, w, None, tile=reference_tile, segments=segments, out_dtype=out_dtype)
        for tile in tiles[out_dtype]:
            for persistent in (False, True):
                for descriptors in ("host", "device"):
                    assert_bitwise_equal(
                        f"tma {tile} persistent={persistent} {descriptors} descriptors out={out_dtype}",
                        launch._triton_tma(
                            x, w, tile, persistent, segments=segments, out_dtype=out_dtype, descriptors=descriptors
                        ),
                        expected,
                    )


def test_device_descriptors_refuse_unaligned_rows(request, device):
    """A device-made TMA descriptor cannot check its tensor, so _triton_tma refuses rows that are not 16 bytes."""
    if request.config.getoption("--kernel-device") == "cpu":
        pytest.skip("a Triton path (interpret or cuda)")
    x, w = (
        randn(4, 22, dtype=torch.float32, device=device, seed=1),
        randn(8, 22, dtype=torch.float32, device=device, seed=2),
    )
    with pytest.raises(ValueError, match="16-byte aligned"):
        launch._triton_tma(x, w, (32, 32, 16, 4, 1), persistent=False, descriptors="device")


@pytest.mark.parametrize("segments", [2, 4, 8])
def test_tma_split_segment_tree_gives_the_pointer_kernel_bits(request, device, dtype, segments):
    """The TMA kernel with one program per (tile, segment) plus the tree launch (_triton_tma_split, the
    medium class's segmented path): the bits of the pointer kernel's tree inside one program, rounded and as
    an fp32 partial. The interpreter runs it too (fp32, at the pointer kernel's tile)."""
    where = request.config.getoption("--kernel-device")
    if where == "cpu":
        pytest.skip("compares two Triton paths (interpret or cuda)")
    m, k, n = (300, 1024, 96) if where == "cuda" else (70, 256, 96)
    x, w = randn(m, k, dtype=dtype, device=device, seed=23), randn(n, k, dtype=dtype, device=device, seed=24, scale=0.1)
    if where == "cuda":
        if not launch._tma_available(x, w, None):
            pytest.skip("the TMA kernel needs Hopper or newer and bf16/fp16")
        reference_tile = launch.TILES[dtype]["large"]
        tiles = [tile for _, tile in launch.MEDIUM_SPLIT_TILES] + [(128, 128, 64, 8, 4)]
    else:
        reference_tile = (32, 32, 16, 4, 1)
        tiles = [reference_tile]
    for out_dtype in (None, torch.float32):
        expected = launch._triton(x, w, None, tile=reference_tile, segments=segments, out_dtype=out_dtype)
        for tile in tiles:
            assert_bitwise_equal(
                f"tma split {tile} out={out_dtype}", launch._triton_tma_split(x, w, tile, segments, out_dtype), expected
            )


@needs_hardware_dot
@pytest.mark.parametrize("segments", [1, matmul.ROW_PARALLEL_SEGMENTS])
def test_medium_class_keeps_every_rows_bits(monkeypatch, device, dtype, segments):
    """The medium class (default on, ALIGNAUDIT_MATMUL_MEDIUM=0 off: rows TINY_M < m <= MEDIUM_M take their own
    TMA plans on Hopper): a row alone and at the first, a middle and the last position of batches on both sides
    of every class edge (16/17, 64/65, 128/129, 256/257) gives the same bits with the switch on and off, and so
    does a
    tensor-parallel split's partials combined. Negative control: the same four segment partials added left to
    right instead of by the tree give other fp32 bits, so the comparison sees a changed reduction order."""
    k, n = 1024, 96
    w = randn(n, k, dtype=dtype, device=device, seed=25, scale=0.1)
    row = randn(k, dtype=dtype, device=device, seed=26)
    monkeypatch.setenv("ALIGNAUDIT_MATMUL_MEDIUM", "0")
    alone = K.linear(row[None], w, k_segments=segments)[0]
    for b in (16, 17, 33, 64, 65, 128, 129, 257):
        batch = randn(b, k, dtype=dtype, device=device, seed=26 + b)
        for pos in sorted({0, b // 2, b - 1}):
            batch[pos] = row
            for medium in ("0", "1"):
                monkeypatch.setenv("ALIGNAUDIT_MATMUL_MEDIUM", medium)
                assert_bitwise_equal(
                    f"row at ({b}, {pos}), medium={medium}", K.linear(batch, w, k_segments=segments)[pos], alone
                )
    if segments > 1:  # unrounded (fp32 partials), where a changed order of additions cannot round away
        x = randn(100, k, dtype=dtype, device=device, seed=27)
        width = k // segments
        parts = [
            K.linear_partial(x[:, r * width : (r + 1) * width], w[:, r * width : (r + 1) * width], 1)
            for r in range(segments)
        ]
        full = K.linear_partial(x, w, segments)
        assert_bitwise_equal("tree of the segments' partials, medium", matmul.tree_sum(parts), full)
        monkeypatch.setenv("ALIGNAUDIT_MATMUL_MEDIUM", "0")
        assert_bitwise_equal("fp32 partial, medium on vs off", K.linear_partial(x, w, segments), full)
        in_order = parts[0]
        for p in parts[1:]:
            in_order = in_order + p
        assert not torch.equal(in_order, full), "negative control: left-to-right partial sums gave the tree's bits"


@needs_hardware_dot
@pytest.mark.parametrize("segments", [1, matmul.ROW_PARALLEL_SEGMENTS])
def test_linear_rows_keep_their_bits_across_batch_size_classes(device, dtype, segments):
    """A row at K = 1024 (segments whole BLOCK_K steps, so that Hopper takes its TMA plans) alone and at the
    first, a middle and the last position of batches in every class (tiny: split across programs when
    segmented; small and large: their tiles or TMA plans): the same bits everywhere."""
    k, n = 1024, 96
    w = randn(n, k, dtype=dtype, device=device, seed=21, scale=0.1)
    row = randn(k, dtype=dtype, device=device, seed=22)
    alone, outs = rows_everywhere(
        lambda x: K.linear(x, w, k_segments=segments),
        row,
        lambda b: randn(b, k, dtype=dtype, device=device, seed=22 + b),
        device,
    )
    for where, out in outs:
        assert_bitwise_equal(f"row at {where}", out, alone)


def test_row_parallel_negative_control_rounded_partials_summed(device):
    """What a stock row-parallel layer does (each rank rounds its output to bf16, then the ranks' outputs
    are added): not the single-rank bits."""
    x, w = (
        randn(64, 1024, dtype=torch.bfloat16, device=device, seed=14),
        randn(96, 1024, dtype=torch.bfloat16, device=device, seed=15),
    )
    halves = [K.linear(x[:, r * 512 : (r + 1) * 512], w[:, r * 512 : (r + 1) * 512], k_segments=2) for r in range(2)]
    assert not torch.equal(halves[0] + halves[1], K.linear(x, w, k_segments=4))


def test_cpu_kernels_do_not_depend_on_thread_count(device):
    if device != "cpu":
        pytest.skip("thread count is a CPU property")
    x, w = (
        randn(33, 200, dtype=torch.bfloat16, device="cpu", seed=7),
        randn(50, 200, dtype=torch.bfloat16, device="cpu", seed=8),
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (K.linear(x, w), K.rms_norm(x, w[0], 1e-6), K.log_softmax(x))
        torch.set_num_threads(max(2, threads))
        many = (K.linear(x, w), K.rms_norm(x, w[0], 1e-6), K.log_softmax(x))
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(("linear", "rms_norm", "log_softmax"), one, many, strict=True):
        assert_bitwise_equal(name, a, b)
