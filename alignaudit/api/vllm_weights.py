"""A running vLLM's weights from Python: what it holds, a weight sync into it, its strict kernels, read back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from alignaudit.errors import InputError


@dataclass
class WeightSync:
    """The result of ``verify_weight_sync``.

    Attributes:
        equal: every tensor present on both sides with the same bits (dtype, shape and bytes), none missing, and
            (where the rollout side is a running vLLM) no packed copy computing with other weights.
        differing: names whose dtype, shape or bytes differ. missing: names on one side only (trainer-only
            names first, then rollout-only).
        stale_packed: vLLM layers (module names) whose packed CPU GEMM computes with weights other than the
            layer's parameter; [] where nothing is packed (GPU, the strict path) or where the rollout side was
            given as a dict (see ``covers_engine_copies``).
        covers_engine_copies: True where the rollout side was the running engine, so the copies it computes with
            were checked too; False for a dict of tensors, which shows what the dict holds and nothing else.
        checksums: sha256 of each trainer tensor's bytes, by name (alignaudit.engines.base.checksums).
    """

    equal: bool
    differing: list[str]
    missing: list[str]
    stale_packed: list[str] = field(default_factory=list)
    covers_engine_copies: bool = False
    checksums: dict[str, str] = field(default_factory=dict, repr=False)


def verify_weight_sync(trainer: dict[str, torch.Tensor], rollout) -> WeightSync:
    """Check that the rollout engine computes, bit for bit, with the weights the trainer sent (in HF names: e.g.
    ``dict(model.named_parameters())`` of an HF model). A weight sync that changes one bit breaks bitwise
    alignment however strict the kernels are.

    Args:
        trainer: HF name -> tensor, the weights sent.
        rollout: the running vLLM ``LLM`` of this process (offline, VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's
            colocate mode runs it), or a dict of HF name -> tensor read back from the engine. Given the LLM, the
            check covers what vLLM computes with: its parameters (qkv_proj and gate_up_proj split into HF names)
            and, on its CPU backend, each packed GEMM, which must give on a probe input the bits of a GEMM packed
            afresh from the parameter (alignaudit.engines.vllm.weights.stale_packed_layers). A framework that
            calls ``model.load_weights`` without vLLM's post-load step (TRL 1.16 does) leaves those packed copies
            stale while the parameters hold the new weights; ``load_vllm_weights`` does both steps. Given a dict,
            only the dict is compared (``covers_engine_copies`` False).
    Raises:
        InputError: empty or non-tensor sides, a meta, quantized, sparse or non-floating tensor (inputs.values
            check_weight: a byte view of a quantized one crashed the process); a vLLM whose CPU backend freed its
            linear weights after packing them (nothing to read back: call ``keep_vllm_weights()`` before building the
            LLM).
    """
    from alignaudit.engines.weight_transfer import checksums
    from alignaudit.inputs.values import check_weight

    stale: list[str] = []
    engine = _is_vllm(rollout)
    if engine:
        from alignaudit.engines.vllm.weights import stale_packed_layers

        stale = stale_packed_layers(rollout.apply_model(lambda m: m)[0])
        rollout = vllm_weights(rollout)
    for name, side in (("trainer", trainer), ("rollout", rollout)):
        if not isinstance(side, dict) or not all(isinstance(t, torch.Tensor) for t in side.values()):
            raise InputError(
                f"{name}: a dict of HF name -> tensor (e.g. dict(model.named_parameters())), or for the "
                f"rollout side the running vLLM LLM, not {type(side).__name__}"
            )
        for key, tensor in side.items():
            check_weight(f"{name}[{key!r}]", tensor)
    if not trainer:
        raise InputError("trainer holds no weights: an empty sync would pass unchecked; give the tensors sent")
    missing = sorted(set(trainer) - set(rollout)) + sorted(set(rollout) - set(trainer))
    differing = [
        name
        for name in sorted(set(trainer) & set(rollout))
        if trainer[name].dtype != rollout[name].dtype
        or trainer[name].shape != rollout[name].shape
        or not torch.equal(_bytes(trainer[name]), _bytes(rollout[name]))
    ]
    return WeightSync(
        not differing and not missing and not stale, differing, missing, stale, engine, checksums(trainer)
    )


def keep_vllm_weights() -> None:
    """Keep vLLM's CPU linear weights after it packs them (call before building the LLM): vLLM 0.32's CPU backend
    otherwise frees each parameter once packed for oneDNN, so a later ``load_weights`` has nowhere to write and
    ``verify_weight_sync`` nothing to read. A no-op on other platforms and under the strict plugin (which computes
    with the parameters themselves)."""
    from alignaudit.engines.vllm.weights import keep_vllm_cpu_weights

    keep_vllm_cpu_weights()


def load_vllm_weights(llm, weights: dict[str, torch.Tensor]) -> None:
    """Push HF-named ``weights`` into the running vLLM ``llm`` as verl, slime and NeMo-RL do (``model.load_weights``)
    and then run vLLM's own post-load step, which repacks the CPU GEMMs (without it they keep computing with the
    old weights), and drop its cached prefixes (computed with the old weights).

    Every tensor is checked before any is written (vLLM's loader writes them one by one, so a bad one found late would
    leave the engine half-updated): its name and shape against the checkpoint vLLM was built from
    (inputs.checkpoint.weight_shapes), a real floating dtype (not quantized, not meta).

    Raises:
        InputError: ``llm`` is not a vLLM LLM running in this process, ``weights`` not a non-empty dict of tensors, or
            a tensor that is not one of the model's (name, shape, dtype), naming it; nothing is written then.
    """
    from alignaudit.engines.vllm.weights import load_into_vllm
    from alignaudit.inputs.checkpoint import weight_shapes
    from alignaudit.inputs.values import check_weight

    if not _is_vllm(llm):
        raise InputError(f"llm: a vLLM LLM running in this process, not {type(llm).__name__}")
    if not isinstance(weights, dict) or not weights or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise InputError("weights: a non-empty dict of HF name -> tensor")
    shapes = weight_shapes(llm.llm_engine.model_config.model)
    for name, tensor in weights.items():
        if name not in shapes:
            raise InputError(f"weights[{name!r}]: not a tensor of this model's checkpoint; nothing was loaded")
        if tuple(tensor.shape) != shapes[name]:
            raise InputError(
                f"weights[{name!r}] has shape {tuple(tensor.shape)}, the model's is {shapes[name]}; nothing was loaded"
            )
        try:
            check_weight(f"weights[{name!r}]", tensor)
        except InputError as e:
            raise InputError(f"{e}; nothing was loaded") from None
    load_into_vllm(llm, weights)


def verify_strict_vllm(llm, ops: str = "all") -> dict:
    """Read back that the vLLM ``llm`` (an offline ``LLM``) computes with alignaudit's strict kernels: every op of
    ``ops`` applied by the strict plugin when the model was built (in the process that holds it; an op registered
    later does not count, since the model's attention backend and CPU weight layout are fixed as it is built), every
    attention layer on the strict implementation, every linear layer on the method the plugin replaces. For a vLLM
    your framework builds (with ALIGNAUDIT_STRICT set), after it is built and before its rollouts count.

    Returns:
        what was read back: ``{"attention_impls": {class: strict exp or None}, "linear_methods": [...],
        "strict_ops": [...]}`` (alignaudit.engines.vllm.weights.kernels_of).
    Raises:
        InputError: ``llm`` is not a vLLM LLM, ``ops`` names no strict op, or the model sits in vLLM's engine-core
            process without VLLM_ALLOW_INSECURE_SERIALIZATION (the function cannot be sent there).
        EngineError: what computes is not strict (the first layer or op that is not, named).
    """
    from alignaudit.engines.vllm.weights import check_strict_kernels, kernels_of
    from alignaudit.inputs.strict_ops import parse_strict

    if not _is_vllm(llm):
        raise InputError(f"llm: a vLLM LLM, not {type(llm).__name__}")
    wanted = parse_strict(ops, option="ops")
    if not wanted:
        raise InputError(f"ops {ops!r} selects no strict op; pass 'all' or a comma list")
    try:
        kernels = llm.apply_model(kernels_of)[0]
    except TypeError as e:  # vLLM's msgspec encoder, sending the function to the engine-core process
        if "serializ" not in str(e):
            raise
        raise InputError(
            "llm runs its model in vLLM's engine-core process, where LLM.apply_model cannot send the "
            "read-back function; build it with VLLM_ENABLE_V1_MULTIPROCESSING=0 (as TRL's colocate mode "
            "does) or set VLLM_ALLOW_INSECURE_SERIALIZATION=1"
        ) from e
    check_strict_kernels(kernels, wanted)
    return kernels


def _is_vllm(obj) -> bool:
    return type(obj).__name__ == "LLM" and hasattr(obj, "apply_model") and hasattr(obj, "llm_engine")


def vllm_weights(llm) -> dict[str, torch.Tensor]:
    """The weights a vLLM ``LLM`` running in this process holds, in HF names (qkv_proj split into q/k/v_proj,
    gate_up_proj into gate/up_proj; vllm/model_executor/models/qwen3.py, qwen2.py, llama.py): views of vLLM's
    parameters, not copies.

    Raises:
        InputError: ``llm`` is not such an LLM, or its CPU backend freed the linear weights after packing them
            (call ``keep_vllm_weights()`` before building the LLM).
    """
    from alignaudit.engines.vllm.weights import vllm_to_hf
    from alignaudit.inputs.checkpoint import load_spec

    if not _is_vllm(llm):
        raise InputError(f"llm: a vLLM LLM running in this process, not {type(llm).__name__}")
    try:
        return vllm_to_hf(llm.apply_model(lambda m: m)[0], load_spec(Path(llm.llm_engine.model_config.model)))
    except ValueError as e:
        raise InputError(f"{e} (alignaudit.api.keep_vllm_weights)") from e


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
