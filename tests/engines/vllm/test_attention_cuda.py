"""The CUDA vLLM strict attention backend's plan and arithmetic, run on the CPU with vLLM's own classes.

vLLM's CPU platform never selects FLASH_ATTN, so CI cannot run the backend inside an engine; the H200 does
(bench/gpu_run.sh vllm-*, docs/log/findings.md). What runs here is everything of it but the cache write (vLLM's
reshape_and_cache_flash, a copy): the metadata builder on vLLM's CommonAttentionMetadata, and
``strict_attention`` over a KV cache laid out as FlashAttention's (logical [blocks, kv_heads, block_size,
2 * head_dim], stored [blocks, block_size, kv_heads, 2 * head_dim]), on the kernels' CPU backend.

Chain of reasoning:
1. A mixed batch (a prefill from position 0, a chunked prefill's second chunk, a decode token), planned by
   the builder, gives every query row the bits of a whole-sequence prefill (varlen_attention, Megatron's
   strict attention) at its position; the step's first layer plans the query tiles and later layers reuse them.
2. A decode batch, padded as vLLM pads a CUDA graph's batch (a request with seq_lens 0), takes the
   paged_decode path and gives the same bits; the padded row does not disturb the others.
Negative control: the same plan with the context lengths dropped (positions from 0) differs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

import alignaudit_kernels as K  # noqa: E402
from alignaudit.engines.vllm.attention_cuda import (  # noqa: E402
    StrictAttentionMetadataBuilder,
    strict_attention,
    warm_up,
)
from alignaudit_kernels.attention import CHUNK_N, SPLIT_BELOW_PROGRAMS_PER_SM  # noqa: E402
from helpers import assert_bitwise_equal  # noqa: E402

HEADS, KV_HEADS, D, BLOCK = 4, 2, 32, 16
LENGTHS = (7, 12, 40)  # tokens of each sequence; the batch computes the last rows of each
SCALE = D**-0.5


@pytest.fixture(scope="module")
def world():
    """Whole sequences (q, k, v per position), their prefill, and a FlashAttention-layout cache holding them
    in scattered pages."""
    g = torch.Generator().manual_seed(0)
    seqs = [
        tuple(torch.randn(n, h, D, generator=g).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
        for n in LENGTHS
    ]
    prefill = [K.varlen_attention(q, k, v, torch.tensor([0, len(q)]), SCALE) for q, k, v in seqs]
    pages = [(len(q) + BLOCK - 1) // BLOCK for q, _, _ in seqs]
    order = torch.randperm(sum(pages) + 1, generator=g)[1:]  # page 0 left empty: vLLM's null block
    stored = torch.zeros(sum(pages) + 1, BLOCK, KV_HEADS, 2 * D, dtype=torch.bfloat16)
    kv_cache = stored.permute(0, 2, 1, 3)  # the logical shape FlashAttention's backend receives
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    table = torch.zeros(len(seqs) + 1, max(pages), dtype=torch.int32)  # one padded request row
    first = 0
    for i, ((q, k, v), n_pages) in enumerate(zip(seqs, pages, strict=True)):
        table[i, :n_pages] = order[first : first + n_pages].int()
        first += n_pages
        for p in range(len(q)):
            key_cache[table[i, p // BLOCK], p % BLOCK] = k[p]
            value_cache[table[i, p // BLOCK], p % BLOCK] = v[p]
    return SimpleNamespace(seqs=seqs, prefill=prefill, kv_cache=kv_cache, table=table)


def build(world, q_lens, seq_lens, pad_tokens=0):
    """The builder's plan for one step: request i computes its last q_lens[i] of seq_lens[i] tokens."""
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(q_lens),
        num_actual_tokens=int(starts[-1]) + pad_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=world.table[: len(q_lens)],
        slot_mapping=torch.zeros(int(starts[-1]) + pad_tokens, dtype=torch.int64),
    )
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))
    return StrictAttentionMetadataBuilder(None, [], config, torch.device("cpu")).build(0, common)


def run(world, meta, rows):
    """strict_attention on the query rows ``rows`` [(sequence, position)]; output rows past them poisoned."""
    query = torch.stack([world.seqs[s][0][p] for s, p in rows] + [torch.zeros(HEADS, D, dtype=torch.bfloat16)] * 2)
    output = torch.full_like(query, float("nan"))
    return strict_attention(meta, query, world.kv_cache, D, SCALE, "portable", output)


def expected(world, rows):
    return torch.stack([world.prefill[s][p] for s, p in rows])


