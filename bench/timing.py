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
    spans = [
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return {
        "gpu_kernel_ms": round(total / 1e3, 1),
        "gpu_events": len(spans),
        "timeline": gpu_timeline(spans),
        "top": [{"kernel": k, "calls": c, "ms": round(us / 1e3, 1)} for k, (c, us) in ranked],
    }


# Gaps between GPU work by length, us: within a CUDA graph or a queue of launches a kernel follows the last in a
# few us; tens of us is a launch the host issued late; hundreds, a host that waited (a synchronization, Python).
GAP_CLASSES = ((10.0, "under_10us"), (100.0, "10_to_100us"), (float("inf"), "over_100us"))


def gpu_timeline(spans: list[tuple[float, float]]) -> dict:
    """The GPU's busy time (the union of the (start, end) us intervals of its events, overlapping ones counted once)
    and its idle gaps between the first start and the last end (not before or after them), counted and summed by
    GAP_CLASSES; milliseconds. Events of no duration are left out (they would split a gap in two)."""
    busy, end = 0.0, None
    gaps = {name: [0, 0.0] for _, name in GAP_CLASSES}
    spans = [(start, stop) for start, stop in spans if stop > start]
    for start, stop in sorted(spans):
        if end is not None and start > end:
            gap = start - end
            name = next(name for bound, name in GAP_CLASSES if gap < bound)
            gaps[name][0] += 1
            gaps[name][1] += gap
        if end is None or stop > end:
            busy += stop - max(start, end if end is not None else start)
            end = stop
    span = (end - min(s for s, _ in spans)) if spans else 0.0
    return {
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "gaps": {name: {"count": n, "ms": round(us / 1e3, 3)} for name, (n, us) in gaps.items()},
    }


SYNCHRONIZING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def host_table(events, top: int = 14) -> dict:
    """From ``prof.key_averages()``: how often the host may have waited for the GPU (the SYNCHRONIZING calls: stream,
    device and event synchronizations, and ``aten::_local_scalar_dense``, the read behind ``.item()`` and ``int()`` of
    a tensor, which waits for the GPU on a CUDA tensor and not on a CPU one: its count holds both), and the ``top``
    host ops by self CPU time in milliseconds (kernels have none: these are torch ops, Python-side launches, CUDA
    runtime calls)."""
    host = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "synchronizing_calls": {e.key: e.count for e in events if e.key in SYNCHRONIZING},
        "host_top": [
            {"name": e.key[:90], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
            for e in host[:top]
        ],
    }
