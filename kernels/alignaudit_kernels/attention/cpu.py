"""The CPU backend of strict attention: the algorithm of the package docstring in torch, key chunks folded in
order, sums by alignaudit_kernels.primitives.fixed_sum."""

from __future__ import annotations

import torch

from alignaudit_kernels.attention.algorithm import BLOCK_N, CHUNK_N
from alignaudit_kernels.primitives import (
    exp,
    fixed_sum,
)

CPU_CHUNK_ELEMENTS = 1 << 24


def _cpu_attend(q, k, v, q_positions, scale):
    """One sequence on the CPU: q [Tq, H, D], k/v [Tk, KVH, D] at key positions 0..Tk-1."""
    tq, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    out = torch.empty(tq, h, d, dtype=torch.float32)
    rows = max(1, CPU_CHUNK_ELEMENTS // max(1, h * BLOCK_N * d))
    for start in range(0, tq, rows):
        pos = q_positions[start : start + rows].cpu()
        out[start : start + rows] = _cpu_rows(
            q[start : start + rows].float().view(-1, kvh, group, d), k, v, pos, scale
        ).view(-1, h, d)
    return out.to(q.dtype)


def _cpu_rows(qf, k, v, pos, scale):
    m, l, acc = _cpu_chunk(qf, k, v, pos, scale, 0)
    for c0 in range(CHUNK_N, int(pos.max()) + 1, CHUNK_N):
        m, l, acc = _cpu_merge((m, l, acc), _cpu_chunk(qf, k, v, pos, scale, c0), (c0 <= pos)[:, None, None])
    return acc / l[..., None]


def _cpu_chunk(qf, k, v, pos, scale, c0):
    """The softmax state of rows qf [n, KVH, group, D] over keys c0 .. c0 + CHUNK_N - 1, from a fresh state."""
    n, kvh, group, d = qf.shape
    m = torch.full((n, kvh, group), float("-inf"))
    l = torch.zeros(n, kvh, group)
    acc = torch.zeros(n, kvh, group, d)
    for j0 in range(c0, min(c0 + CHUNK_N, int(pos.max()) + 1), BLOCK_N):
        kb = _block(k, j0)  # [BLOCK_N, KVH, D] fp32, zero past the end
        vb = _block(v, j0)
        s = fixed_sum(qf[:, :, :, None, :] * kb.permute(1, 0, 2)[None, :, None, :, :], dim=-1) * scale
        visible = (j0 + torch.arange(BLOCK_N))[None, :] <= pos[:, None]  # [n, BLOCK_N]
        s = torch.where(visible[:, None, None, :], s, float("-inf"))
        active = (j0 <= pos)[:, None, None]
        m_new = torch.maximum(m, s.amax(-1))
        alpha = exp(m - m_new)
        p = exp(s - m_new[..., None])
        p_rounded = p.to(v.dtype).float()
        pv = fixed_sum(p_rounded[..., None] * vb.permute(1, 0, 2)[None, :, None, :, :], dim=-2)
        l = torch.where(active, l * alpha + fixed_sum(p), l)
        acc = torch.where(active[..., None], acc * alpha[..., None] + pv, acc)
        m = torch.where(active, m_new, m)
    return m, l, acc


def _cpu_merge(state, chunk, active):
    """Fold a later chunk's (m, l, acc) into the running state where ``active`` [n, 1, 1]."""
    (m, l, acc), (m_c, l_c, acc_c) = state, chunk
    m_new = torch.maximum(m, m_c)
    a, b = exp(m - m_new), exp(m_c - m_new)
    return (
        torch.where(active, m_new, m),
        torch.where(active, l * a + l_c * b, l),
        torch.where(active[..., None], acc * a[..., None] + acc_c * b[..., None], acc),
    )


def _block(x, j0):
    blk = x[j0 : j0 + BLOCK_N].float()
    if blk.shape[0] < BLOCK_N:
        blk = torch.nn.functional.pad(blk, (0, 0, 0, 0, 0, BLOCK_N - blk.shape[0]))
    return blk