def test_mixed_batch_rows_get_the_prefill_bits(world):
    q_lens, seq_lens = (7, 7, 1), (7, 12, 9)  # prefill from 0; second chunk (5 computed); decode at 8
    rows = [(s, p) for s, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True)) for p in range(n - q, n)]
    meta = build(world, q_lens, seq_lens, pad_tokens=2)
    assert not meta.decode and meta.num_actual_tokens == 15 and meta.q_seq.tolist() == [0] * 7 + [1] * 7 + [2]
    assert meta.positions.tolist() == list(range(7)) + list(range(5, 12)) + [8]
    assert meta.positions.dtype == torch.int32 and meta.tiles is None
    out = run(world, meta, rows)
    assert_bitwise_equal("mixed batch rows", out[:15], expected(world, rows))
    assert out[15:].isnan().all()  # vLLM's padding rows are left alone
    planned = meta.tiles  # the step's first layer planned its query tiles for every layer
    assert (planned.group, planned.rows) == (HEADS // KV_HEADS, 15)
    assert torch.equal(planned.tiles[0], torch.tensor([0, 1, 2], dtype=torch.int32))  # a tile per request's rows
    run(world, meta, rows)
    assert meta.tiles is planned  # a later layer reuses them
    wide = torch.zeros(len(rows) + 2, 2 * HEADS, D, dtype=torch.bfloat16)  # a layer of another head group re-plans
    strict_attention(meta, wide, world.kv_cache, D, SCALE, "portable", torch.empty_like(wide))
    assert meta.tiles is not planned and meta.tiles.group == 2 * HEADS // KV_HEADS

    shifted = build(world, q_lens, tuple(q_lens))  # context dropped: every request from position 0
    assert not torch.equal(run(world, shifted, rows)[:15].view(torch.int16), expected(world, rows).view(torch.int16))


def test_padded_decode_batch_takes_paged_decode_with_the_prefill_bits(world):
    seq_lens = (7, 12, 40, 0)  # the last: a padded request of a CUDA graph's batch (vLLM: seq_lens 0)
    rows = [(0, 6), (1, 11), (2, 39)]
    meta = build(world, (1, 1, 1, 1), seq_lens)
    assert meta.decode and meta.positions is None and meta.decode_bound == 64
    query = torch.stack([world.seqs[s][0][p] for s, p in rows] + [torch.zeros(HEADS, D, dtype=torch.bfloat16)])
    out = strict_attention(meta, query, world.kv_cache, D, SCALE, "portable", torch.empty_like(query))
    assert_bitwise_equal("decode rows", out[:3], expected(world, rows))


def test_builder_refuses_what_it_does_not_compute(world):
    starts = torch.tensor([0, 4], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor([4], dtype=torch.int32),
        num_reqs=1,
        num_actual_tokens=4,
        max_query_len=4,
        max_seq_len=4,
        block_table_tensor=world.table[:1],
        slot_mapping=torch.zeros(4, dtype=torch.int64),
    )
    builder = StrictAttentionMetadataBuilder(
        None, [], SimpleNamespace(model_config=SimpleNamespace(max_model_len=8)), torch.device("cpu")
    )
    with pytest.raises(NotImplementedError, match="cascade"):
        builder.build(2, common)
    common.causal = False
    with pytest.raises(NotImplementedError, match="causal"):
        builder.build(0, common)


def test_warm_up_runs_each_kind_of_step_once(monkeypatch):
    """The engine-start warm-up (each Triton variant built before the first batch, on the GPU) goes through
    strict_attention with a prefill inside one key chunk, one over two chunks (the split-KV kernel) and a
    decode step bounded by max_model_len (one sequence: split-KV; enough to fill the SMs: not), each giving
    finite rows, over a block table as wide as vLLM's
    (Triton specializes its row stride: 256 pages at max_model_len 4096 is another variant than 52 at 832)."""
    calls = []

    def spy(kind, kernel):
        def call(q, *args, **kwargs):
            out = kernel(q, *args, **kwargs)
            bound = kwargs.get("max_keys", args[5] if kind == "decode" else None)
            calls.append((kind, q.shape[0], -(-bound // CHUNK_N), args[2].stride(0), bool(torch.isfinite(out).all())))
            return out

        return call

    unsplit = SPLIT_BELOW_PROGRAMS_PER_SM // KV_HEADS  # decode sequences that fill one "SM" (the CPU's count)
    monkeypatch.setattr(K, "paged_attention", spy("prefill", K.paged_attention))
    monkeypatch.setattr(K, "paged_decode", spy("decode", K.paged_decode))
    for max_model_len, pages in ((832, 52), (4096, 256)):
        calls.clear()
        warm_up(
            HEADS, KV_HEADS, D, BLOCK, torch.bfloat16, torch.bfloat16, torch.device("cpu"), "portable", max_model_len
        )
        chunks = -(-max_model_len // CHUNK_N)
        assert calls == [
            ("prefill", 64, 1, pages, True),
            ("prefill", 576, 2, pages, True),
            ("decode", 1, chunks, pages, True),
            ("decode", unsplit, chunks, pages, True),
        ]
    calls.clear()  # max_model_len within one chunk: no two-chunk prefill can occur, none is run
    warm_up(HEADS, KV_HEADS, D, BLOCK, torch.bfloat16, torch.bfloat16, torch.device("cpu"), "portable", 300)
    assert calls == [
        ("prefill", 64, 1, 19, True),
        ("prefill", 300, 1, 19, True),
        ("decode", 1, 1, 19, True),
        ("decode", unsplit, 1, 19, True),
    ]
