"""Host time of each strict op's Python wrapper alone, on the CPU: every Triton launch replaced by a no-op.

    python3 bench/wrapper_overhead.py [--calls 3000]

Runs the strict side of bench/launch_overhead.py's ops (Qwen3-8B decode shapes, one token) on CPU tensors
through the Triton branch of each kernel (TRITON_INTERPRET=1 selects it) with every @triton.jit kernel
replaced by a launcher that does nothing: what is left is argument checks, reshapes, output allocation,
launch planning and autograd dispatch, i.e. what alignaudit adds on the host before Triton's own launcher
(which bench/launch_overhead.py measures together with it on a GPU). Prints microseconds per call, under
torch.no_grad and with grad mode on (tensors not requiring grad), then what a custom op's dispatch adds to a
call by how the op is registered (``dispatch_us``). CPU-dependent: compare runs on one machine.
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

import alignaudit_kernels  # noqa: E402, F401  (imports every kernel module stub_launches walks)
from bench.launch_overhead import pairs  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches() -> int:
    """Replace every Triton kernel object in the kernel modules; returns how many were replaced."""
    replaced = 0
    # every module holding a kernel object or the SM count query, attention.launch's imported names included
    modules = [m for name, m in sys.modules.items() if name.startswith("alignaudit_kernels") and m is not None]
    for module in modules:
        for name in dir(module):
            if type(getattr(module, name)).__name__ in ("JITFunction", "InterpretedFunction"):
                setattr(module, name, _NoLaunch())
                replaced += 1
        if hasattr(module, "sm_count"):  # the SM count query needs CUDA: an H200's
            module.sm_count = lambda device: 132
    return replaced


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def dispatch_us(calls: int) -> dict[str, float]:
    """Host time of one call of a custom op whose body only allocates a 1-element tensor, by how the op is
    registered (``torch.library.custom_op``, or ``Library.define`` + ``impl`` as alignaudit_kernels.primitives.
    opaque_op does) and grad mode (``torch.inference_mode``, as vLLM runs its forward; ``torch.no_grad``), and
    the body called directly: what dispatch adds to each strict op a compiled engine calls."""

    def body(x):
        return torch.empty(1)

    torch.library.custom_op("wrapper_overhead::by_custom_op", body, mutates_args=(), schema="(Tensor x) -> Tensor")
    library = torch.library.Library("wrapper_overhead", "FRAGMENT")
    library.define("by_library(Tensor x) -> Tensor")
    library.impl("by_library", body, "CompositeExplicitAutograd")
    x = torch.zeros(4)
    ops = {
        "body called directly": body,
        "torch.library.custom_op": torch.ops.wrapper_overhead.by_custom_op.default,
        "Library.define + impl": torch.ops.wrapper_overhead.by_library.default,
    }
    times = {}
    for mode, context in (("inference_mode", torch.inference_mode), ("no_grad", torch.no_grad)):
        with context():
            for name, op in ops.items():
                times[f"{name}, {mode}"] = per_call_us(lambda op=op: op(x), calls)
    return times


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
    print(f"\n{'custom op dispatch (1-element body)':48s} {'us':>6s}")
    for name, us in dispatch_us(args.calls).items():
        print(f"{name:48s} {us:6.1f}", flush=True)


if __name__ == "__main__":
    main()
