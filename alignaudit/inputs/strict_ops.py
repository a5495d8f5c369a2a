"""Which ops run strict: the names a user passes to --strict and --strict-exp, and the platform refusals, all
checked before any engine starts.

The wiring of the strict kernels (alignaudit_kernels) into each engine sits beside that engine:
    engines/hf/strict.py             module swap for transformers (FSDP-style trainers)
    engines/megatron/strict.py       a strict layer spec (ModuleSpec) and a GPTModel with a strict logprob head
    engines/vllm/plugin.py           a vLLM general plugin (entry point ``vllm.general_plugins``), enabled by the
                                     ALIGNAUDIT_STRICT environment variable
    engines/vllm/attention_cpu.py    strict attention inside vLLM: shared pieces and the CPU platform's backend
    engines/vllm/attention_cuda.py   the CUDA backend (over FLASH_ATTN; decode capturable in CUDA graphs)
    engines/strict_modules.py        the modules every engine's wiring shares (rope, MoE router)
    engines/custom_ops.py            the alignaudit:: custom ops (row-parallel partial, rope, MoE); the kernels
                                     themselves are opaque custom ops under torch.compile
                                     (alignaudit_kernels.primitives.opaque_op)

Ops can be made strict one at a time (``--strict rmsnorm,rope``) for ablation; ``all`` is every op.
"""

from __future__ import annotations

import os

from alignaudit.errors import InputError

STRICT_OPS = ("linear", "rmsnorm", "rope", "silu", "attention", "logprobs")
STRICT_EXPS = ("portable", "native")  # alignaudit_kernels.attention.EXP_CHOICES, the default first
ENV = "ALIGNAUDIT_STRICT"
EXP_ENV = "ALIGNAUDIT_STRICT_EXP"  # the exp of strict attention inside vLLM (its plugin reads it)
STRICT_ATTENTIONS = ("portable", "flash")  # alignaudit_kernels.attention.KERNELS, the default first
ATTENTION_ENV = "ALIGNAUDIT_STRICT_ATTENTION"  # the strict attention kernel inside vLLM (its plugin reads it)
FLASH_DTYPES = ("bf16", "fp16")
RUNNER_V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's switch to its model runner V2 (vllm/envs.py)


def runner_v2_asked() -> bool:
    """Whether VLLM_USE_V2_MODEL_RUNNER asks for vLLM's model runner V2 (set, and not 0 or false), whose fused
    sampling kernels the strict plugin does not replace: processed logprobs are strict under model runner V1 only."""
    return os.environ.get(RUNNER_V2_ENV, "0").lower() not in ("0", "false")


def prefer_runner_v1() -> None:
    """Model runner V1 for the vLLM built next in this process (and the processes it starts), unless
    VLLM_USE_V2_MODEL_RUNNER is set (callers refuse V2 asked for with strict processed logprobs)."""
    os.environ.setdefault(RUNNER_V2_ENV, "0")


KERNEL_SWITCH_NAMES = ("--strict", "--device cuda")  # how the CLI's user spells the strict ops and a CUDA device
BACKWARD_CHANGES = {"attention"}  # strict ops whose backward ALIGNAUDIT_BACKWARD=fused changes on every backend
BACKWARD_CHANGES_CUDA = {"attention", "rmsnorm", "silu", "rope"}  # ... and on CUDA (Triton kernels)


def check_kernel_switches(
    strict_ops: frozenset[str], moe: bool, trains: bool, device: str, names: tuple[str, str] = KERNEL_SWITCH_NAMES
) -> None:
    """Validate the strict kernels' environment switches before any engine starts (every engine's process
    inherits them; a capture records them in its manifest's ``numerics.env``): ALIGNAUDIT_MOE_DISPATCH (how the
    strict MoE layer sends tokens to experts, alignaudit_kernels.moe.DISPATCHES; "grouped", a Triton kernel, on
    CUDA only) and ALIGNAUDIT_BACKWARD (the strict ops' backward, alignaudit_kernels.gradients.BACKWARDS). A value
    other than the default is refused where it changes nothing: ALIGNAUDIT_BACKWARD where nothing trains
    (``trains``), or where no strict op's backward changes with it (attention; on CUDA also rmsnorm, silu and rope:
    BACKWARD_CHANGES, BACKWARD_CHANGES_CUDA); ALIGNAUDIT_MOE_DISPATCH where no strict MoE layer runs (a
    mixture-of-experts model, ``moe``, with linear strict). ``names``: how the caller's user spells the strict ops
    and a CUDA device (the CLI's flags by default).

    Raises:
        InputError: naming the variable, its value, and the values that run here or why it would not take effect.
    """
    from alignaudit_kernels.gradients import BACKWARD_ENV, asked_backward
    from alignaudit_kernels.moe import DISPATCH_ENV, asked_dispatch

    strict, cuda = names
    try:
        dispatch = asked_dispatch()
        backward = asked_backward()
    except ValueError as e:
        raise InputError(str(e)) from None
    if dispatch == "grouped" and device != "cuda":
        raise InputError(f"{DISPATCH_ENV}=grouped is a Triton kernel and runs on CUDA only ({cuda}); unset it")
    if backward != "auto":
        if not trains:
            raise InputError(
                f"{BACKWARD_ENV}={backward} sets the strict ops' backward, and this command computes no "
                "gradient (only alignaudit rl trains); unset it"
            )
        if not strict_ops & (BACKWARD_CHANGES_CUDA if device == "cuda" else BACKWARD_CHANGES):
            raise InputError(
                f"{BACKWARD_ENV}={backward} changes the backward of strict attention (and on CUDA of "
                f"rmsnorm, silu and rope), none of which {strict} makes strict here; add attention to "
                f"{strict} or unset it"
            )
    if dispatch != "auto" and not (moe and "linear" in strict_ops):
        raise InputError(
            f"{DISPATCH_ENV}={dispatch} sets the strict MoE layer's dispatch, which runs only for a "
            f"mixture-of-experts model with linear in {strict}; unset it"
        )


