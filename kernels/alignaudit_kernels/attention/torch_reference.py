"""Plain-torch causal attention: the accuracy reference and the backward of the strict kernels.

The backward is correct and deterministic, not strict; ALIGNAUDIT_BACKWARD chooses it
(kernels/alignaudit_kernels/gradients.py):
    reference  (default) autograd through ``batched_reference`` in fp32, gradients rounded once to the inputs'
               dtype: more exact than a trainer's default, and it holds B * H * Tq * Tk fp32 scores per chunk
    fused      torch's scaled_dot_product_attention forward and backward in the inputs' dtype (on CUDA in bf16/fp16
               its FlashAttention-2 kernel for the plain causal mask, a memory-efficient kernel for shifted
               positions, whose boolean [B, 1, Tq, Tk] mask is the only T x T tensor: the precision of a default
               trainer's attention backward, no fp32 scores; under torch's deterministic mode); K and V expanded
               to the query heads, the group's gradients summed in fp32. A query with no visible key (a position
               below 0: its forward row is NaN) goes through the reference instead, whose gradients carry that NaN
               as the forward did. varlen_attention on CUDA takes FlashAttention-2's varlen backward directly
               (flash_gradients)
"""

from __future__ import annotations

import contextlib

import torch

from alignaudit_kernels.attention.flash_gradients import deterministic_algorithms
from alignaudit_kernels.gradients import backward_on


def reference(q, k, v, scale, q_positions=None):
    """Plain torch causal attention for one sequence (float64 inputs for an accuracy reference): q [Tq, H, D],
    k/v [Tk, KVH, D] at key positions 0..Tk-1, queries at ``q_positions`` [Tq] (default: the last Tq)."""
    tq, tk = q.shape[0], k.shape[0]
    pos = torch.arange(tk - tq, tk, device=q.device) if q_positions is None else q_positions
    return batched_reference(q[None], k[None], v[None], scale, pos[None])[0]


def batched_reference(q, k, v, scale, q_positions):
    """``reference`` for B sequences at once: q [B, Tq, H, D], k/v [B, Tk, KVH, D], q_positions [B, Tq]
    -> [B, Tq, H, D] in q's dtype (its fp32 scores take B * H * Tq * Tk elements)."""
    h, kvh = q.shape[2], k.shape[2]
    kk, vv = k.repeat_interleave(h // kvh, 2), v.repeat_interleave(h // kvh, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    keys = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(keys[None, None, None, :] > q_positions[:, None, :, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)


REFERENCE_GRAD_ELEMENTS = 1 << 27  # fp32 score elements per batched reference in the backward (512 MiB)


def _reference_gradients(q, k, v, g, scale, q_positions):
    """Gradients of q, k, v [B, T, heads, D] (g: q's shape) through ``batched_reference`` in fp32, rounded once to
    their dtypes; as many sequences at a time as keep the fp32 scores within REFERENCE_GRAD_ELEMENTS (it built
    one autograd graph per sequence and layer: about 900 a training step at the Qwen3-1.7B shape, 32 sequences x
    28 layers)."""
    per_sequence = max(1, q.shape[2] * q.shape[1] * k.shape[1])  # 0 for sequences of no tokens
    chunk = max(1, REFERENCE_GRAD_ELEMENTS // per_sequence)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    positions = q_positions.to(q.device)
    for start in range(0, q.shape[0], chunk):
        rows = slice(start, start + chunk)
        with torch.enable_grad():
            qs, ks, vs = (t[rows].detach().float().requires_grad_() for t in (q, k, v))
            out = batched_reference(qs, ks, vs, scale, positions[rows])
            for grad, part in zip(grads, torch.autograd.grad(out, (qs, ks, vs), g[rows].float()), strict=True):
                grad[rows] = part
    return grads


def attention_gradients(q, k, v, g, scale, q_positions, from_zero=False):
    """Gradients of q [B, Tq, H, D], k and v [B, Tk, KVH, D] of causal attention with queries at ``q_positions``
    [B, Tq] (keys at 0..Tk-1), given g (q's shape): by the backward ALIGNAUDIT_BACKWARD asks (module docstring).
    from_zero: the caller guarantees every row's positions are 0..Tk-1 (whole sequences), so the fused path skips
    its two checks of the positions, each a GPU synchronization when they live there. Returns (dq, dk, dv) in the
    inputs' dtypes. Raises ValueError as gradients.backward_on."""
    if backward_on(q.is_cuda) == "fused" and (from_zero or not bool((q_positions < 0).any())):
        return _sdpa_gradients(q, k, v, g, scale, q_positions, from_zero)
    return _reference_gradients(q, k, v, g, scale, q_positions)


def _sdpa_gradients(q, k, v, g, scale, q_positions, from_zero=False):
    """``attention_gradients`` by torch's SDPA: is_causal where every row's queries sit at 0..Tk-1 (Tq = Tk; the
    flash kernel's mask), otherwise a boolean mask of the keys at or before each query's position. On CUDA under
    torch's deterministic mode (flash_gradients.deterministic_algorithms: its flash and memory-efficient backwards
    otherwise add partial gradients with atomics)."""
    b, tq, h, _ = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    positions = q_positions.to(q.device)
    keys = torch.arange(tk, device=q.device)
    plain = tq == tk and (from_zero or bool(torch.equal(positions, keys.expand(b, tk))))
    mask = None if plain else (keys[None, None, None, :] <= positions[:, None, :, None])
    deterministic = deterministic_algorithms() if q.is_cuda else contextlib.nullcontext()
    with torch.enable_grad(), deterministic:
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        expand = [t.transpose(1, 2).repeat_interleave(h // kvh, 1) for t in (ks, vs)]  # [B, H, Tk, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(1, 2), *expand, attn_mask=mask, is_causal=plain, scale=scale
        )
        dq, dk_heads, dv_heads = torch.autograd.grad(out, (qs, *expand), g.transpose(1, 2).to(out.dtype))
    group = [t.float().unflatten(1, (kvh, h // kvh)).sum(2).transpose(1, 2).to(k.dtype) for t in (dk_heads, dv_heads)]
    return dq, *group
