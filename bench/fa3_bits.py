"""Does FlashAttention-3 (vLLM's bundle, ``vllm.vllm_flash_attn``) give a query row the same bits in every layout a
strict path would call it in? The first measurement for issue [30] (strict attention as one FlashAttention kernel in
both engines).

    python bench/fa3_bits.py [--out FILE.json]

Causal GQA 32/8, head_dim 128, bf16, one sequence of 2048 tokens (random q, k, v; seed 0). The reference is FA3's
varlen prefill over the whole sequence (``num_splits=1``, unpaged K/V). Each case computes some of its query rows in
another layout and counts the rows whose output differs in any bit from the reference's:
    prefill_paged         the same prefill, K/V in a paged cache (16-token pages, shuffled) through block_table
    decode_alone_*        one query row at position p, keys 0..p from the paged cache (a decode step), for p at and
                          around the 128- and 176-key tile edges; num_splits 1, and 0 (FA3's own split heuristic)
    decode_batch_*        the same rows as one decode batch, and among 243 filler sequences of other lengths
    chunked               query rows 1000..1499 over keys 0..1499 (a chunked prefill's second chunk)
    mixed                 a batch holding that chunk and the decode rows together (vLLM's mixed step)
Then the time of the decode batch (32 and 256 sequences, 4096 keys) with num_splits 1 against 0, and of the prefill
(1k, 4k, 8k) paged against unpaged: graph-free, triton.testing.do_bench medians.
Prints one line per case and writes them all as JSON (``--out``). First run 2026-12-07 on an H100
(docs/log/gpu-sessions.md, eighteenth session): at num_splits=1 every case 0 rows differing; FA3's split heuristic
3 of 16 decode rows.
"""

from __future__ import annotations

import argparse
import json

import torch

H, KVH, D, L, PAGE = 32, 8, 128, 2048, 16
POSITIONS = [0, 1, 15, 16, 127, 128, 129, 175, 176, 177, 255, 256, 511, 1000, 1499, 2047]


def fa(q, k, v, cu_q, max_q, max_k, *, cu_k=None, seqused_k=None, block_table=None, num_splits=1):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        max_seqlen_q=max_q,
        cu_seqlens_q=cu_q,
        max_seqlen_k=max_k,
        cu_seqlens_k=cu_k,
        seqused_k=seqused_k,
        softmax_scale=D**-0.5,
        causal=True,
        block_table=block_table,
        num_splits=num_splits,
        fa_version=3,
    )


