"""Pieces the engine integrations share."""

from __future__ import annotations

import torch

import alignaudit_kernels as K


class RopeOp(torch.nn.Module):
    """Strict rotary embedding as a module, so op capture can hook its output.

    forward(x [..., heads, head_dim], positions [...]) -> x rotated, same shape and dtype. The cos/sin
    tables (alignaudit_kernels.rope_tables) are shared by every RopeOp of a process. ``llama3``: the llama3
    rope scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or None.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int, llama3: tuple | None = None):
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, float(theta), max_positions
        self.llama3 = tuple(llama3) if llama3 else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = K.rope_tables(max(self.max_positions, int(positions.max()) + 1), self.head_dim, self.theta,
                                 str(x.device), self.llama3)
        flat = x.reshape(-1, x.shape[-2], x.shape[-1])
        return K.apply_rope(flat, positions.reshape(-1).to(x.device), cos, sin).view(x.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}" + (f", llama3={self.llama3}" if self.llama3 else "")
