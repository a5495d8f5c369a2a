"""Launch-configuration sweep for the strict matmul and attention on one GPU.

    python3 bench/sweep_gpu.py [--sections matmul,tma,segments,small-m,medium-m,attention,issue19] [--json F]

For each configuration: its time at Qwen3-8B shapes (median of triton.testing.do_bench, random bf16), next
to the default (cuBLAS, SDPA flash), and whether every configuration returns the same bits as the first
for the same inputs. A configuration may be picked by batch size only if it does: that is what keeps a
token's result independent of the batch it is in. Sections: matmul (pointer-kernel tiles), tma (the TMA
kernel, grid and persistent, against the pointer kernel's bits), segments (every way to run the row-parallel
layers' K-segmented product), small-m (the TMA kernel at M = 256), medium-m (every layer at M = 32-128:
candidates for a third batch-size class; added 2026-11-30, not yet run), attention (key chunk sizes, split or not,
the portable and the native exp; prefill and decode), issue19 (issue [19]'s linears at M = 32-256 and 4096 by
narrower TMA tiles and one program per tile and K segment; run 2026-12-02, where the medium class came from),
decode-generation (paged decode at vllm_generate's decode shape against FlashAttention-3: page size, split,
pipelining stages, warps), attention-tma (training's prefill against FlashAttention-3: K/V by the TMA unit,
warp specialization, 64- or 128-row tiles, stages), rmsnorm-rows (Qwen3's per-head q/k norms by rows a
program: the one-row kernel against the multi-row kernel, the default for rows of <= 128 since 12-06).
Tiles and key blocks were swept on 2026-11-29 (docs/log/gpu-sessions.md): all within 10%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from alignaudit_kernels import attention  # noqa: E402
from bench.sweep_matmul import (  # noqa: E402
    DT,
    sweep_issue19,
    sweep_matmul,
    sweep_matmul_tma,
    sweep_medium_m,
    sweep_segments,
    sweep_small_m,
    try_config,
)
from bench.timing import graph_ms, ms  # noqa: E402

CHUNKS = (256, 512, 1024, 4096)  # keys per chunk: the split-KV granularity, one algorithm each


def sweep_attention(rows):
    """Key chunk sizes (the split-KV granularity; each one another algorithm), split or not, portable or native
    exp: prefill at 1k and 4k tokens, paged decode at batch 1, 16 and 256 over 4k keys."""
    h, kvh, d = 32, 8, 128
    sdpa = torch.nn.functional.scaled_dot_product_attention
    n = 4096
    q = torch.randn(n, h, d, dtype=DT, device="cuda")
    k = torch.randn(n, kvh, d, dtype=DT, device="cuda")
    v = torch.randn(n, kvh, d, dtype=DT, device="cuda")
    same = []
    for n_tok in (1024, 4096):
        qs, ks, vs = q[:n_tok], k[:n_tok], v[:n_tok]
        qt, kt, vt = qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
        base = ms(lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True))
        cu = torch.tensor([0, n_tok])
        for chunk in CHUNKS:
            outs = []
            for split, exp in ((False, "portable"), (True, "portable"), (False, "native")):

                def run():
                    return attention._launch_varlen(qs, ks, vs, cu, d**-0.5, chunk_n=chunk, split=split, exp=exp)

                outs.append(run())
                strict = ms(run)
                rows.append(
                    {
                        "op": f"attention prefill {n_tok}",
                        "M": f"chunk {chunk} split {split} {exp}",
                        "config": list(attention.TILE_CONFIG),
                        "default_ms": base,
                        "strict_ms": strict,
                        "ratio": base / strict,
                    }
                )
            same.append(torch.equal(outs[0], outs[1]))
    ctx, block = 4096, 16
    for b in (1, 16, 256):
        kc = torch.randn(b * ctx // block, block, kvh, d, dtype=DT, device="cuda")
        vc = torch.randn_like(kc)
        table = torch.arange(b * ctx // block, device="cuda", dtype=torch.int32).view(b, -1)
        qd = torch.randn(b, h, d, dtype=DT, device="cuda")
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        kd, vd = (x.view(b, ctx, kvh, d).transpose(1, 2) for x in (kc, vc))
        base = graph_ms(lambda: sdpa(qd[:, :, None], kd, vd, enable_gqa=True))
        for chunk in CHUNKS:
            outs = []
            for split in (False, True):

                def run():
                    return attention._launch(
                        qd,
                        kc,
                        vc,
                        table,
                        None,
                        lens,
                        d**-0.5,
                        kv_mode=attention.KV_GATHER,
                        max_keys=ctx,
                        chunk_n=chunk,
                        split=split,
                    )

                outs.append(run())
                strict = graph_ms(run)
                rows.append(
                    {
                        "op": f"attention decode b={b} ctx={ctx} (graph)",
                        "M": f"chunk {chunk} split {split}",
                        "config": list(attention.TILE_CONFIG),
                        "default_ms": base,
                        "strict_ms": strict,
                        "ratio": base / strict,
                    }
                )
            same.append(torch.equal(outs[0], outs[1]))
    print(f"attention: split == unsplit for every chunk size {same}", flush=True)
    return {"split_bitwise_equal": all(same)}


def sweep_decode_generation(rows):
    """Paged decode at the shape of bench/vllm_generate.py's decode steps (64 sequences at 640 keys, the grid
    bounded by max_model_len 832, Qwen3-8B heads), CUDA-graph replays: vLLM's 16-key pages and 64-key pages
    (the kernel's page-aligned mode), split-KV or not, stages 2-4 (software pipelining only) and 8 warps,
    against FlashAttention-3 on the same pages (needs CUDA vLLM). Which configurations give the default's
    bits is in the checks: only those may replace it."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    b, ctx, bound, h, kvh, d = 64, 640, 832, 32, 8, 128
    scale = d**-0.5
    q = torch.randn(b, h, d, dtype=DT, device="cuda")
    keys = torch.randn(b, ctx, kvh, d, dtype=DT, device="cuda")
    values = torch.randn_like(keys)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    cuq = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    reference, same, first = None, {}, len(rows)
    for block in (16, 64):
        pages = ctx // block
        order = torch.randperm(b * pages, device="cuda")
        kc = torch.empty(b * pages, block, kvh, d, dtype=DT, device="cuda")
        vc = torch.empty_like(kc)
        kc[order] = keys.view(b * pages, block, kvh, d)
        vc[order] = values.view(b * pages, block, kvh, d)
        table = order.to(torch.int32).view(b, pages)
        base = graph_ms(
            lambda: flash_attn_varlen_func(
                q,
                kc,
                vc,
                max_seqlen_q=1,
                cu_seqlens_q=cuq,
                max_seqlen_k=bound,
                seqused_k=lens,
                softmax_scale=scale,
                causal=True,
                block_table=table,
                fa_version=3,
            )
        )
        mode = attention._kv_mode(kc)
        for config in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 2)):
            for split in (True, False):

                def run():
                    return attention._launch(
                        q, kc, vc, table, None, lens, scale, kv_mode=mode, max_keys=bound, config=config, split=split
                    )

                out = run()
                reference = out if reference is None else reference
                same[f"block {block} {config} split {split}"] = torch.equal(out, reference)
                strict = graph_ms(run)
                rows.append(
                    {
                        "op": f"decode b={b} ctx={ctx} pages of {block}",
                        "M": f"split {split}",
                        "config": list(config),
                        "default_ms": base,
                        "strict_ms": strict,
                        "ratio": base / strict,
                    }
                )
    for r in rows[first:]:
        print(
            f"{r['op']:34s} {r['M']:12s} {str(r['config']):14s} FA3 {r['default_ms']:.4f} ms  strict "
            f"{r['strict_ms']:.4f} ms  ratio {r['ratio']:.2f}",
            flush=True,
        )
    print("decode at the generation shape, same bits as block 16 (64, 4, 2) split:", same, flush=True)
    return {"decode_generation_same_bits": same}


