"""Hugging Face dense decoder (Qwen3, Qwen2, Llama: alignaudit/arch) -> Megatron-Core GPTModel (local layer
spec) weight conversion, as data.

Each Megatron parameter name maps to the HF tensors it is built from; ``{i}`` is the layer index. Names
with more than one source are fused by the function in ``FUSE`` keyed by the name's last two parts.
Megatron's names come from GPTModel with get_gpt_layer_local_spec(qk_layernorm=..., normalization=
"RMSNorm") (megatron/core/models/gpt/gpt_layer_specs.py). ``weight_map(spec)`` keeps the entries a model
has: no output_layer.weight with tied embeddings, no q/k_layernorm without QK-norm, no linear_qkv.bias
without q/k/v biases.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from alignaudit.engines.layouts import fuse_qkv_grouped, split_qkv_grouped
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec

_L = "model.layers.{i}."
WEIGHT_MAP: dict[str, tuple[str, ...]] = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
    "decoder.layers.{i}.input_layernorm.weight": (_L + "input_layernorm.weight",),
    "decoder.layers.{i}.self_attention.linear_qkv.weight": (
        _L + "self_attn.q_proj.weight",
        _L + "self_attn.k_proj.weight",
        _L + "self_attn.v_proj.weight",
    ),
    "decoder.layers.{i}.self_attention.linear_qkv.bias": (
        _L + "self_attn.q_proj.bias",
        _L + "self_attn.k_proj.bias",
        _L + "self_attn.v_proj.bias",
    ),
    "decoder.layers.{i}.self_attention.q_layernorm.weight": (_L + "self_attn.q_norm.weight",),
    "decoder.layers.{i}.self_attention.k_layernorm.weight": (_L + "self_attn.k_norm.weight",),
    "decoder.layers.{i}.self_attention.linear_proj.weight": (_L + "self_attn.o_proj.weight",),
    "decoder.layers.{i}.pre_mlp_layernorm.weight": (_L + "post_attention_layernorm.weight",),
    "decoder.layers.{i}.mlp.linear_fc1.weight": (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
    "decoder.layers.{i}.mlp.linear_fc2.weight": (_L + "mlp.down_proj.weight",),
    # MoE layers (alignaudit.arch.qwen3_moe), {j} the expert: SequentialMLP's local experts
    "decoder.layers.{i}.mlp.router.weight": (_L + "mlp.gate.weight",),
    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight": (
        _L + "mlp.experts.{j}.gate_proj.weight",
        _L + "mlp.experts.{j}.up_proj.weight",
    ),
    "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight": (_L + "mlp.experts.{j}.down_proj.weight",),
    "decoder.final_layernorm.weight": ("model.norm.weight",),
    "output_layer.weight": ("lm_head.weight",),
}


def weight_map(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """The entries of WEIGHT_MAP that ``spec``'s model has (a dense MLP or experts, not both)."""
    moe = {name for name in WEIGHT_MAP if ".mlp.router." in name or ".mlp.experts." in name}
    dense = {name for name in WEIGHT_MAP if ".mlp.linear_fc" in name}
    absent = set(dense if spec.num_experts else moe)
    if spec.tie_word_embeddings:
        absent.add("output_layer.weight")
    if not spec.attention_bias:
        absent.add("linear_qkv.bias")
    if not spec.qk_norm:
        absent.update({"q_layernorm.weight", "k_layernorm.weight"})
    return {
        name: sources
        for name, sources in WEIGHT_MAP.items()
        if name not in absent and ".".join(name.split(".")[-2:]) not in absent
    }


FUSE: dict[str, Callable[..., torch.Tensor]] = {
    "linear_qkv.weight": lambda spec, q, k, v: fuse_qkv_grouped(q, k, v, spec.num_query_groups, dim=0),
    "linear_qkv.bias": lambda spec, q, k, v: fuse_qkv_grouped(q, k, v, spec.num_query_groups, dim=0),
    "linear_fc1.weight": lambda spec, gate, up: torch.cat([gate, up], dim=0),  # SwiGLU: act(first) * second
}


# How Megatron shards each parameter over tensor-parallel ranks (megatron/core/tensor_parallel/layers.py):
# column-parallel layers split their output features (dim 0), row-parallel layers their input features
# (dim 1), the vocab-parallel embedding and output layer the vocabulary (dim 0); norms are replicated.
# The grouped QKV keeps whole query groups on a rank, so a plain split of dim 0 is right; SwiGLU's fc1
# holds [gate shard | up shard] on each rank.
TP_SPLIT: dict[str, int | str] = {
    "linear_qkv.weight": 0,
    "linear_qkv.bias": 0,
    "linear_fc1.weight": "glu",
    "linear_proj.weight": 1,
    "linear_fc2.weight": 1,
    "word_embeddings.weight": 0,
    "output_layer.weight": 0,
}


