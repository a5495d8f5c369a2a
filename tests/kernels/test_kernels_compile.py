"""Every strict Triton kernel builds for AMD MI300X (gfx942) and NVIDIA Hopper (sm_90) on this CPU, in the
launch configurations the host wrappers choose (tests/kernels/cross_compile.py; docs/kernels.md "ROCm"). The two
targets build side by side, each in its own process (the compile-only driver is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "cross_compile.py"
ARTIFACT = {"gfx942": "hsaco", "sm90": "cubin"}


def test_every_strict_kernel_builds_for_mi300x_and_hopper():
    """The bf16 set: every launched kernel, every host-side branch of the products (about 40 s)."""
    _build_both([])


@pytest.mark.slow
def test_every_launch_configuration_builds_for_mi300x_and_hopper():
    """--all: every branch of every host wrapper in bf16, fp16 and fp32 (about 4 minutes a target, cold)."""
    _build_both(["--all"])


def _build_both(flags: list[str]) -> None:
    procs = {
        target: subprocess.Popen(
            [sys.executable, str(SCRIPT), target, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for target in ARTIFACT
    }
    outputs = {target: proc.communicate(timeout=600) for target, proc in procs.items()}
    for target, (out, err) in outputs.items():
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        last = lines[-1] if lines else {}
        assert procs[target].returncode == 0, (
            f"{target}: exit {procs[target].returncode}; last line {last}\n{err[-3000:]}"
        )
        summary, records = last, [r for r in lines if "kernel" in r]
        assert summary["failed"] == 0 and all(r["ok"] for r in records)
        assert all(ARTIFACT[target] in r["built"] for r in records)
        # every kernel a host wrapper launches was built, but Hopper's TMA products, which AMD never takes
        tma_only = {"_matmul_tma_kernel", "_matmul_tma_device_kernel", "_matmul_tma_split_kernel"}
        expected = set(summary["launched_in_source"]) - (tma_only if target == "gfx942" else set())
        assert set(summary["kernels"]) == expected, target
        # the branches that differ by target: Hopper's products above the decode tile go to the TMA kernel
        # (segmented and partial ones included); AMD's fp32 attention builds with one stage
        if target == "sm90":
            tma = {r["constexprs"]["SEGMENTS"] for r in records if r["kernel"] == "_matmul_tma_kernel"}
            assert tma == ({1, 2, 4, 8} if flags else {1, 4})
        else:
            fp32 = [
                r
                for r in records
                if r["kernel"] == "_attention_kernel" and "float32" in r["dtypes"] and r["constexprs"]["IEEE"]
            ]
            assert fp32 and all(r["num_stages"] == 1 for r in fp32)


def test_multi_row_rmsnorm_builds_to_the_one_row_kernels_arithmetic_for_hopper():
    """The multi-row RMSNorm kernel (rmsnorm._rmsnorm_rows_kernel, the default for rows of <= 128; a row's warps as the
    one-row kernel's) compiles for sm_90 to the one-row kernel's layout along a row (elements a thread, lanes, warps,
    load width), its floating-point dataflow up to the row's 1 / sqrt (the residual add, the squares, the sum's tree)
    and the same rounding operations after it, at head dims 64 and 128 and hidden sizes 896 and 4096, with and
    without the residual: evidence for the same bits, which a GPU run confirmed at head dim 128 on an H100
    (2026-12-06; tests/kernels/test_rmsnorm.py on CUDA, bench/sweep_gpu.py rmsnorm-rows). The control, 8 rows on 4
    warps, builds another layout and tree."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "sm90", "--rmsnorm-rows"], capture_output=True, text=True, timeout=600, check=True
    ).stdout
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    built, controls = [r for r in results if "control" not in r], [r for r in results if "control" in r]
    assert len(built) == 20 and all(
        r["same_reduction"] and r["same_operations"] and r["same_row_layout"] for r in built
    ), built
    assert controls and not any(r["same_reduction"] or r["same_row_layout"] for r in controls), controls
