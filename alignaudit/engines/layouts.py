"""Fused-tensor layouts of the engines, as pure reshapes (used for weights and for activations).

Megatron-Core's ``linear_qkv`` groups its output features per query group (GQA):
    [ q heads of group 0 | k of group 0 | v of group 0 | q heads of group 1 | k of group 1 | ... ]
each head ``head_dim`` wide (megatron/core/transformer/attention.py, SelfAttention.get_query_key_value_tensors:
the mixed tensor is viewed as [..., num_query_groups, (heads_per_group + 2) * head_dim] and split).
vLLM's ``qkv_proj`` and ``gate_up_proj`` concatenate whole blocks: [q | k | v] and [gate | up]
(vllm/model_executor/layers/linear.py, QKVParallelLinear and MergedColumnParallelLinear).
Megatron's ``linear_fc1`` for SwiGLU is [gate | up] as well (megatron/core/transformer/mlp.py, glu()).
"""

from __future__ import annotations

import torch


def fuse_qkv_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int, dim: int = 0) -> torch.Tensor:
    """[q | k | v] blocks along ``dim`` -> Megatron's per-query-group interleaving along ``dim``.

    Args:
        q: size ``num_heads * head_dim`` along ``dim``; k, v: ``num_groups * head_dim`` along ``dim``.
        num_groups: number of KV heads (query groups).
    """
    dim = dim % q.dim()

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(dim, (num_groups, t.shape[dim] // num_groups))

    return torch.cat([grouped(q), grouped(k), grouped(v)], dim=dim + 1).flatten(dim, dim + 1)


def split_qkv_grouped(
    qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int, dim: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv_grouped``: Megatron's grouped QKV along ``dim`` -> (q, k, v) blocks."""
    dim = dim % qkv.dim()
    per_group = num_heads // num_groups * head_dim
    grouped = qkv.unflatten(dim, (num_groups, per_group + 2 * head_dim))
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=dim + 1)
    return q.flatten(dim, dim + 1), k.flatten(dim, dim + 1), v.flatten(dim, dim + 1)


def split_blocks(fused: torch.Tensor, sizes: list[int], dim: int = -1) -> tuple[torch.Tensor, ...]:
    """[a | b | ...] concatenated blocks (vLLM's qkv_proj, gate_up_proj) -> the blocks."""
    return tuple(fused.split(sizes, dim=dim))
