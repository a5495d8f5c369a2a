"""GPU timings shared by the benches: medians of triton.testing's timers, in milliseconds."""

from __future__ import annotations

import triton


def ms(fn) -> float:
    """Median time of ``fn`` launched eagerly (host launch cost included when it exceeds the GPU's)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn, rep: int = 100) -> float:
    """Median time of ``fn`` replayed as a CUDA graph (GPU time without host launch cost, as vLLM's decode)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def kernel_table(prof, top: int | None = 14) -> dict:
    """GPU kernel time by kernel name from a finished ``torch.profiler.profile`` (CUDA activity on), CUDA-graph
    replays included: the ``top`` largest (None: all) and the total, in milliseconds. Total below the measured time
    of the profiled work means the GPU sat idle for part of it (host launches, synchronizations)."""
    import torch

    kernels: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            count, us = kernels.get(name, (0, 0.0))
            kernels[name] = (count + 1, us + e.time_range.elapsed_us())
    total = sum(us for _, us in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]  # [:None] keeps all
    return {"gpu_kernel_ms": round(total / 1e3, 1),
            "top": [{"kernel": k, "calls": c, "ms": round(us / 1e3, 1)} for k, (c, us) in ranked]}
