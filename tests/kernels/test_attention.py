"""Strict kernels, attention: prefill == decode over shuffled pages, chunked and split keys, accuracy, native exp,
one compiled graph with eager bits; SDPA's prefill vs decode as the negative control.

The backend is --kernel-device's (tests/kernels/conftest.py); each invariance has its negative control.
"""

from __future__ import annotations

import os

import pytest
import torch

import alignaudit_kernels as K
from alignaudit_kernels import attention, primitives
from helpers import (
    INTERPRET,
    assert_bitwise_equal,
    assert_within,
    gen,
    needs_hardware_dot,
    randn,
    ulp_of,
)


def ragged(lengths, h, kvh, d, dtype, device, seed):
    total = sum(lengths)
    q = randn(total, h, d, dtype=dtype, device=device, seed=seed)
    k = randn(total, kvh, d, dtype=dtype, device=device, seed=seed + 1)
    v = randn(total, kvh, d, dtype=dtype, device=device, seed=seed + 2)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu


def paged(k, v, block_size, seed, device):
    """Scatter one sequence's K/V into a paged cache with shuffled pages; return cache and block table."""
    n = k.shape[0]
    pages = (n + block_size - 1) // block_size
    order = torch.randperm(pages + 3, generator=gen(seed))[:pages]
    cache_k = torch.zeros(pages + 3, block_size, *k.shape[1:], dtype=k.dtype, device=device)
    cache_v = torch.zeros_like(cache_k)
    for i, page in enumerate(order.tolist()):
        cache_k[page, : min(block_size, n - i * block_size)] = k[i * block_size : (i + 1) * block_size]
        cache_v[page, : min(block_size, n - i * block_size)] = v[i * block_size : (i + 1) * block_size]
    return cache_k, cache_v, order[None].to(device)


@needs_hardware_dot
def test_attention_prefill_equals_decode_over_shuffled_pages(device, dtype):
    h, kvh, d = 8, 2, 32
    lengths = [70, 5, 130]
    q, k, v, cu = ragged(lengths, h, kvh, d, dtype, device, seed=1)
    scale = d**-0.5
    prefill = K.varlen_attention(q, k, v, cu, scale)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = K.varlen_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), scale)
        assert_bitwise_equal(f"seq {s} alone vs in batch", alone, prefill[a:b])
        cache_k, cache_v, table = paged(k[a:b], v[a:b], block_size=16, seed=s, device=device)
        for p in sorted({0, 1, 63, 64, 65, b - a - 1} & set(range(b - a))):
            one = K.paged_attention(
                q[a + p : a + p + 1],
                cache_k,
                cache_v,
                table,
                torch.tensor([p], device=device),
                torch.tensor([0]),
                scale,
            )
            assert_bitwise_equal(f"seq {s} decode at {p}", one[0], prefill[a + p])
        ref = attention.reference(q[a:b].double(), k[a:b].double(), v[a:b].double(), scale)
        assert_within(
            f"attention seq {s}", prefill[a:b], ref, 1.01 * ulp_of(ref, dtype) + 2**-9 * v.double().abs().max()
        )


@needs_hardware_dot
def test_paged_prefill_of_a_batch_equals_decode(device):
    """vLLM's case: several sequences' prompt rows in one paged call, then one decode row each."""
    h, kvh, d, dtype = 4, 4, 64, torch.float32
    lengths = [40, 90]
    q, k, v, cu = ragged(lengths, h, kvh, d, dtype, device, seed=3)
    caches = [
        paged(k[a:b], v[a:b], 32, seed=i, device=device)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    ]
    # one cache holding both sequences: concatenate pages and offset the second table
    ck = torch.cat([c[0] for c in caches])
    cv = torch.cat([c[1] for c in caches])
    table = torch.zeros(2, 8, dtype=torch.long, device=device)
    table[0, : caches[0][2].shape[1]] = caches[0][2][0]
    table[1, : caches[1][2].shape[1]] = caches[1][2][0] + caches[0][0].shape[0]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    seq_of_row = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    batch = K.paged_attention(q, ck, cv, table, positions, seq_of_row, d**-0.5)
    assert_bitwise_equal("paged prefill vs varlen", batch, K.varlen_attention(q, k, v, cu, d**-0.5))
    last = K.paged_attention(q[cu[1:] - 1], ck, cv, table, positions[cu[1:] - 1], torch.arange(2), d**-0.5)
    assert_bitwise_equal("decode of both sequences", last, batch[cu[1:] - 1])