def check_strict_exp(
    exp: str | None,
    ops: frozenset[str],
    device: str,
    names: tuple[str, str, str] = ("--strict-exp", "--strict", "--device cuda"),
) -> str:
    """Validate ``--strict-exp`` before any engine starts and return it ("portable" where it was not given, None).
    Either value given needs strict attention; "native" (the GPU's exp2 instruction inside strict attention;
    alignaudit_kernels.attention) also needs CUDA; every engine's strict attention takes it there (vLLM's through
    ALIGNAUDIT_STRICT_EXP). ``names``: how the caller's user spells the exp, the ops and a CUDA device (the CLI's flags
    by default; alignaudit.api passes its arguments).

    Raises:
        InputError: an unknown value, or a value given where it would not take effect.
    """
    option, ops_option, cuda = names
    if exp is None:
        return STRICT_EXPS[0]
    if exp not in STRICT_EXPS:
        raise InputError(f"{option} {exp!r}: choose {' or '.join(STRICT_EXPS)}")
    if "attention" not in ops:
        raise InputError(
            f"{option} {exp} sets the exp of strict attention, which this run does not compute: "
            f"add attention to {ops_option}, or drop {option}"
        )
    if exp == "native" and device != "cuda":
        raise InputError(
            f"{option} native is the GPU's exp2 instruction; on the CPU strict attention computes "
            f"the portable exp only: use {cuda}, or drop {option}"
        )
    return exp


def check_strict_attention(
    kernel: str | None,
    ops: frozenset[str],
    device: str,
    exp: str,
    dtypes: tuple[tuple[str, str], ...],
    head_dim: int,
    trains: bool = False,
    names: tuple[str, ...] = ("--strict-attention", "--strict", "--device cuda", "--strict-exp"),
) -> str:
    """Validate ``--strict-attention`` before any engine starts and return the kernel ("portable" where it was not
    given, None). "portable" is alignaudit_kernels' own attention (the same bits on the CPU and every GPU); "flash" is
    FlashAttention-3 at one key split (alignaudit_kernels.attention.flash) in every engine of the run: it needs strict
    attention, CUDA, bf16 or fp16 in every engine (``dtypes``: (the option that set it, the dtype) per engine), a head
    size FlashAttention takes (``head_dim``: a multiple of 8 up to 256), the portable exp setting (FA3 computes its own
    exp), vLLM's FA3 build installed, and where the run trains (``trains``) no ALIGNAUDIT_BACKWARD=reference (its
    backward is FlashAttention-2's). A Hopper GPU is checked where the engines load the model (the parent starts no
    CUDA context). ``names``: how the caller's user spells the kernel, the ops, a CUDA device and the exp.

    Raises:
        InputError: an unknown value, or a value given where it would not take effect.
    """
    option, ops_option, cuda, exp_option = names
    if kernel is None:
        return "portable"
    if kernel not in STRICT_ATTENTIONS:
        raise InputError(f"{option} {kernel!r}: choose {' or '.join(STRICT_ATTENTIONS)}")
    if "attention" not in ops:
        raise InputError(
            f"{option} {kernel} chooses the kernel of strict attention, which this run does not "
            f"compute: add attention to {ops_option}, or drop {option}"
        )
    if kernel == "portable":
        return kernel
    if device != "cuda":
        raise InputError(f"{option} flash is FlashAttention-3, a CUDA (Hopper) kernel: use {cuda}, or drop {option}")
    if exp != "portable":
        raise InputError(
            f"{exp_option} {exp} chooses the exp of alignaudit's portable attention kernel; "
            f"FlashAttention-3 computes its own: drop {exp_option} or {option} flash"
        )
    for flag, dtype in dtypes:
        if dtype not in FLASH_DTYPES:
            raise InputError(f"{option} flash computes bf16 and fp16, not {dtype}: set {flag} bf16")
    from alignaudit_kernels.attention.flash_gradients import flash_takes_head_dim
    from alignaudit_kernels.gradients import BACKWARD_ENV

    if not flash_takes_head_dim(head_dim):
        raise InputError(
            f"{option} flash: FlashAttention takes head sizes that are multiples of 8 up to 256, and this "
            f"model's is {head_dim}; use the portable kernel"
        )
    if trains and os.environ.get(BACKWARD_ENV) == "reference":
        raise InputError(
            f"{BACKWARD_ENV}=reference would not reach {option} flash, whose backward is always "
            "FlashAttention-2's deterministic one: unset it, or use the portable kernel"
        )
    if not fa3_library():
        raise InputError(
            f"{option} flash runs vLLM's FlashAttention-3 build (vllm.vllm_flash_attn) in every engine, "
            "and this Python has none (no vLLM, or a build without it such as the CPU wheel): install "
            "vLLM for CUDA"
        )
    return kernel


