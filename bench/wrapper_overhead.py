"""Host time of each strict op's Python wrapper alone, on the CPU: every Triton launch replaced by a no-op.

    python3 bench/wrapper_overhead.py [--calls 3000]

Runs the strict side of bench/launch_overhead.py's ops (Qwen3-8B decode shapes, one token) on CPU tensors
through the Triton branch of each kernel (TRITON_INTERPRET=1 selects it) with every @triton.jit kernel
replaced by a launcher that does nothing: what is left is argument checks, reshapes, output allocation,
launch planning and autograd dispatch, i.e. what alignaudit adds on the host before Triton's own launcher
(which bench/launch_overhead.py measures together with it on a GPU). Prints microseconds per call, under
torch.no_grad and with grad mode on (tensors not requiring grad). CPU-dependent: compare runs on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels import triton: CPU tensors take the Triton branch

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import alignaudit_kernels as K  # noqa: E402
from bench.launch_overhead import pairs  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches() -> int:
    """Replace every Triton kernel object in the kernel modules; returns how many were replaced."""
    replaced = 0
    for module in (K.matmul, K.rmsnorm, K.rope, K.silu, K.logprobs, K.attention):
        for name in dir(module):
            if type(getattr(module, name)).__name__ in ("JITFunction", "InterpretedFunction"):
                setattr(module, name, _NoLaunch())
                replaced += 1
    for module in (K.matmul, K.attention, K.primitives):  # the SM count query needs CUDA: an H200's
        module.sm_count = lambda device: 132
    return replaced


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    print(f"{stub_launches()} Triton kernels stubbed; {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'op':36s} {'no_grad us':>11s} {'grad mode us':>13s}")
    for name, (_, strict) in pairs("cpu").items():
        with torch.no_grad():
            off = per_call_us(strict, args.calls)
        on = per_call_us(strict, args.calls)
        print(f"{name:36s} {off:11.1f} {on:13.1f}", flush=True)


if __name__ == "__main__":
    main()
