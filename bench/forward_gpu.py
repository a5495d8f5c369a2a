"""A whole Qwen3-shape forward pass, default vs every op strict, eager and torch.compile'd, side by side.

    python3 bench/forward_gpu.py [--preset Qwen3-8B] [--batch 4] [--tokens 1024] [--no-compile] [--exp native]
                                 [--profile]

Builds the preset's exact shape with random weights directly on the GPU (transformers Qwen3ForCausalLM,
bf16), times the default forward (SDPA attention, cuBLAS) over batch x tokens, eager and under
torch.compile, then swaps every strict op in (alignaudit.engines.hf.strict.make_strict) and times the same forward
again, eager and compiled, logits and logprobs included. Prints the times and their ratios (median of
several timed runs after warm-up, CUDA events), whether the compiled strict forward gives the eager
strict forward's logprob bits (a compiled graph must not change what the strict kernels compute), and how
many times the strict forward makes the host wait for the GPU. --profile: one forward each of the compiled
default, the eager strict and the compiled strict under torch.profiler, GPU kernel time by kind of kernel
(cuBLAS, SDPA flash, strict Triton, Inductor-generated, torch's own) and the largest kernels: where a gap goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402
from alignaudit.arch import PRESETS  # noqa: E402
from alignaudit.engines.hf.strict import make_strict  # noqa: E402
from alignaudit.inputs.strict_ops import STRICT_OPS  # noqa: E402


def median_ms(fn, warmup=2, reps=5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_ms(fn) -> float:
    """Wall time until ``fn`` returns, the GPU idle at the start and not awaited at the end: the host's share.
    Close to the forward's GPU time means the forward is launch-bound."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3


