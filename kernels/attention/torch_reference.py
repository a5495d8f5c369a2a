"""Plain-torch causal attention: the accuracy reference and the backward of the strict kernels (fp32)."""

from __future__ import annotations

import torch


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
    per_sequence = q.shape[2] * q.shape[1] * k.shape[1]
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