def paged(k, v, lengths, generator):
    """A paged cache holding ``k``/``v`` [L, KVH, D] for each sequence of ``lengths`` (each the prefix of the one
    sequence), pages shuffled: (k_cache, v_cache [pages, PAGE, KVH, D], block_table int32 [B, max_pages])."""
    pages_per = [-(-n // PAGE) for n in lengths]
    total = sum(pages_per)
    order = torch.randperm(total, generator=generator).cuda()
    kc = torch.zeros(total, PAGE, KVH, D, dtype=k.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32, device="cuda")
    at = 0
    for b, (n, npg) in enumerate(zip(lengths, pages_per, strict=True)):
        ids = order[at : at + npg]
        at += npg
        table[b, :npg] = ids.int()
        padded = torch.zeros(npg * PAGE, KVH, D, dtype=k.dtype, device="cuda")
        padded[:n] = k[:n]
        kc[ids] = padded.view(npg, PAGE, KVH, D)
        padded[:n] = v[:n]
        vc[ids] = padded.view(npg, PAGE, KVH, D)
    return kc, vc, table


def differing_rows(a, b) -> int:
    """Rows (tokens) of [n, H, D] bf16 outputs with any differing bit."""
    return int((a.view(torch.int16) != b.view(torch.int16)).flatten(1).any(1).sum())


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, H, D, generator=g).to(torch.bfloat16).cuda()
    k = torch.randn(L, KVH, D, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(L, KVH, D, generator=g).to(torch.bfloat16).cuda()
    results = {}

    def record(name, rows, total):
        results[name] = {"rows_differing": rows, "rows": total}
        print(f"{name:32s} {rows:5d} of {total} rows differ from the unpaged prefill", flush=True)

    ref = fa(q, k, v, i32([0, L]), L, L, cu_k=i32([0, L]))
    kc, vc, table = paged(k, v, [L], g)
    out = fa(q, kc, vc, i32([0, L]), L, L, seqused_k=i32([L]), block_table=table)
    record("prefill_paged", differing_rows(out, ref), L)

    for splits in (1, 0):
        rows = 0
        for p in POSITIONS:
            out = fa(
                q[p : p + 1],
                kc,
                vc,
                i32([0, 1]),
                1,
                p + 1,
                seqused_k=i32([p + 1]),
                block_table=table,
                num_splits=splits,
            )
            rows += differing_rows(out, ref[p : p + 1])
        record(f"decode_alone_splits{splits}", rows, len(POSITIONS))
        n = len(POSITIONS)
        out = fa(
            q[POSITIONS],
            kc,
            vc,
            i32(list(range(n + 1))),
            1,
            max(POSITIONS) + 1,
            seqused_k=i32([p + 1 for p in POSITIONS]),
            block_table=table.expand(n, -1).contiguous(),
            num_splits=splits,
        )
        record(f"decode_batch_splits{splits}", differing_rows(out, ref[POSITIONS]), n)
        fillers = torch.randint(1, L, (256 - n,), generator=g).tolist()
        lengths = [p + 1 for p in POSITIONS] + fillers
        kcf, vcf, tablef = paged(k, v, lengths, g)
        rows_q = torch.cat([q[POSITIONS], q[torch.tensor(fillers) - 1]])
        out = fa(
            rows_q, kcf, vcf, i32(list(range(257))), 1, L, seqused_k=i32(lengths), block_table=tablef, num_splits=splits
        )
        record(f"decode_among_fillers_splits{splits}", differing_rows(out[:n], ref[POSITIONS]), n)

    out = fa(q[1000:1500], kc, vc, i32([0, 500]), 500, 1500, seqused_k=i32([1500]), block_table=table)
    record("chunked", differing_rows(out, ref[1000:1500]), 500)
    n = len(POSITIONS)
    rows_q = torch.cat([q[1000:1500], q[POSITIONS]])
    out = fa(
        rows_q,
        kc,
        vc,
        i32([0, 500, *range(501, 501 + n)]),
        500,
        L,
        seqused_k=i32([1500] + [p + 1 for p in POSITIONS]),
        block_table=table.expand(n + 1, -1).contiguous(),
    )
    record("mixed_chunk", differing_rows(out[:500], ref[1000:1500]), 500)
    record("mixed_decodes", differing_rows(out[500:], ref[POSITIONS]), n)

    from triton.testing import do_bench

    timing = {}
    for batch in (1, 32, 256):
        lengths = [4096] * batch
        kk = torch.randn(4096, KVH, D, generator=g).to(torch.bfloat16).cuda()
        kcb, vcb, tableb = paged(kk, kk, lengths, g)
        qb = torch.randn(batch, H, D, generator=g).to(torch.bfloat16).cuda()
        ms = {
            s: do_bench(
                lambda s=s: fa(
                    qb,
                    kcb,
                    vcb,
                    i32(list(range(batch + 1))),
                    1,
                    4096,
                    seqused_k=i32(lengths),
                    block_table=tableb,
                    num_splits=s,
                ),
                return_mode="median",
            )
            for s in (1, 0)
        }
        timing[f"decode_b{batch}_ctx4096"] = {"splits1_ms": ms[1], "splits0_ms": ms[0], "ratio": ms[0] / ms[1]}
        print(
            f"decode b{batch} ctx4096: num_splits=1 {ms[1]:.4f} ms, heuristic {ms[0]:.4f} ms, "
            f"speed of 1 vs heuristic {ms[0] / ms[1]:.3f}",
            flush=True,
        )
    for n in (1024, 4096, 8192):
        qq = torch.randn(n, H, D, generator=g).to(torch.bfloat16).cuda()
        kk = torch.randn(n, KVH, D, generator=g).to(torch.bfloat16).cuda()
        kcp, vcp, tablep = paged(kk, kk, [n], g)
        unpaged = do_bench(lambda: fa(qq, kk, kk, i32([0, n]), n, n, cu_k=i32([0, n])), return_mode="median")
        paged_ms = do_bench(
            lambda: fa(qq, kcp, vcp, i32([0, n]), n, n, seqused_k=i32([n]), block_table=tablep), return_mode="median"
        )
        flops = 4 * n * n * H * D / 2
        timing[f"prefill_{n}"] = {
            "unpaged_ms": unpaged,
            "paged_ms": paged_ms,
            "ratio": unpaged / paged_ms,
            "unpaged_tflops": flops / unpaged / 1e9,
        }
        print(
            f"prefill {n}: unpaged {unpaged:.4f} ms ({flops / unpaged / 1e9:.0f} TFLOP/s), paged {paged_ms:.4f} ms, "
            f"speed of paged vs unpaged {unpaged / paged_ms:.3f}",
            flush=True,
        )
    results["timing"] = timing
    results["gpu"] = torch.cuda.get_device_name()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
