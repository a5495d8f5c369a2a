"""GPU timings shared by the benches: medians of triton.testing's timers, in milliseconds."""

from __future__ import annotations

import triton


def ms(fn) -> float:
    """Median time of ``fn`` launched eagerly (host launch cost included when it exceeds the GPU's)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn, rep: int = 100) -> float:
    """Median time of ``fn`` replayed as a CUDA graph (GPU time without host launch cost, as vLLM's decode)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