@needs_hardware_dot
def test_batched_causal_attention_equals_prefill_and_decode(device):
    """The training/HF layout: a batch of equal-length sequences with their K/V, then one decode row."""
    h, kvh, d, dtype, b, t = 8, 2, 64, torch.bfloat16, 3, 90
    q, k, v, cu = ragged([t] * b, h, kvh, d, dtype, device, seed=11)
    prefill = K.varlen_attention(q, k, v, cu, 0.125)
    positions = torch.arange(t, device=device)[None].expand(b, t)
    batched = K.causal_attention(q.view(b, t, h, d), k.view(b, t, kvh, d), v.view(b, t, kvh, d), positions, 0.125)
    assert_bitwise_equal("batched causal vs varlen prefill", batched.flatten(0, 1), prefill)
    p = 70  # decode of position 70 with the keys 0..70 of sequence 1 (a cache that holds more keys than that)
    one = K.causal_attention(q[t + p : t + p + 1], k[t : 2 * t], v[t : 2 * t], torch.tensor([p], device=device), 0.125)
    assert_bitwise_equal("decode row vs prefill row", one[0], prefill[t + p])


@pytest.mark.skipif(INTERPRET, reason="bf16 at real head shapes: a GPU check (the interpreter handles fp32 only)")
@pytest.mark.parametrize("h, kvh", [(8, 8), (16, 8), (32, 8), (40, 8), (28, 4), (64, 8)])
def test_decode_rows_equal_prefill_at_real_head_shapes(device, h, kvh):
    """HF's generate decodes with a cache of exactly p + 1 keys; vLLM's decode step reads a paged cache (one
    query row per sequence: paged_decode); the trainer prefills the whole sequence. head_dim 128 at GQA group
    sizes 1, 2, 4, 5 (Qwen3-14B: 40 over 8), 7 (Qwen2.5-7B: 28 over 4) and 8; on the GPU a prefill tile of 64
    rows holds floor(64 / group) tokens, the rest of it masked, and a decode tile one token's heads, spread
    over its rows (attention._rows). Positions around key-block edges."""
    d, t = 128, 300
    q, k, v, cu = ragged([t], h, kvh, d, torch.bfloat16, device, seed=21)
    prefill = K.varlen_attention(q, k, v, cu, d**-0.5)
    positions = (0, 1, 63, 64, 65, 127, 128, 255, 256, 299)
    for p in positions:
        one = K.causal_attention(q[p : p + 1], k[: p + 1], v[: p + 1], torch.tensor([p], device=device), d**-0.5)
        assert_bitwise_equal(f"decode row {p} vs prefill row", one[0], prefill[p])
    cache_k, cache_v, table = paged(k, v, block_size=16, seed=22, device=device)
    rows = torch.tensor(positions)
    step = K.paged_decode(q[rows], cache_k, cache_v, table.repeat(len(positions), 1), (rows + 1).to(device), d**-0.5, t)
    assert_bitwise_equal("paged_decode rows vs prefill rows", step, prefill[rows])


@pytest.mark.parametrize("h, kvh", [(4, 2), (10, 2), (14, 2)])
def test_attention_accuracy_paged_and_varlen(device, h, kvh):
    """Small enough for the interpreter: the Triton attention's indexing against the fp64 reference, at GQA
    groups of 2, 5 and 7 (64-row tiles that 5 and 7 do not divide)."""
    d = 32
    q, k, v, cu = ragged([70, 9], h, kvh, d, torch.float32, device, seed=8)
    out = K.varlen_attention(q, k, v, cu, 0.2)
    for a, b in ((0, 70), (70, 79)):
        ref = attention.reference(q[a:b].double(), k[a:b].double(), v[a:b].double(), 0.2)
        assert_within("attention", out[a:b], ref, 1e-5 + 1e-5 * ref.abs())
    cache_k, cache_v, table = paged(k[:70], v[:70], block_size=16, seed=1, device=device)
    last = K.paged_attention(
        q[69:70], cache_k, cache_v, table, torch.tensor([69], device=device), torch.tensor([0]), 0.2
    )
    ref = attention.reference(q[:70].double(), k[:70].double(), v[:70].double(), 0.2)[-1:]
    assert_within("paged decode", last, ref, 1e-5 + 1e-5 * ref.abs())


