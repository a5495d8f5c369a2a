"""The backend and dtypes of the strict-kernel tests (tests/kernels/test_*.py). One backend per session, chosen by
--kernel-device:
    cpu        the CPU implementations (default; CI)
    interpret  the Triton kernels under TRITON_INTERPRET=1 on CPU tensors, fp32 only (bf16 is broken in the
               interpreter); tests/kernels/test_kernels_interpret.py runs them in a subprocess
    cuda       the Triton kernels on a GPU (bench/gpu_run.sh tests)
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device(request):
    return "cuda" if request.config.getoption("--kernel-device") == "cuda" else "cpu"


def dtypes_for(request):
    if request.config.getoption("--kernel-device") == "interpret":
        return [torch.float32]
    return [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(params=["bf16", "fp16", "fp32"])
def dtype(request):
    d = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[request.param]
    if d not in dtypes_for(request):
        pytest.skip("the Triton interpreter only handles fp32")
    return d
