"""The model architectures alignaudit runs, one module each; this registry is what the rest reads.

    qwen3.py   Qwen3ForCausalLM     QK-norm, no biases
    qwen2.py   Qwen2ForCausalLM     q/k/v biases (Qwen2 and Qwen2.5)
    llama.py   LlamaForCausalLM     llama3 rope scaling (Llama 3.1 / 3.2)
    qwen3_moe.py Qwen3MoeForCausalLM  Qwen3 attention, mixture-of-experts MLP

What differs between them is data (``Architecture``): which tensors a checkpoint holds, how the engines'
modules are named, which rope scaling is allowed, and the released shapes as presets. The dense decoder
they share (embedding, N x [RMSNorm, GQA attention with rope, RMSNorm, SwiGLU MLP], RMSNorm, lm_head) is
arch/dense.py.
"""

from __future__ import annotations

from alignaudit.arch import llama, qwen2, qwen3, qwen3_moe
from alignaudit.arch.dense import Architecture, Preset
from alignaudit.errors import InputError

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (qwen3.ARCH, qwen2.ARCH, llama.ARCH, qwen3_moe.ARCH)}
PRESETS: dict[str, Preset] = {p.name: p for a in ARCHITECTURES.values() for p in a.presets}


def architecture(name: str) -> Architecture:
    """The Architecture for a config's ``architectures[0]``.

    Raises:
        InputError: an architecture alignaudit does not run, naming the ones it does.
    """
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise InputError(f"architecture {name} is not supported; supported: {', '.join(ARCHITECTURES)}") from None


def find_preset(model: str) -> Preset | None:
    """The preset named ``model`` (``Qwen3-8B`` or ``Qwen/Qwen3-8B``, any case), else None."""
    key = model.lower()
    for preset in PRESETS.values():
        if key in (preset.name.lower(), preset.hub_id.lower()):
            return preset
    return None


__all__ = ["ARCHITECTURES", "PRESETS", "Architecture", "Preset", "architecture", "find_preset"]