def exact_attention_inputs(lengths, h, kvh, d, device):
    """q and k in multiples of 1/4 from -1/2 to 1/2 (every score exact) and v with at most two nonzero
    values per head dim column in a key block of 64 (key j holds j % 7 - 3 in column j % d, d = 32): every
    dot product is then exact whatever order adds it, so bit equality of the Triton kernel's tiles, splits
    and decode steps is testable under the interpreter (whose dot is numpy's BLAS) as on a GPU."""
    total = sum(lengths)
    g = gen(40)
    q = torch.randint(-2, 3, (total, h, d), generator=g).float() * 0.25
    k = torch.randint(-2, 3, (total, kvh, d), generator=g).float() * 0.25
    v = torch.zeros(total, kvh, d)
    keys = torch.cat([torch.arange(n) for n in lengths])
    v[torch.arange(total), :, keys % d] = (keys % 7 - 3).float()[:, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q.to(device), k.to(device), v.to(device), cu


def test_attention_key_chunks_split_and_decode_give_prefill_bits(device):
    """Keys are visited in chunks of CHUNK_N (512) positions folded left to right: on the Triton backends one
    program per chunk plus a merge launch (split) gives the unsplit kernel's bits; on every backend decode
    steps through paged_decode (shuffled 16-key pages) give the prefill's bits on both sides of a chunk edge."""
    lengths = [600, 70]
    h, kvh, d = 8, 2, 32
    if INTERPRET:  # 4 query heads over 2: the chunk edges are per key, and each head is as many programs again
        q, k, v, cu = exact_attention_inputs(lengths, 4, kvh, d, device)
    else:  # bf16 at Qwen3-8B's head shape on the GPU, 8 x 2 x 32 on the CPU backend
        if device == "cuda":
            h, kvh, d = 32, 8, 128
        q, k, v, cu = ragged(lengths, h, kvh, d, torch.bfloat16, device, seed=31)
    scale = d**-0.5
    triton_backend = primitives.use_triton(q)
    unsplit = K.varlen_attention(q, k, v, cu, scale)
    if triton_backend:
        assert_bitwise_equal("unsplit prefill", attention._launch_varlen(q, k, v, cu, scale, split=False), unsplit)
        assert_bitwise_equal("split prefill", attention._launch_varlen(q, k, v, cu, scale, split=True), unsplit)
        if device != "cuda" or torch.cuda.get_device_capability()[0] >= 9:  # K/V by the TMA unit: same bits
            for ws in (False, True) if device == "cuda" else (False,):  # Hopper's warp specialization: 8 warps
                config = (2 * attention.TILE_ROWS, 8, 2) if ws else attention.TILE_CONFIG
                assert_bitwise_equal(
                    f"TMA prefill, warp-specialized {ws}",
                    attention._launch_varlen(q, k, v, cu, scale, config=config, tma=True, ws=ws),
                    unsplit,
                )
    if device == "cuda":  # negative control: one chunk for all 600 keys is another algorithm past key 511
        whole = attention._launch_varlen(q, k, v, cu, scale, chunk_n=1024)
        assert torch.equal(whole[:512], unsplit[:512]) and not torch.equal(whole[512:600], unsplit[512:600])
    caches = [
        paged(k[a:b], v[a:b], 16, seed=i, device=device)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    ]
    pages = caches[0][0].shape[0]
    ck, cv = torch.cat([caches[0][0], caches[1][0]]), torch.cat([caches[0][1], caches[1][1]])
    table = torch.zeros(2, caches[0][2].shape[1], dtype=torch.int32, device=device)
    table[0] = caches[0][2][0]
    table[1, : caches[1][2].shape[1]] = caches[1][2][0] + pages
    for p in (0, 63, 255, 256, 511, 512, 513, 599):
        p2 = min(p, 69)
        rows = torch.tensor([p, 600 + p2])
        lens = torch.tensor([p + 1, p2 + 1], device=device)
        for split in (False, True) if triton_backend else ():
            out = attention._launch(
                q[rows], ck, cv, table, None, lens, scale, kv_mode=attention.KV_GATHER, max_keys=600, split=split
            )
            assert_bitwise_equal(f"decode at {p}, {p2} (split {split})", out, unsplit[rows])
        assert_bitwise_equal(
            f"paged_decode at {p}", K.paged_decode(q[rows], ck, cv, table, lens, scale, 600), unsplit[rows]
        )
    buffer = torch.full((3, *q.shape[1:]), 7.0, dtype=q.dtype, device=device)  # an engine's output buffer
    written = K.paged_decode(q[rows], ck, cv, table, lens, scale, 600, out=buffer[:2])
    assert written.data_ptr() == buffer.data_ptr() and (buffer[2] == 7).all()
    assert_bitwise_equal("paged_decode into a buffer", buffer[:2], unsplit[rows])
    if triton_backend:  # an empty decode slot (length 0) gives the same NaN row split or not, never scratch memory
        empty = [
            attention._launch(
                q[[0, 599]],
                ck,
                cv,
                table.flip(0),
                None,
                torch.tensor([0, 600], device=device),
                scale,
                kv_mode=attention.KV_GATHER,
                max_keys=600,
                split=split,
            )
            for split in (False, True)
        ]
        assert_bitwise_equal("empty slot, split vs unsplit", empty[1], empty[0])
        assert torch.isnan(empty[0][0]).all() and torch.equal(empty[0][1], unsplit[599])
    too_long = torch.tensor([600, 70], device=device)
    if triton_backend:  # checked in the kernel: a NaN row, its neighbours' bits untouched, split or not
        for split in (False, True):
            out = attention._launch(
                q[rows], ck, cv, table, None, too_long, scale, kv_mode=attention.KV_GATHER, max_keys=599, split=split
            )
            assert torch.isnan(out[0]).all() and torch.equal(out[1], unsplit[669]), f"split {split}"
    else:
        with pytest.raises(ValueError, match="600 keys, longer than max_seq_len 599"):
            K.paged_decode(q[:2], ck, cv, table, too_long, scale, 599)


def test_prefill_log_sum_exp_for_the_fused_backward(device):
    """_launch_varlen(lse=...) fills lse[h, t] with the row's log-sum-exp of its scaled scores over its keys (what
    FlashAttention-2's backward re-exponentiates against: attention/flash_gradients.py), split and unsplit, across
    the 512-key chunk edge, without changing one output bit; a buffer of another layout is refused."""
    lengths = [600, 70]
    if INTERPRET:
        q, k, v, cu = exact_attention_inputs(lengths, 4, 2, 32, device)
    else:
        q, k, v, cu = ragged(lengths, 32, 8, 128, torch.bfloat16, device, seed=35)
    if not primitives.use_triton(q):
        pytest.skip("the CPU backend keeps no log-sum-exp (no backward there reads one)")
    (t, h, d), kvh = q.shape, k.shape[1]
    scale = d**-0.5
    expected = torch.empty(h, t, dtype=torch.float64)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        keys = k[a:b].double().cpu().repeat_interleave(h // kvh, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double().cpu(), keys) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        expected[:, a:b] = torch.logsumexp(s, -1)
    plain = attention._launch_varlen(q, k, v, cu, scale)
    for split in (False, True):
        lse = torch.full((h, t), float("nan"), device=device)
        assert_bitwise_equal(
            f"output with lse, split {split}", attention._launch_varlen(q, k, v, cu, scale, split=split, lse=lse), plain
        )
        torch.testing.assert_close(lse.cpu().double(), expected, rtol=1e-5, atol=1e-4, msg=f"lse, split {split}")
    with pytest.raises(ValueError, match=rf"lse \({t}, {h}\) torch.float32 .* must be fp32 \[{h}, {t}\]"):
        attention._launch_varlen(q, k, v, cu, scale, lse=torch.empty(t, h, device=device))
    with pytest.raises(ValueError, match="heads that do not overlap"):  # every head would write the same row
        attention._launch_varlen(q, k, v, cu, scale, lse=torch.empty(1, t, device=device).expand(h, t))


def test_split_scratch_keeps_only_rows_that_hold_queries_and_stays_bounded():
    """The split path's fp32 scratch holds a decode tile's USED rows only (4 of 64 at 32 query heads over 8 KV
    heads) and a launch splits only within SPLIT_SCRATCH_BYTES: in vLLM a decode step's key bound is max_model_len,
    and at Qwen3-8B's 40960 with 512 sequences the whole-tile scratch was 10.9 GB (0.68 GB with USED rows, still
    past the bound: unsplit). The bits do not depend on it (the split/unsplit decode tests)."""
    used = attention.launch._used_rows(True, 4, attention.TILE_ROWS)
    assert used == 4 and attention.launch._used_rows(False, 4, attention.TILE_ROWS) == attention.TILE_ROWS
    chunks = -(-40960 // attention.CHUNK_N)
    assert chunks == 80
    assert attention.split_scratch_bytes(chunks, 512, 8, attention.TILE_ROWS, 128) == 10_905_190_400
    assert attention.split_scratch_bytes(chunks, 512, 8, used, 128) == 681_574_400
    sms = 132  # an H200's
    assert attention.choose_split(chunks, 1, 8, used, 128, sms)  # one long sequence: 8 programs, 1.3 MB
    assert attention.choose_split(8, 256, 8, used, 128, sms)  # 256 sequences at 4096 keys: 34.1 MB
    assert not attention.choose_split(chunks, 512, 8, used, 128, sms)  # 0.68 GB: past SPLIT_SCRATCH_BYTES
    assert not attention.choose_split(1, 1, 8, used, 128, sms)  # one chunk: nothing to split
    assert not attention.choose_split(8, 528, 8, used, 128, sms)  # 4224 programs: 32 a SM already
    m, l, acc = attention.split_scratch(3, 5, 2, used, 32, torch.device("cpu"))
    assert (m.shape, acc.shape) == ((3, 5, 2, used), (3, 5, 2, used, 32))
    assert sum(x.numel() * x.element_size() for x in (m, l, acc)) == attention.split_scratch_bytes(3, 5, 2, used, 32)


def test_a_decode_launch_past_the_scratch_bound_runs_unsplit_with_the_same_bits(device, monkeypatch):
    """_launch's own choice (split=None) takes the scratch bound: one decode sequence at 600 keys splits into two
    chunks, and with SPLIT_SCRATCH_BYTES below its scratch it allocates none and gives the same bits."""
    if not primitives.use_triton(torch.empty(0, device=device)):
        pytest.skip("the CPU backend has no split path")
    kvh, d, n = 2, 32, 600
    q, k, v, cu = exact_attention_inputs([n], 4 * kvh, kvh, d, device)
    cache_k, cache_v, table = paged(k, v, 16, seed=7, device=device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    allocated = []
    real = attention.launch.split_scratch
    monkeypatch.setattr(attention.launch, "split_scratch", lambda *a: allocated.append(a) or real(*a))
    outs = []
    for bound in (attention.SPLIT_SCRATCH_BYTES, 0):
        monkeypatch.setattr(attention.launch, "SPLIT_SCRATCH_BYTES", bound)
        outs.append(
            attention._launch(
                q[n - 1 :], cache_k, cache_v, table.int(), None, lens, d**-0.5, kv_mode=attention.KV_GATHER, max_keys=n
            )
        )
        assert len(allocated) == 1, allocated  # the first launch's scratch; the second allocated none
    assert allocated[0][:4] == (2, 1, kvh, 4)  # two chunks, one tile, USED rows only
    assert_bitwise_equal("decode past the scratch bound (unsplit) vs split", outs[1], outs[0])


@pytest.mark.parametrize("group", [3, 5])
def test_split_decode_over_several_chunks_at_groups_that_are_not_powers_of_two(device, group):
    """The compact scratch's chunk stride (USED rows a tile: 4 for 3 heads, 8 for 5) over five chunks of 128 keys
    (chunk_n: the test's, so that few keys make many chunks): split decode gives the unsplit bits for rows that end
    in each chunk, with an empty slot beside them."""
    if not primitives.use_triton(torch.empty(0, device=device)):
        pytest.skip("the CPU backend has no split path")
    kvh, d, n = 2, 32, 600
    q, k, v, cu = exact_attention_inputs([n], group * kvh, kvh, d, device)
    cache_k, cache_v, table = paged(k, v, 16, seed=group, device=device)
    rows = torch.tensor([0, 127, 128, 300, 599, 5])
    lens = torch.tensor([1, 128, 129, 301, 600, 0], dtype=torch.int32, device=device)
    table = table.repeat(len(rows), 1).int()
    outs = [
        attention._launch(
            q[rows],
            cache_k,
            cache_v,
            table,
            None,
            lens,
            d**-0.5,
            kv_mode=attention.KV_GATHER,
            max_keys=n,
            split=split,
            chunk_n=128,
        )
        for split in (False, True)
    ]
    assert torch.isnan(outs[0][5]).all()
    assert_bitwise_equal(f"group {group}: split decode over 5 chunks vs unsplit", outs[1], outs[0])


@pytest.mark.parametrize("group", [3, 33])
def test_decode_tile_rows_at_group_sizes_that_are_not_powers_of_two(device, group):
    """A decode tile places a token's heads USED rows apart (USED: the group rounded up to a power of two, 4 for
    3; 64 for 33: the whole tile, no rows taken out), so some of the rows it exponentiates hold no head. Exact
    inputs: every dot is exact, so the interpreter checks the placement too. Decode rows, split and unsplit
    (and through a block table whose rows are not contiguous), equal the prefill's; an empty slot and a row past
    the key bound are NaN beside rows that keep their bits."""
    kvh, d, n = 2, 32, 130
    q, k, v, cu = exact_attention_inputs([n], group * kvh, kvh, d, device)
    prefill = K.varlen_attention(q, k, v, cu, d**-0.5)
    cache_k, cache_v, table = paged(k, v, 16, seed=group, device=device)
    rows = torch.tensor([0, 63, 64, 129])
    table = table.repeat(len(rows), 1).int()
    step = K.paged_decode(q[rows], cache_k, cache_v, table, (rows + 1).to(device), d**-0.5, n)
    assert_bitwise_equal(f"group {group}: paged_decode vs prefill", step, prefill[rows])
    column_major = table.t().contiguous().t()  # the same table, rows not contiguous
    step = K.paged_decode(q[rows], cache_k, cache_v, column_major, (rows + 1).to(device), d**-0.5, n)
    assert_bitwise_equal(f"group {group}: paged_decode with a column-major table", step, prefill[rows])
    if primitives.use_triton(q):
        for split in (False, True):
            out = attention._launch(
                q[rows],
                cache_k,
                cache_v,
                table,
                None,
                (rows + 1).int().to(device),
                d**-0.5,
                kv_mode=attention.KV_GATHER,
                max_keys=n,
                split=split,
            )
            assert_bitwise_equal(f"group {group}: decode (split {split}) vs prefill", out, prefill[rows])
        lens = torch.tensor([0, 130, 131, 64], dtype=torch.int32, device=device)  # empty, last, past the bound, 64
        out = attention._launch(
            q[[0, 129, 129, 63]], cache_k, cache_v, table, None, lens, d**-0.5, kv_mode=attention.KV_GATHER, max_keys=n
        )
        assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
        assert_bitwise_equal(f"group {group}: neighbours of NaN rows", out[[1, 3]], prefill[[129, 63]])


def test_paged_attention_refuses_caches_it_cannot_read(device):
    """Caches that differ in shape, a head count that does not divide q's, or (on the Triton backends, which step
    by one element along head_dim) a head_dim stride other than 1: a ValueError before any kernel runs. The CPU
    backend reads a strided cache as given."""
    q = randn(2, 4, 32, dtype=torch.float32, device=device, seed=50)
    cache = randn(3, 16, 2, 32, dtype=torch.float32, device=device, seed=51)
    table = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="alike"):
        K.paged_decode(q, cache, cache[..., :16], table, lens, 0.1, 16)
    with pytest.raises(ValueError, match="alike"):
        K.paged_attention(q[:, :3], cache, cache, table, lens - 1, torch.arange(2), 0.1)
    strided = randn(3, 16, 2, 64, dtype=torch.float32, device=device, seed=52)[..., ::2]
    if primitives.use_triton(q):
        with pytest.raises(ValueError, match="unit stride along head_dim"):
            K.paged_decode(q, strided, strided, table, lens, 0.1, 16)
    else:
        assert_bitwise_equal(
            "strided cache on the CPU",
            K.paged_decode(q, strided, strided, table, lens, 0.1, 16),
            K.paged_decode(q, strided.contiguous(), strided.contiguous(), table, lens, 0.1, 16),
        )


def test_query_tiles_split_each_run_of_a_sequence_into_tiles_from_its_first_row():
    """paged_tiles' plan, by hand: runs of 70, 5 and 130 rows (sequences 0, 1, 2; sequence 2 again after a run of
    sequence 1) in tiles of 32 tokens (64 rows at 2 query heads per KV head): sequence, first row, rows, row within
    the run. Empty rows give no tile."""
    q_seq = torch.tensor([0] * 70 + [1] * 5 + [2] * 130 + [1] * 3)
    tiles = attention.paged_tiles(q_seq, 2, torch.device("cpu")).tiles
    assert tiles.tolist() == [
        [0, 0, 0, 1, 2, 2, 2, 2, 2, 1],
        [0, 32, 64, 70, 75, 107, 139, 171, 203, 205],
        [32, 32, 6, 5, 32, 32, 32, 32, 2, 3],
        [0, 32, 64, 0, 0, 32, 64, 96, 128, 0],
    ]
    assert tiles.dtype == torch.int32
    assert attention.paged_tiles(torch.zeros(0, dtype=torch.int64), 2, torch.device("cpu")).tiles.shape == (4, 0)
    generator = gen(90)
    for _ in range(100):  # random layouts against the plan written as a loop
        counts = torch.randint(1, 200, (int(torch.randint(1, 12, (1,), generator=generator)),), generator=generator)
        q_seq = torch.randint(0, 4, counts.shape, generator=generator).repeat_interleave(counts)
        per_tile = int(torch.randint(1, 65, (1,), generator=generator))
        expected, row = [], 0
        for seq, count in zip(*torch.unique_consecutive(q_seq, return_counts=True), strict=True):
            expected += [[int(seq), row + o, min(per_tile, int(count) - o), o] for o in range(0, int(count), per_tile)]
            row += int(count)
        assert attention.launch._tiles(*attention.launch.runs_of(q_seq), per_tile).t().tolist() == expected


def test_query_tiles_planned_once_give_the_bits_of_each_call_planning_its_own(device):
    """An engine plans a step's query tiles once (paged_tiles) and every layer's paged_attention reads them: the
    bits of a call that plans its own. Tiles planned for another query-head group or another number of rows are
    refused on every backend. Negative control (Triton backends, which read the tiles): tiles that assign the last
    rows to a second sequence, whose block-table row names other pages, change those rows and only those."""
    h, kvh, d = 4, 2, 32
    lengths = [70, 5, 30]
    q, k, v, cu = ragged(lengths, h, kvh, d, torch.float32, device, seed=60)
    cache_k, cache_v, table = paged(k, v, block_size=16, seed=61, device=device)  # one page run for the three
    positions = torch.cat([torch.arange(n) + a for n, a in zip(lengths, cu[:-1].tolist(), strict=True)])
    q_seq = torch.zeros(sum(lengths), dtype=torch.int64)  # one sequence's rows at positions 0..104 of its pages
    own = K.paged_attention(q, cache_k, cache_v, table, positions.to(device), q_seq, 0.125)
    tiles = attention.paged_tiles(q_seq, h // kvh, q.device)
    assert tiles.group == 2 and tiles.tiles.dtype == torch.int32 and tiles.tiles.device == q.device
    assert_bitwise_equal(
        "planned once",
        K.paged_attention(q, cache_k, cache_v, table, positions.to(device), q_seq, 0.125, tiles=tiles),
        own,
    )
    for other, planned in (
        (attention.paged_tiles(q_seq, 4, q.device), "105 rows at 4"),
        (attention.paged_tiles(q_seq[:-5], 2, q.device), "100 rows at 2"),
        (attention.paged_tiles(torch.zeros(140, dtype=torch.int64), 2, q.device), "140 rows at 2"),
    ):
        with pytest.raises(ValueError, match=f"planned for {planned} query heads per KV head, used for 105 rows at 2"):
            K.paged_attention(q, cache_k, cache_v, table, positions.to(device), q_seq, 0.125, tiles=other)
    if primitives.use_triton(q):
        cut = attention.paged_tiles((torch.arange(sum(lengths)) >= 70).long(), h // kvh, q.device)
        two_tables = torch.cat([table, table.roll(1, dims=1)])  # sequence 1: the same pages in another order
        moved = K.paged_attention(q, cache_k, cache_v, two_tables, positions.to(device), q_seq, 0.125, tiles=cut)
        assert_bitwise_equal("rows the tiles keep in sequence 0", moved[:70], own[:70])
        assert not torch.equal(moved[70:], own[70:])


def test_tma_reads_are_refused_where_descriptors_cannot_read_the_layout(device):
    """The TMA candidate (bench/sweep_gpu.py attention-tma) needs one-token contiguous pages and a power-of-two
    head_dim, and warp specialization applies to its loop only: ValueError before any kernel runs."""
    q = randn(8, 4, 24, dtype=torch.float32, device=device, seed=53)
    k = randn(8, 2, 24, dtype=torch.float32, device=device, seed=54)
    cu = torch.tensor([0, 8])
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        attention._launch_varlen(q, k, k, cu, 0.2, tma=True)
    with pytest.raises(ValueError, match="TMA loop only"):
        attention._launch_varlen(q, k, k, cu, 0.2, ws=True)
    q, pages = q[..., :16], randn(2, 4, 2, 16, dtype=torch.float32, device=device, seed=55)  # pages of 4 tokens
    with pytest.raises(ValueError, match="pages of one token"):
        attention._launch(
            q,
            pages,
            pages,
            torch.tensor([[0, 1]], dtype=torch.int32, device=device),
            torch.tensor([0, 8], dtype=torch.int32),
            None,
            0.2,
            kv_mode=attention.KV_DIRECT,
            max_keys=8,
            row_pos=True,
            tma=True,
        )


def test_linear_recomputes_for_the_same_tensor_objects(device):
    """No result is cached by tensor identity: the same x and weight objects, changed in place, give the new
    product (a stray lru_cache on the large-batch GPU path once returned the old one and kept every input
    and output alive)."""
    x = randn(300, 64, dtype=torch.bfloat16, device=device, seed=60)
    w = randn(32, 64, dtype=torch.bfloat16, device=device, seed=61)
    first = K.linear(x, w).clone()
    x.mul_(2)
    second = K.linear(x, w)
    assert not torch.equal(first, second)


def test_native_exp_is_refused_on_the_cpu_backend_and_changes_bits_on_the_gpu(device):
    """exp="native" (the GPU's exp2 instruction) takes effect where it exists and is refused where it does
    not; prefill and decode stay bit-equal with it."""
    q, k, v, cu = ragged([300], 8, 2, 64, torch.float32 if INTERPRET else torch.bfloat16, device, seed=33)
    if not primitives.use_triton(q):
        with pytest.raises(ValueError, match="native"):
            K.varlen_attention(q, k, v, cu, 0.125, exp="native")
        return
    with pytest.raises(ValueError, match="exp must be one of"):
        K.varlen_attention(q, k, v, cu, 0.125, exp="fast")
    native = K.varlen_attention(q, k, v, cu, 0.125, exp="native")
    assert not torch.equal(native, K.varlen_attention(q, k, v, cu, 0.125))
    ref = attention.reference(q.double(), k.double(), v.double(), 0.125)
    assert_within("native exp", native, ref, 1e-5 + 1e-5 * ref.abs() if INTERPRET else 2 * ulp_of(ref, q.dtype) + 1e-2)
    if not INTERPRET:
        one = K.causal_attention(q[299:300], k, v, torch.tensor([299], device=device), 0.125, exp="native")
        assert_bitwise_equal("native decode row", one[0], native[299])


def test_strict_ops_compile_into_one_graph_with_eager_bits(device):
    """torch.compile(fullgraph=True) traces every strict op as an opaque custom op (no graph break) and the
    compiled function returns the eager bits (Inductor on the GPU; aot_eager on the CPU, no C++ build)."""
    dt = torch.float32 if INTERPRET else torch.bfloat16
    x, r = randn(5, 64, dtype=dt, device=device, seed=50), randn(5, 64, dtype=dt, device=device, seed=51)
    w, nw = randn(32, 64, dtype=dt, device=device, seed=52), randn(64, dtype=dt, device=device, seed=53)
    q, k = randn(2, 7, 4, 16, dtype=dt, device=device, seed=54), randn(2, 7, 2, 16, dtype=dt, device=device, seed=55)
    pos = torch.arange(7, device=device)[None].expand(2, 7)
    cos, sin = K.rope_tables(64, 16, 1e4, device)
    targets = torch.arange(5, device=device)

    def forward(x, r, w, q, k):
        y = K.linear(x, w)
        normed, residual = K.rms_norm(x, nw, 1e-6, residual=r)
        return (
            y,
            normed,
            residual,
            K.rms_norm(x, nw, 1e-6),
            K.causal_attention(q, k, k, pos, 0.25),
            K.apply_rope(q[0], pos[0], cos, sin),
            K.silu_mul(y, y),
            K.token_logprobs(y, targets),
            K.log_softmax(y),
        )

    with torch.no_grad():
        eager = forward(x, r, w, q, k)
        compiled = torch.compile(forward, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        for i, (a, b) in enumerate(zip(eager, compiled(x, r, w, q, k), strict=True)):
            assert_bitwise_equal(f"output {i}", b, a)


def test_attention_negative_control_sdpa_prefill_vs_decode(device):
    """torch SDPA gives the last token of a causal prefill other bits than decoding it alone (fp32 on this
    CPU; on an H200 the flash and memory-efficient kernels differ for bf16 at a few thousand keys). Under
    ATEN_CPU_CAPABILITY=default on an AVX-512/AMX Xeon, torch 2.13's bf16 CPU SDPA raises "pack_vnni2 is only
    supported when avx512 is supported" (2026-12-06): those cases count as not run, the fp32 one still differs."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    differs = []
    for dtype, n in ((torch.float32, 100), (torch.bfloat16, 100), (torch.bfloat16, 3000)):
        q, k, v = (randn(1, 4, n, 64, dtype=dtype, device=device, seed=5 + i) for i in range(3))
        try:
            differs.append(not torch.equal(sdpa(q, k, v, is_causal=True)[:, :, -1:], sdpa(q[:, :, -1:], k, v)))
        except RuntimeError as error:
            if "pack_vnni2" not in str(error) or os.environ.get("ATEN_CPU_CAPABILITY") != "default":
                raise
    assert any(differs), differs
