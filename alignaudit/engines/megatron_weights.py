"""Hugging Face Qwen3 -> Megatron-Core GPTModel (local layer spec) weight conversion, as data.

Each Megatron parameter name maps to the HF tensors it is built from; ``{i}`` is the layer index. Names
with more than one source are fused by the function in ``FUSE`` keyed by the name's last two parts.
Megatron's names come from GPTModel with get_gpt_layer_local_spec(qk_layernorm=True, normalization=
"RMSNorm") (megatron/core/models/gpt/gpt_layer_specs.py); with tied embeddings GPTModel has no
output_layer.weight and that entry is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from alignaudit.errors import InputError
from alignaudit.layouts import fuse_qkv_grouped
from alignaudit.models import ModelSpec

_L = "model.layers.{i}."
QWEN3_WEIGHT_MAP: dict[str, tuple[str, ...]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    "decoder.layers.{i}.input_layernorm.weight": (_L + "input_layernorm.weight",),
    "decoder.layers.{i}.self_attention.linear_qkv.weight": (
        _L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
    "decoder.layers.{i}.self_attention.linear_qkv.bias": (  # attention_bias only (Qwen2-style QKV bias)
        _L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
    "decoder.layers.{i}.self_attention.q_layernorm.weight": (_L + "self_attn.q_norm.weight",),
    "decoder.layers.{i}.self_attention.k_layernorm.weight": (_L + "self_attn.k_norm.weight",),
    "decoder.layers.{i}.self_attention.linear_proj.weight": (_L + "self_attn.o_proj.weight",),
    "decoder.layers.{i}.pre_mlp_layernorm.weight": (_L + "post_attention_layernorm.weight",),
    "decoder.layers.{i}.mlp.linear_fc1.weight": (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    "decoder.layers.{i}.mlp.linear_fc2.weight": (_L + "mlp.down_proj.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}

FUSE: dict[str, Callable[..., torch.Tensor]] = {
    "linear_qkv.weight": lambda spec, q, k, v: fuse_qkv_grouped(q, k, v, spec.num_query_groups, dim=0),
    "linear_qkv.bias": lambda spec, q, k, v: fuse_qkv_grouped(q, k, v, spec.num_query_groups, dim=0),
    "linear_fc1.weight": lambda spec, gate, up: torch.cat([gate, up], dim=0),  # SwiGLU: act(first) * second
}


def megatron_state_dict(spec: ModelSpec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read the HF safetensors of ``spec`` and return Megatron parameter tensors in ``dtype``.

    Raises:
        InputError: a tensor is missing, or a checkpoint tensor is not consumed by the map (it would be
            silently ignored).
    """
    tensors = _SafetensorsReader(Path(spec.path))
    out: dict[str, torch.Tensor] = {}
    for template, sources in QWEN3_WEIGHT_MAP.items():
        if template == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        if template.endswith("linear_qkv.bias") and not spec.attention_bias:
            continue
        layers = range(spec.num_layers) if "{i}" in template else [None]
        for i in layers:
            name = template.format(i=i)
            parts = [tensors.get(s.format(i=i)) for s in sources]
            fuse = FUSE.get(".".join(name.split(".")[-2:]))
            out[name] = (fuse(spec, *parts) if fuse else parts[0]).to(dtype)
    unused = sorted(set(tensors.where) - tensors.read)
    if unused:
        raise InputError(f"the Megatron conversion does not use checkpoint tensor(s) {', '.join(unused[:3])}; "
                         "they would be ignored")
    return out


class _SafetensorsReader:
    """Lazy tensor lookup over one safetensors file or a sharded checkpoint with an index."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(directory.glob("*.safetensors"))]
        self.handles = [safe_open(str(directory / f), framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}
        self.read: set[str] = set()

    def get(self, name: str) -> torch.Tensor:
        try:
            tensor = self.where[name].get_tensor(name)
            self.read.add(name)
            return tensor
        except KeyError:
            raise InputError(f"checkpoint has no tensor {name}; is it a Qwen3 checkpoint?") from None
