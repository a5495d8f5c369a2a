"""The strict row-parallel reduction against the default all-reduce, measured side by side in one run.

    python bench/tp_reduction.py [--world 2] [--device cpu|cuda] [--hidden 4096] [--tokens 16,256,4096]

Each of ``--world`` ranks (gloo on CPU, NCCL on CUDA, one GPU a rank) holds the output of its share of a
row-parallel projection for ``tokens`` x ``hidden`` (the Qwen3-8B o_proj/down_proj output is 4096 wide):
    default  the rank's bf16 output, all-reduced (Megatron's and vLLM's row-parallel layers)
    strict   the rank's fp32 partial, all-gathered, added in rank order by the segment tree, rounded to bf16
             once (alignaudit_kernels.combine_partials)
Only the reduction is timed (the GEMMs are the same work either way up to the fp32 store). Median of
``--reps`` after warm-up, CUDA events on GPU, a barrier before each timing. Rank 0 prints one row per
shape: milliseconds of each and the ratio default / strict (> 1: strict is faster); writes
bench-tp-reduction.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(fn, device: str, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs (after 3 warm-up runs), all ranks in step."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rank_main(rank: int, args, rendezvous: str) -> None:
    import alignaudit_kernels as K

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.world
    )
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(rank)
        partial = torch.randn(tokens, args.hidden, generator=gen).to(device)  # fp32, as linear_partial returns
        output = partial.to(torch.bfloat16)
        gathered = [torch.empty_like(partial) for _ in range(args.world)]

        def default():
            dist.all_reduce(output.clone())

        def strict():
            dist.all_gather(gathered, partial)
            K.combine_partials(gathered, None, torch.bfloat16)

        d, s = timed(default, device, args.reps), timed(strict, device, args.reps)
        rows.append({"tokens": tokens, "hidden": args.hidden, "default_ms": d, "strict_ms": s, "ratio": d / s})
    if rank == 0:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(f"world {args.world}, {device} ({name}), torch {torch.__version__}")
        print(f"{'tokens':>8}{'hidden':>8}{'default ms':>12}{'strict ms':>11}{'default/strict':>16}")
        for r in rows:
            print(f"{r['tokens']:>8}{r['hidden']:>8}{r['default_ms']:>12.3f}{r['strict_ms']:>11.3f}{r['ratio']:>16.2f}")
        Path(args.json).write_text(json.dumps({"world": args.world, "device": device, "rows": rows}, indent=2) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", default="16,256,4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="bench-tp-reduction.json")
    args = parser.parse_args()
    fd, rendezvous = tempfile.mkstemp(prefix="tp-bench-")
    os.close(fd)
    os.unlink(rendezvous)
    torch.multiprocessing.spawn(rank_main, args=(args, rendezvous), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
