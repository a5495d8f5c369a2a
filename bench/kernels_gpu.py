"""Strict kernels vs the default (cuBLAS, torch SDPA flash, torch ops) on one GPU, measured side by side.

    python3 bench/kernels_gpu.py [--quick] [--sections matmul,memory,attention] [--json OUT.json]

Every number is the median of triton.testing.do_bench over fresh random bf16 inputs (never zeros), and
every row prints strict / default as a throughput ratio (>1: strict is faster). Matmul and the memory-bound
kernels are also timed as CUDA-graph replays (triton.testing.do_bench_cudagraph, column "graph": GPU time
without Python launch overhead, the way vLLM runs decode; no L2 flush between replays, so weights that fit
in L2 stay there for both sides). Attention is timed both ways too (the strict prefill's launch plan is
cached on the device after the warm-up call, so the replay needs no host work), each with the portable and
the native exp (kernels/attention.py). The decode default is SDPA over the same keys laid out contiguously. Memory-bound
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
# engine's strict path uses (kernels/matmul.ROW_PARALLEL_SEGMENTS), the others in one
RP = K.matmul.ROW_PARALLEL_SEGMENTS
LINEARS = {"qkv": (4096, 6144, 1), "o": (4096, 4096, RP), "gate_up": (4096, 24576, 1), "down": (12288, 4096, RP),
           "lm_head": (4096, 151936, 1)}


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
    return {**timing, "default_graph_ms": graph_base, "strict_graph_ms": graph_mine,
            "graph_ratio": graph_base / graph_mine}


def copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return ms(lambda: dst.copy_(src))


def bench_matmul(ms_list):
    rows = []
    for name, (k, n, segments) in LINEARS.items():
        w = torch.randn(n, k, dtype=DT, device="cuda") * k ** -0.5
        for m in ms_list:
            x = torch.randn(m, k, dtype=DT, device="cuda")
            timing = side_by_side(lambda: torch.nn.functional.linear(x, w), lambda: K.linear(x, w, k_segments=segments))
            tflops = 2 * m * n * k / timing["strict_ms"] / 1e9
            label = f"matmul {name} {k}x{n}" + (f" ({segments} K segments)" if segments > 1 else "")
            rows.append({"op": label, "M": m, **timing, "strict_tflops": tflops})
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
    timing = side_by_side(lambda: torch.nn.functional.rms_norm(x + r, (h,), w, 1e-6),
                          lambda: K.rms_norm(x, w, 1e-6, residual=r))
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
    timing = side_by_side(lambda: torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]),
                          lambda: K.token_logprobs(logits, targets))
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
            timing = side_by_side(lambda: sdpa(qt, kt, vt, is_causal=True, enable_gqa=True),
                                  lambda: K.varlen_attention(q, k, v, cu, d ** -0.5, exp=exp))
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
            timing = side_by_side(lambda: sdpa(q[:, :, None], kd, vd, enable_gqa=True),
                                  lambda: K.paged_decode(q, kc, vc, table, lens, d ** -0.5, ctx, exp=exp))
            rows.append({"op": f"attention decode b={b} ctx={ctx} ({exp} exp)", **timing})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sections", default="matmul,memory,attention", help="comma list of matmul, memory, attention")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows = []
    if "matmul" in sections:
        rows += bench_matmul((1, 16, 256, 4096) if args.quick else (1, 16, 256, 4096, 16384))
    if "memory" in sections:
        rows += bench_memory_bound()
    if "attention" in sections:
        rows += bench_attention((1024, 4096) if args.quick else (1024, 4096, 16384),
                                (1, 16, 256) if args.quick else (1, 4, 16, 64, 256))
    print(f"{'op':44s} {'M':>6s} {'default ms':>11s} {'strict ms':>10s} {'ratio':>6s} {'graph':>6s}  extra")
    for r in rows:
        extra = f"{r['strict_tflops']:.0f} TFLOP/s" if "strict_tflops" in r else (
            f"{r['of_copy_bound']:.2f} of copy bound" if "of_copy_bound" in r else "")
        graph = f"{r['graph_ratio']:6.2f}" if "graph_ratio" in r else " " * 6
        extra = extra or (f"not captured: {r['graph_error']}" if "graph_error" in r else "")
        print(f"{r['op']:44s} {str(r.get('M', '')):>6s} {r['default_ms']:11.4f} {r['strict_ms']:10.4f} "
              f"{r['ratio']:6.2f} {graph}  {extra}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "triton": triton.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