def count_syncs(fn) -> str:
    """How many times ``fn`` makes the host wait for the GPU (torch.cuda.set_sync_debug_mode), and where the
    first ones come from: each one drains the launch queue, leaving the GPU idle while the host launches on."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    origins = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    return f"{len(syncs)} ({', '.join(origins[:6])})"


STRICT_KERNELS = (
    "_matmul",
    "_attention",
    "_combine",
    "_rmsnorm",
    "_rope",
    "_silu_mul",
    "_log_softmax",
    "_log_s",
    "_max_kernel",
    "_finish",
    "_segment",
    "_units",
    "_chunk",
)


def kernel_kind(name: str) -> str:
    """Which part of the stack launched a CUDA kernel, from its name (Inductor names its kernels triton_poi_/
    triton_red_/triton_per_; cuBLAS's carry gemm/nvjet/xmma; our strict kernels their @triton.jit names)."""
    if name.startswith(("triton_poi", "triton_red", "triton_per", "triton_tem")):
        return "Inductor-generated"
    if name.startswith(STRICT_KERNELS):
        return "strict Triton"
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas")):
        return "cuBLAS"
    if any(k in low for k in ("flash", "fmha", "attention")):
        return "SDPA flash"
    if "memcpy" in low or "copy" in low:
        return "copies"
    return "torch's own"


def profile_one(fn) -> dict:
    """One call of ``fn`` (warm) under torch.profiler: CUDA-event time, GPU kernel time by kind, largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from bench.timing import kernel_table

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    table = kernel_table(prof, top=None)
    kinds: dict[str, float] = {}
    for row in table["top"]:
        kinds[kernel_kind(row["kernel"])] = kinds.get(kernel_kind(row["kernel"]), 0.0) + row["ms"]
    return {
        "event_ms": round(start.elapsed_time(end), 1),
        "gpu_kernel_ms": table["gpu_kernel_ms"],
        "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": table["top"][:8],
    }


def print_profile(name: str, p: dict) -> None:
    print(
        f"profile, {name}: {p['event_ms']} ms (CUDA events), GPU kernel time {p['gpu_kernel_ms']} ms; by kind: "
        + ", ".join(f"{k} {v}" for k, v in p["by_kind_ms"].items())
    )
    for row in p["top"]:
        print(f"    {row['ms']:7.1f} ms  {row['calls']:4d} x  {row['kernel']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Qwen3-8B")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument(
        "--exp",
        choices=("portable", "native"),
        default="portable",
        help="the strict attention's exp (alignaudit --strict-exp)",
    )
    parser.add_argument("--json", type=Path, help="write the times (ms) here")
    parser.add_argument("--profile", action="store_true", help="where the GPU time of one forward goes, by kernel")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        **{k: v for k, v in PRESETS[args.preset].config.items() if k not in ("architectures", "torch_dtype")}
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    all_ids = torch.randint(0, cfg.vocab_size, (args.batch, args.tokens), device="cuda")
    ids = all_ids  # the closures below read it at call time

    @torch.no_grad()
    def stock():
        logits = model(ids).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])

    @torch.no_grad()
    def strict():
        logits = model(ids).logits
        return K.token_logprobs(logits[:, :-1], ids[:, 1:])

    default_ms = median_ms(stock)
    default_host_ms = host_ms(stock)
    compiled_stock = None if args.no_compile else torch.compile(stock)
    default_compiled_ms = None if args.no_compile else median_ms(compiled_stock, warmup=3)
    profiles = {}
    if args.profile and compiled_stock is not None:
        profiles["compiled default"] = profile_one(compiled_stock)
    if not args.no_compile:  # one sequence too, in case the compiled strict forward does not fit at the full batch
        ids = all_ids[:1]
        torch._dynamo.reset()
        default_compiled_one_ms = median_ms(torch.compile(stock), warmup=3)
        ids = all_ids
    make_strict(model, frozenset(STRICT_OPS), exp=args.exp)
    strict_ms = median_ms(strict)
    if args.profile:
        profiles["eager strict"] = profile_one(strict)
    print(f"host synchronizations in one strict forward: {count_syncs(strict)}", flush=True)
    print(
        f"host time to launch one forward (until it returns, GPU not awaited): default {default_host_ms:.1f} ms, "
        f"strict {host_ms(strict):.1f} ms",
        flush=True,
    )
    ids = all_ids[:1]
    print(
        f"at 1 x {args.tokens} tokens, eager: strict {median_ms(strict):.1f} ms, host time to launch it "
        f"{host_ms(strict):.1f} ms",
        flush=True,
    )
    ids = all_ids
    print(
        f"{args.preset} forward, {args.batch} x {args.tokens} tokens, bf16, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}"
    )
    print(
        f"default (sdpa, cuBLAS): {default_ms:.1f} ms   strict (every op, {args.exp} exp): {strict_ms:.1f} ms   "
        f"strict/default time: {strict_ms / default_ms:.2f}x"
    )
    if default_compiled_ms is None:
        return
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    print(f"peak GPU memory so far: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    torch.cuda.reset_peak_memory_stats()
    compiled_strict = torch.compile(strict)
    try:
        strict_compiled_ms = median_ms(compiled_strict, warmup=3)
        same = torch.equal(compiled_strict().contiguous().view(torch.int32), strict().contiguous().view(torch.int32))
        outcome = f"{strict_compiled_ms:.1f} ms, logprob bits equal to eager strict: {same}"
        if args.profile:
            profiles["compiled strict"] = profile_one(compiled_strict)
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "preset": args.preset,
                        "batch": args.batch,
                        "tokens": args.tokens,
                        "exp": args.exp,
                        "default_ms": default_ms,
                        "strict_ms": strict_ms,
                        "default_compiled_ms": default_compiled_ms,
                        "strict_compiled_ms": strict_compiled_ms,
                        "compiled_bits_equal_eager": same,
                        "profiles": profiles,
                    },
                    indent=1,
                )
            )
    except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and goes on
        strict_compiled_ms, outcome = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"peak GPU memory in the compiled strict forward: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        if isinstance(e, torch.OutOfMemoryError):  # where did it go: the largest live blocks
            snapshot = torch.cuda.memory_snapshot()
            sizes = sorted(
                (blk["size"] for seg in snapshot for blk in seg["blocks"] if blk["state"] == "active_allocated"),
                reverse=True,
            )
            print("largest live blocks (MiB):", [round(x / 2**20) for x in sizes[:12]], "count", len(sizes))
    print(f"torch.compile: default {default_compiled_ms:.1f} ms; strict {outcome}")
    if strict_compiled_ms is None:  # the same comparison at one sequence, both sides compiled again
        ids = all_ids[:1]
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        compiled_strict = torch.compile(strict)
        one_ms = median_ms(compiled_strict, warmup=3)
        same = torch.equal(compiled_strict().contiguous().view(torch.int32), strict().contiguous().view(torch.int32))
        print(
            f"at 1 x {args.tokens} tokens, compiled: default {default_compiled_one_ms:.1f} ms, "
            f"strict {one_ms:.1f} ms "
            f"({one_ms / default_compiled_one_ms:.2f}x), strict logprob bits equal to eager strict: {same}"
        )
    for name, p in profiles.items():
        print_profile(name, p)
    print(
        f"strict eager / compiled default: {strict_ms / default_compiled_ms:.2f}x"
        + (
            f"   compiled strict / compiled default: {strict_compiled_ms / default_compiled_ms:.2f}x"
            if strict_compiled_ms
            else ""
        )
    )


if __name__ == "__main__":
    main()