# Hopper's warp specialization aborts at 4 warps ("unsupported load type for producer commit", Triton 3.8 for
# sm_90): one 4-warp probe for the H200's Triton, the rest at 8
PREFILL_CANDIDATES = [
    ((64, 4, 2), False, False),
    ((64, 4, 2), True, False),
    ((64, 4, 3), True, False),
    ((128, 8, 2), True, False),
    ((128, 8, 3), True, False),
    ((64, 4, 2), True, True),
    ((64, 8, 2), True, True),
    ((128, 8, 2), True, True),
    ((128, 8, 3), True, True),
]


def sweep_attention_tma(rows):
    """Training's prefill (whole sequences, contiguous K/V) at 1k, 4k and 8k tokens and RL batches of 32 x 128
    and 8 x 512, GQA 32/8, head_dim 128,
    against FlashAttention-3 (from CUDA vLLM; without it torch's SDPA flash, one sequence at a time, and the rows
    say so): the whole key blocks read by the TMA unit or not, that loop warp-specialized or not, tiles of 64 or
    128 rows (two 64-row wgmma tiles), stages 2-3; each checked against the default launch's bits. A candidate
    that fails to compile is printed and skipped."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        anchor = "FA3"
    except ImportError:
        flash_attn_varlen_func, anchor = None, "SDPA"

    h, kvh, d = 32, 8, 128
    scale = d**-0.5
    same, first = [], len(rows)
    for count, n in ((1, 1024), (1, 4096), (1, 8192), (32, 128), (8, 512)):  # RL batches: one key chunk, no merge
        q = torch.randn(count * n, h, d, dtype=DT, device="cuda")
        k = torch.randn(count * n, kvh, d, dtype=DT, device="cuda")
        v = torch.randn(count * n, kvh, d, dtype=DT, device="cuda")
        cu = torch.arange(count + 1) * n
        cu32 = cu.to(device="cuda", dtype=torch.int32)
        if flash_attn_varlen_func is None:
            qt, kt, vt = (x.view(count, n, -1, d).transpose(1, 2) for x in (q, k, v))
            base = ms(
                lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            )
        else:
            base = ms(
                lambda: flash_attn_varlen_func(
                    q,
                    k,
                    v,
                    max_seqlen_q=n,
                    cu_seqlens_q=cu32,
                    max_seqlen_k=n,
                    cu_seqlens_k=cu32,
                    softmax_scale=scale,
                    causal=True,
                    fa_version=3,
                )
            )
        label = f"{count} x {n}" if count > 1 else n
        expected = attention._launch_varlen(q, k, v, cu, scale)
        for config, tma, ws in PREFILL_CANDIDATES:

            def run(config=config, tma=tma, ws=ws):
                return attention._launch_varlen(q, k, v, cu, scale, config=config, tma=tma, ws=ws)

            try_config(
                rows,
                same,
                run,
                expected,
                ms,
                op=f"prefill {label} vs {anchor}",
                M=f"tma {tma} ws {ws}",
                config=list(config),
                default_ms=base,
            )
    for r in rows[first:]:
        print(
            f"{r['op']:24s} {r['M']:18s} {str(r['config']):12s} {anchor} {r['default_ms']:.4f} ms  strict "
            f"{r['strict_ms']:.4f} ms  of {anchor} {r['ratio']:.3f}",
            flush=True,
        )
    print(
        f"attention-tma: every candidate gives the default's bits {all(same)} ({len(same)} checks, "
        f"{same.count(False)} unequal)",
        flush=True,
    )
    return {"attention_tma_bitwise_equal": all(same), "attention_tma_checks": len(same)}


RMSNORM_ROWS = (2, 4, 8, 16, 32)  # rows a program of rmsnorm._rmsnorm_rows_kernel


def sweep_rmsnorm_rows(rows):
    """Qwen3's per-head q/k norms (head_dim 128, read in place from the fused qkv output as vLLM's and the HF
    forward's are) by rows a program: the one-row kernel (the default, a 1-warp program per row) against the
    multi-row candidate, as CUDA-graph replays beside torch's rms_norm on the same view. Each candidate is checked
    for what a default must keep: the rows of a 7-token batch equal to the same rows of the whole batch (batch
    invariance); and whether its bits equal the one-row kernel's (expected: for sm_90 it builds to that kernel's
    arithmetic, tests/kernels/test_kernels_compile.py), the condition for a default that changes no result. Both are
    kept in each configuration's row (``batch_invariant``, ``one_row_bits``)."""
    from alignaudit_kernels import rmsnorm

    d, eps = 128, 1e-6
    w = torch.randn(d, dtype=DT, device="cuda") * 0.2 + 1
    first = len(rows)
    shapes = (
        (4096, 0, 32, "Qwen3-8B q, 4096 tokens"),
        (4096, 32, 8, "Qwen3-8B k, 4096 tokens"),
        (2048, 0, 16, "Qwen3-1.7B q, 2048 tokens (RL prefill)"),
        (64, 0, 32, "Qwen3-8B q, 64 tokens (decode)"),
    )
    for tokens, start, heads, label in shapes:  # start: the first head of the [q | k | v] columns normalized
        qkv = torch.randn(tokens, 48 * d, dtype=DT, device="cuda")  # Qwen3-8B's [q | k | v]: 32 + 8 + 8 heads
        x = qkv[:, start * d : (start + heads) * d].view(tokens, heads, d)
        base = graph_ms(lambda: torch.nn.functional.rms_norm(x, (d,), w, eps))
        default = rmsnorm._triton(x, w, eps, None, heads=heads, rows=1)[0]
        one_row = graph_ms(lambda: rmsnorm._triton(x, w, eps, None, heads=heads, rows=1))
        rows.append(
            {
                "op": f"q/k rmsnorm {label}",
                "M": 1,
                "config": "one row a program",
                "default_ms": base,
                "strict_ms": one_row,
                "ratio": base / one_row,
            }
        )
        for count in RMSNORM_ROWS:

            def run(count=count):
                return rmsnorm._triton(x, w, eps, None, heads=heads, rows=count)[0]

            try:
                whole = run()
                part = rmsnorm._triton(x[:7], w, eps, None, heads=heads, rows=count)[0]
            except Exception as e:  # noqa: BLE001 - a sweep reports what failed and goes on
                print(f"q/k rmsnorm {label} {count} rows: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            try_config(
                rows,
                [],
                run,
                None,
                graph_ms,
                op=f"q/k rmsnorm {label}",
                M=count,
                config=f"{count} rows a program",
                default_ms=base,
                batch_invariant=torch.equal(part, whole[: 7 * heads]),
                one_row_bits=torch.equal(whole, default),
            )
    candidates = [r for r in rows[first:] if "one_row_bits" in r]
    for r in rows[first:]:
        print(
            f"{r['op']:44s} {str(r['config']):28s} torch {r['default_ms']:.4f} ms  strict {r['strict_ms']:.4f} ms  "
            f"ratio {r['ratio']:.2f}  invariant {r.get('batch_invariant', '-')}  one-row bits "
            f"{r.get('one_row_bits', '-')}",
            flush=True,
        )
    invariant = all(r["batch_invariant"] for r in candidates)
    same = all(r["one_row_bits"] for r in candidates)
    print(
        f"rmsnorm-rows: {len(candidates)} candidates timed; all batch invariant {invariant}; all with the one-row "
        f"kernel's bits {same}",
        flush=True,
    )
    return {"rmsnorm_rows_batch_invariant": invariant, "rmsnorm_rows_one_row_bits": same}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--sections",
        default="matmul,tma,attention",
        help="comma list of matmul, tma, segments, small-m, medium-m, attention, issue19, "
        "decode-generation (needs CUDA vLLM), attention-tma, rmsnorm-rows",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    sections = {
        "matmul": sweep_matmul,
        "tma": sweep_matmul_tma,
        "segments": sweep_segments,
        "small-m": sweep_small_m,
        "medium-m": sweep_medium_m,
        "attention": sweep_attention,
        "issue19": sweep_issue19,
        "decode-generation": sweep_decode_generation,
        "attention-tma": sweep_attention_tma,
        "rmsnorm-rows": sweep_rmsnorm_rows,
    }
    checks = {}
    for name in args.sections.split(","):
        checks.update(sections[name](rows))
    best = {}
    for r in rows:
        key = (r["op"], r.get("M"))
        if key not in best or r["ratio"] > best[key]["ratio"]:
            best[key] = r
    print(f"{'op':36s} {'M':>30s} {'best config':>24s} {'default ms':>10s} {'strict ms':>10s} {'ratio':>6s}")
    for (op, m), r in best.items():
        print(
            f"{op:36s} {str(m or ''):>30s} {str(r['config']):>24s} {r['default_ms']:10.4f} {r['strict_ms']:10.4f} "
            f"{r['ratio']:6.2f}"
        )
    print("checks:", checks)
    if args.json:
        args.json.write_text(json.dumps({"checks": checks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
