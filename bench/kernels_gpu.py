"""Strict kernels vs the default (cuBLAS, torch SDPA flash, torch ops) on one GPU, measured side by side.

    python3 bench/kernels_gpu.py [--quick] [--sections matmul,memory,attention,attention-backward] [--json OUT.json]

Every number is the median of triton.testing.do_bench over fresh random bf16 inputs (never zeros), and
every row prints strict / default as a throughput ratio (>1: strict is faster). Matmul and the memory-bound
kernels are also timed as CUDA-graph replays (triton.testing.do_bench_cudagraph, column "graph": GPU time
without Python launch overhead, the way vLLM runs decode; no L2 flush between replays, so weights that fit
in L2 stay there for both sides). Attention is timed both ways too (the strict prefill's launch plan is
cached on the device after the warm-up call, so the replay needs no host work), each with the portable and
the native exp (kernels/alignaudit_kernels/attention/). The decode default is SDPA over the same keys laid out
contiguously. Section attention-fa3 (needs CUDA vLLM) measures the same kernels against vLLM's FlashAttention-3, issue
[19]'s reference. Memory-bound
kernels also
print their fraction of the copy-bandwidth bound measured in the same run (a device-to-device copy of the
same bytes). Shapes are Qwen3-8B's (hidden 4096, 32 query heads, 8 KV heads, head_dim 128, vocab 151936).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402
from bench.timing import graph_ms, ms  # noqa: E402

DT = torch.bfloat16
# (K, N, K segments): the row-parallel layers (attention output, MLP down) reduce K in the segments every
# engine's strict path uses (kernels/alignaudit_kernels/matmul.ROW_PARALLEL_SEGMENTS), the others in one
RP = K.matmul.ROW_PARALLEL_SEGMENTS
LINEARS = {
    "qkv": (4096, 6144, 1),
    "o": (4096, 4096, RP),
    "gate_up": (4096, 24576, 1),
    "down": (12288, 4096, RP),
    "lm_head": (4096, 151936, 1),
}


def side_by_side(default, strict) -> dict:
    """Both timings of a default/strict pair: eager (launch overhead included) and CUDA-graph replay (after
    an eager warm-up call; a side that cannot be captured is reported, not timed)."""
    base, mine = ms(default), ms(strict)
    timing = {"default_ms": base, "strict_ms": mine, "ratio": base / mine}
    try:
        graph_base = graph_ms(default)
        graph_mine = graph_ms(strict)
    except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
        torch.cuda.synchronize()
        return {**timing, "graph_error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    return {
        **timing,
        "default_graph_ms": graph_base,
        "strict_graph_ms": graph_mine,
        "graph_ratio": graph_base / graph_mine,
    }


def copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return ms(lambda: dst.copy_(src))


def bench_matmul(ms_list, layers=tuple(LINEARS)):
    rows = []
    for name in layers:
        k, n, segments = LINEARS[name]
        w = torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5
        for m in ms_list:
            x = torch.randn(m, k, dtype=DT, device="cuda")
            timing = side_by_side(lambda: torch.nn.functional.linear(x, w), lambda: K.linear(x, w, k_segments=segments))
            tflops = 2 * m * n * k / timing["strict_ms"] / 1e9
            label = f"matmul {name} {k}x{n}" + (f" ({segments} K segments)" if segments > 1 else "")
            rows.append({"op": label, "layer": name, "M": m, **timing, "strict_tflops": tflops})
    return rows


def bench_memory_bound():
    rows = []
    t, h = 16384, 4096
    x = torch.randn(t, h, dtype=DT, device="cuda")
    r = torch.randn(t, h, dtype=DT, device="cuda")
    w = torch.randn(h, dtype=DT, device="cuda")
    bound = copy_ms(x.nbytes)  # read x, write y: the same bytes a copy moves
    timing = side_by_side(lambda: torch.nn.functional.rms_norm(x, (h,), w, 1e-6), lambda: K.rms_norm(x, w, 1e-6))
    rows.append({"op": "rmsnorm 16384x4096", **timing, "of_copy_bound": bound / timing["strict_ms"]})
    bound_res = copy_ms(2 * x.nbytes)  # read x, r; write y, s
    timing = side_by_side(
        lambda: torch.nn.functional.rms_norm(x + r, (h,), w, 1e-6), lambda: K.rms_norm(x, w, 1e-6, residual=r)
    )
    rows.append({"op": "add+rmsnorm 16384x4096", **timing, "of_copy_bound": bound_res / timing["strict_ms"]})
    q = torch.randn(t, 32, 128, dtype=DT, device="cuda")
    pos = torch.randint(0, 32768, (t,), device="cuda")
    cos, sin = K.rope_tables(32768, 128, 1e6, "cuda")

    def torch_rope():
        c, s = cos[pos][:, None].to(DT), sin[pos][:, None].to(DT)
        x1, x2 = q[..., :64], q[..., 64:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    bound = copy_ms(q.nbytes)
    timing = side_by_side(torch_rope, lambda: K.apply_rope(q, pos, cos, sin))
    rows.append({"op": "rope 16384x32x128", **timing, "of_copy_bound": bound / timing["strict_ms"]})
    logits = torch.randn(4096, 151936, dtype=DT, device="cuda") * 3
    bound = copy_ms(logits.nbytes * 3)  # read bf16, write fp32 (2x the bytes)
    timing = side_by_side(lambda: torch.log_softmax(logits.float(), -1), lambda: K.log_softmax(logits))
    rows.append({"op": "log_softmax 4096x151936", **timing, "of_copy_bound": bound / timing["strict_ms"]})
    targets = torch.randint(0, 151936, (4096,), device="cuda")
    bound = copy_ms(logits.nbytes)
    timing = side_by_side(
        lambda: torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]),
        lambda: K.token_logprobs(logits, targets),
    )
    rows.append({"op": "token_logprobs 4096x151936", **timing, "of_copy_bound": bound / timing["strict_ms"]})
    return rows


def bench_attention(lengths, decode_batches):
    rows = []
    h, kvh, d = 32, 8, 128
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for n in lengths:
        q = torch.randn(n, h, d, dtype=DT, device="cuda")
        k = torch.randn(n, kvh, d, dtype=DT, device="cuda")
        v = torch.randn(n, kvh, d, dtype=DT, device="cuda")
        cu = torch.tensor([0, n])
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        for exp in K.attention.EXP_CHOICES:
            timing = side_by_side(
                lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True),
                lambda: K.varlen_attention(q, k, v, cu, d**-0.5, exp=exp),
            )
            rows.append({"op": f"attention prefill {n} ({exp} exp)", **timing})
    ctx = 4096
    for b in decode_batches:
        block = 16  # vLLM's default page size
        pages = ctx // block
        kc = torch.randn(b * pages, block, kvh, d, dtype=DT, device="cuda")
        vc = torch.randn_like(kc)
        table = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
        q = torch.randn(b, h, d, dtype=DT, device="cuda")
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        kd = kc.view(b, ctx, kvh, d).transpose(1, 2)
        vd = vc.view(b, ctx, kvh, d).transpose(1, 2)
        for exp in K.attention.EXP_CHOICES:
            timing = side_by_side(
                lambda: sdpa(q[:, :, None], kd, vd, enable_gqa=True),
                lambda: K.paged_decode(q, kc, vc, table, lens, d**-0.5, ctx, exp=exp),
            )
            rows.append({"op": f"attention decode b={b} ctx={ctx} ({exp} exp)", **timing})
    return rows


def bench_attention_backward(lengths, tokens=16384):
    """The strict attention's backward against torch's SDPA backward alone (its default backend, the forward run once
    outside the timing; and the backend torch picks under its deterministic mode, forward and backward under it, as
    the strict backward runs: cuDNN's SDPA is excluded there, torch's sdp_utils.cpp check_cudnn_deterministic):
    sequences of each length filling ``tokens`` tokens, GQA 32/8, d 128, bf16. Rows:
    torch_reference.attention_gradients at each ALIGNAUDIT_BACKWARD (they recompute their forward inside), and
    varlen_attention's own backward with
    ALIGNAUDIT_BACKWARD=fused (FlashAttention-2's varlen backward fed the strict forward's output and log-sum-exp:
    what a Megatron step runs). Ratio: SDPA backward ms (not deterministic) / the row's ms."""
    import os

    from alignaudit_kernels import gradients
    from alignaudit_kernels.attention import flash_gradients, torch_reference

    rows = []
    h, kvh, d = 32, 8, 128
    for n in lengths:
        b = max(1, tokens // n)
        q = torch.randn(b, n, h, d, dtype=DT, device="cuda")
        k = torch.randn(b, n, kvh, d, dtype=DT, device="cuda")
        v = torch.randn(b, n, kvh, d, dtype=DT, device="cuda")
        g = torch.randn_like(q)
        positions = torch.arange(n, device="cuda").expand(b, n)
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        gt = g.transpose(1, 2)
        flash = lambda out=out, gt=gt, ins=(qt, kt, vt): torch.autograd.grad(out, ins, gt, retain_graph=True)  # noqa: E731
        base = ms(flash)
        with flash_gradients.deterministic_algorithms():  # the forward too: torch then picks a deterministic backend
            out_det = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            deterministic = ms(
                lambda out=out_det, gt=gt, ins=(qt, kt, vt): torch.autograd.grad(out, ins, gt, retain_graph=True)
            )
        rows.append(
            {
                "op": f"attention backward {b}x{n} (SDPA under deterministic mode)",
                "default_ms": base,
                "strict_ms": deterministic,
                "ratio": base / deterministic,
            }
        )
        for how in (*gradients.BACKWARDS, "fused, varlen"):
            os.environ[gradients.BACKWARD_ENV] = how.split(",")[0]
            try:
                if how == "fused, varlen":
                    ins = [t.flatten(0, 1).detach().requires_grad_() for t in (q, k, v)]
                    cu = torch.arange(0, b * n + 1, n)
                    strict_out = K.varlen_attention(*ins, cu, d**-0.5)
                    gf = g.flatten(0, 1)
                    strict = lambda o=strict_out, ins=ins, gf=gf: torch.autograd.grad(o, ins, gf, retain_graph=True)  # noqa: E731
                else:
                    strict = lambda: torch_reference.attention_gradients(q, k, v, g, d**-0.5, positions)  # noqa: E731
                mine = ms(strict)
                rows.append(
                    {
                        "op": f"attention backward {b}x{n} ({how})",
                        "default_ms": base,
                        "strict_ms": mine,
                        "ratio": base / mine,
                    }
                )
            except torch.OutOfMemoryError as e:
                rows.append(
                    {
                        "op": f"attention backward {b}x{n} ({how})",
                        "default_ms": float("nan"),
                        "strict_ms": float("nan"),
                        "ratio": float("nan"),
                        "graph_error": str(e)[:200],
                    }
                )
            finally:
                os.environ.pop(gradients.BACKWARD_ENV)
                torch.cuda.empty_cache()
    return rows


def bench_attention_fa3(lengths, decode_batches):
    """Against vLLM's FlashAttention-3 (vllm.vllm_flash_attn.flash_attn_varlen_func, fa_version=3), the
    attention vLLM runs by default on Hopper: causal varlen prefill of one sequence, and paged decode over
    16-key pages (vLLM's page size; one query per sequence, seqused_k = the context, as vLLM's FlashAttention
    backend calls it under full CUDA graphs: scheduler metadata computed ahead, at most 32 splits, its
    flash_attn_max_num_splits_for_cuda_graph). Strict: varlen_attention / paged_decode on the same
    tensors. Prefill as eager launches and graph replays, decode as graph replays (the way vLLM decodes)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    rows = []
    h, kvh, d = 32, 8, 128
    scale = d**-0.5
    for n in lengths:
        q = torch.randn(n, h, d, dtype=DT, device="cuda")
        k = torch.randn(n, kvh, d, dtype=DT, device="cuda")
        v = torch.randn(n, kvh, d, dtype=DT, device="cuda")
        cu = torch.tensor([0, n])
        cu32 = cu.to(device="cuda", dtype=torch.int32)

        def fa3(q=q, k=k, v=v, n=n, cu32=cu32):
            return flash_attn_varlen_func(
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

        flops = 4 * n * n * h * d / 2  # causal: QK^T and PV over half the square
        for exp in K.attention.EXP_CHOICES:
            timing = side_by_side(fa3, lambda: K.varlen_attention(q, k, v, cu, scale, exp=exp))
            rows.append(
                {
                    "op": f"attention prefill {n} ({exp} exp) vs FA3",
                    "target": "prefill",
                    "tokens": n,
                    "exp": exp,
                    **timing,
                    "fa3_tflops": flops / timing["default_ms"] / 1e9,
                    "strict_tflops": flops / timing["strict_ms"] / 1e9,
                }
            )
    ctx, block = 4096, 16
    for b in decode_batches:
        pages = ctx // block
        kc = torch.randn(b * pages, block, kvh, d, dtype=DT, device="cuda")
        vc = torch.randn_like(kc)
        table = torch.randperm(b * pages, device="cuda").to(torch.int32).view(b, pages)
        q = torch.randn(b, h, d, dtype=DT, device="cuda")
        lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
        cuq = torch.arange(b + 1, device="cuda", dtype=torch.int32)
        try:
            meta, splits = (
                get_scheduler_metadata(
                    batch_size=b,
                    max_seqlen_q=1,
                    max_seqlen_k=ctx,
                    num_heads_q=h,
                    num_heads_kv=kvh,
                    headdim=d,
                    cache_seqlens=lens,
                    qkv_dtype=DT,
                    cu_seqlens_q=cuq,
                    page_size=block,
                    causal=True,
                    num_splits=32,
                ),
                32,
            )
        except Exception as e:  # noqa: BLE001 - then FA3's own heuristics, and the row says so
            print(f"FA3 scheduler metadata failed ({type(e).__name__}: {e}); FA3 splits by its heuristics", flush=True)
            meta, splits = None, 0

        def fa3_decode(q=q, kc=kc, vc=vc, table=table, lens=lens, cuq=cuq, meta=meta, splits=splits):
            return flash_attn_varlen_func(
                q,
                kc,
                vc,
                max_seqlen_q=1,
                cu_seqlens_q=cuq,
                max_seqlen_k=ctx,
                seqused_k=lens,
                softmax_scale=scale,
                causal=True,
                block_table=table,
                scheduler_metadata=meta,
                num_splits=splits,
                fa_version=3,
            )

        for exp in K.attention.EXP_CHOICES:
            timing = side_by_side(fa3_decode, lambda: K.paged_decode(q, kc, vc, table, lens, scale, ctx, exp=exp))
            rows.append(
                {
                    "op": f"attention decode b={b} ctx={ctx} ({exp} exp) vs FA3",
                    "target": "decode",
                    "batch": b,
                    "exp": exp,
                    "fa3_max_splits": splits,
                    **timing,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--sections",
        default="matmul,memory,attention",
        help="comma list of matmul, memory, attention, attention-fa3 (needs CUDA vLLM), attention-backward",
    )
    parser.add_argument("--ms", help="comma list of matmul batch sizes (M), instead of the --quick or full set")
    parser.add_argument("--layers", default=",".join(LINEARS), help=f"comma list of {', '.join(LINEARS)}")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows = []
    if "matmul" in sections:
        ms_list = (
            tuple(int(m) for m in args.ms.split(","))
            if args.ms
            else (1, 16, 256, 4096)
            if args.quick
            else (1, 16, 256, 4096, 16384)
        )
        rows += bench_matmul(ms_list, args.layers.split(","))
    if "memory" in sections:
        rows += bench_memory_bound()
    if "attention" in sections:
        rows += bench_attention(
            (1024, 4096) if args.quick else (1024, 4096, 16384), (1, 16, 256) if args.quick else (1, 4, 16, 64, 256)
        )
    if "attention-fa3" in sections:
        rows += bench_attention_fa3((1024, 4096), (1, 32, 256))
    if "attention-backward" in sections:
        rows += bench_attention_backward((1024, 4096, 8192))
    print(f"{'op':44s} {'M':>6s} {'default ms':>11s} {'strict ms':>10s} {'ratio':>6s} {'graph':>6s}  extra")
    for r in rows:
        extra = (
            f"{r['strict_tflops']:.0f} TFLOP/s" + (f" (FA3 {r['fa3_tflops']:.0f})" if "fa3_tflops" in r else "")
            if "strict_tflops" in r
            else (f"{r['of_copy_bound']:.2f} of copy bound" if "of_copy_bound" in r else "")
        )
        graph = f"{r['graph_ratio']:6.2f}" if "graph_ratio" in r else " " * 6
        extra = extra or (f"not captured: {r['graph_error']}" if "graph_error" in r else "")
        print(
            f"{r['op']:44s} {str(r.get('M', '')):>6s} {r['default_ms']:11.4f} {r['strict_ms']:10.4f} "
            f"{r['ratio']:6.2f} {graph}  {extra}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
