"""Pieces the engine integrations share."""

from __future__ import annotations

import torch

import alignaudit_kernels as K


class RopeOp(torch.nn.Module):
    """Strict rotary embedding as a module, so op capture can hook its output.

    forward(x [..., heads, head_dim], positions [...]) -> x rotated, same shape and dtype. The cos/sin
    tables (alignaudit_kernels.rope_tables) are shared by every RopeOp of a process.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, float(theta), max_positions

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = K.rope_tables(max(self.max_positions, int(positions.max()) + 1), self.head_dim, self.theta,
                                 str(x.device))
        flat = x.reshape(-1, x.shape[-2], x.shape[-1])
        return K.apply_rope(flat, positions.reshape(-1).to(x.device), cos, sin).view(x.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