def tp_shard(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full Megatron parameter ``name`` at tensor-parallel size ``size``."""
    how = TP_SPLIT.get(".".join(name.split(".")[-2:]), TP_SPLIT.get(name))
    if size == 1 or how is None:
        return tensor
    if isinstance(how, str):  # "glu"
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return tensor.chunk(size, dim=how)[rank].contiguous()


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full Megatron parameter ``name`` from every tensor-parallel rank's shard, in rank order (the
    inverse of ``tp_shard``)."""
    how = TP_SPLIT.get(".".join(name.split(".")[-2:]), TP_SPLIT.get(name))
    if len(shards) == 1 or how is None:
        return shards[0]
    if isinstance(how, str):  # "glu"
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=how)


def megatron_state_dict(
    spec: ModelSpec, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Read the HF safetensors of ``spec`` and return Megatron parameter tensors in ``dtype``, sharded for
    rank ``tp_rank`` of ``tp_size`` tensor-parallel ranks.

    Raises:
        InputError: a tensor is missing, or a checkpoint tensor is not consumed by the map (it would be
            silently ignored).
    """
    tensors = _SafetensorsReader(Path(spec.path))
    out: dict[str, torch.Tensor] = {}
    for template, sources in weight_map(spec).items():
        for i, j in indices(template, spec):
            name = template.format(i=i, j=j)
            parts = [tensors.get(s.format(i=i, j=j)) for s in sources]
            fuse = FUSE.get(".".join(name.split(".")[-2:]))
            out[name] = tp_shard(name, (fuse(spec, *parts) if fuse else parts[0]), tp_rank, tp_size).to(dtype)
    unused = sorted(set(tensors.where) - tensors.read)
    if unused:
        raise InputError(
            f"the Megatron conversion does not use checkpoint tensor(s) {', '.join(unused[:3])}; they would be ignored"
        )
    return out


def indices(template: str, spec: ModelSpec) -> list[tuple[int | None, int | None]]:
    """(layer, expert) pairs a WEIGHT_MAP template stands for."""
    layers = range(spec.num_layers) if "{i}" in template else [None]
    experts = range(spec.num_experts) if "{j}" in template else [None]
    return [(i, j) for i in layers for j in experts]


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
            raise InputError(f"checkpoint has no tensor {name}, which the Megatron conversion needs") from None


def megatron_to_hf(gpt, spec: ModelSpec, diverged: list[str] | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors of a Megatron GPTModel built from ``spec`` (weights in the model's param dtype);
    ``diverged`` collects replicated parameters whose tensor-parallel copies differ.

    Raises:
        KeyError: a parameter the conversion map expects is missing.
    """
    state = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    state = _unsharded(state, diverged if diverged is not None else [])
    out: dict[str, torch.Tensor] = {}
    for template, sources in weight_map(spec).items():
        for i, j in indices(template, spec):
            name = template.format(i=i, j=j)
            tensor = state[name]
            parts: tuple[torch.Tensor, ...]
            if len(sources) == 1:
                parts = (tensor,)
            elif name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
                parts = split_qkv_grouped(tensor, spec.num_heads, spec.num_query_groups, spec.head_dim, dim=0)
            else:  # linear_fc1: [gate | up]
                parts = tuple(tensor.chunk(2, dim=0))
            for source, part in zip(sources, parts, strict=True):
                out[source.format(i=i, j=j)] = part.detach()
    return out


def _unsharded(state: dict[str, torch.Tensor], diverged: list[str]) -> dict[str, torch.Tensor]:
    """At tensor-parallel size > 1, every rank's shard of each parameter gathered (collective: every rank
    calls this) and put back together (tp_unshard); at size 1, ``state`` itself. A
    replicated parameter (norm weights, say) whose copies differ between ranks is appended to ``diverged``:
    a training-state bug no checksum of rank 0's weights would show (rank 0's copy is returned)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return state
    group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, shard in state.items():
        shards = [torch.empty_like(shard) for _ in range(group.size())]
        torch.distributed.all_gather(shards, shard.contiguous(), group=group)
        full[name] = tp_unshard(name, shards)
        if full[name] is shards[0] and not all(
            torch.equal(s.view(torch.uint8), shards[0].view(torch.uint8)) for s in shards[1:]
        ):
            diverged.append(name)  # a replicated parameter the ranks no longer agree on
    return full