def fa3_library() -> bool:
    """Whether vLLM's compiled FlashAttention-3 (vllm/vllm_flash_attn/_vllm_fa3_C*.so) is installed, found on disk
    without importing vLLM (the parent process of a run imports no engine)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any((Path(root) / "vllm_flash_attn").glob("_vllm_fa3_C*")) for root in spec.submodule_search_locations)


ROCM_ENV = "ALIGNAUDIT_ROCM_UNCHECKED"  # "1": run the strict path on ROCm although no AMD GPU has checked its bits


def check_platform(ops: frozenset[str], where: str = "--strict") -> str | None:
    """Refuse strict ops on a ROCm build of torch (AMD GPUs, which torch names "cuda" devices) before any
    engine starts: the strict kernels build for MI300X (tests/kernels/cross_compile.py gfx942) but no AMD GPU has run
    their bit-equality tests (docs/kernels.md, "ROCm"). With ALIGNAUDIT_ROCM_UNCHECKED=1 the run goes on;
    returns the warning to print and record (the run's environment records the variable and torch's HIP
    version). None on every other platform or without strict ops.

    Raises:
        InputError: strict ops on ROCm without the variable.
    """
    import torch

    if not ops or torch.version.hip is None:
        return None
    what = (
        f"{where} on ROCm (torch HIP {torch.version.hip}): the strict kernels build for MI300X but their bits "
        "have not been checked on an AMD GPU"
    )
    if os.environ.get(ROCM_ENV) != "1":
        raise InputError(
            f"{what}; run pytest tests/kernels --kernel-device cuda there first "
            f"(docs/kernels.md, 'ROCm'), then set {ROCM_ENV}=1"
        )
    return f"warning: {what} ({ROCM_ENV}=1): a 0-mismatch verdict here is this run's, not a checked guarantee"


def guard_platform(ops: frozenset[str], where: str) -> None:
    """``check_platform`` for the strict modules users build into their own trainer (make_strict,
    strict_layer_spec): raises the same InputError, and gives the warning as a Python warning."""
    import warnings

    if warning := check_platform(ops, where):
        warnings.warn(warning.removeprefix("warning: "), stacklevel=3)


def parse_strict(value: str | None, option: str = "--strict") -> frozenset[str]:
    """``"all"`` -> every op; ``"rmsnorm,rope"`` -> those; None or "" or "none" -> none.

    Raises:
        InputError: an unknown op name (the message names ``option``).
    """
    if value is not None and not isinstance(value, str):
        raise InputError(f"{option}: {value!r} is not a comma-separated string of ops; e.g. 'all' or 'rmsnorm,rope'")
    if value is None or value.strip() in ("", "none"):
        return frozenset()
    names = {v.strip() for v in value.split(",") if v.strip()}
    unknown = sorted(names - set(STRICT_OPS) - {"all"})
    if unknown:
        raise InputError(f"{option}: unknown op(s) {', '.join(unknown)}; choose all or any of {', '.join(STRICT_OPS)}")
    return frozenset(STRICT_OPS) if "all" in names else frozenset(names)


def format_strict(ops: frozenset[str]) -> str:
    """The inverse of parse_strict, in a stable order ("" for none)."""
    return "all" if set(ops) == set(STRICT_OPS) else ",".join(o for o in STRICT_OPS if o in ops)
