"""Pieces the engine integrations share."""

from __future__ import annotations

import torch

from alignaudit.engines.custom_ops import rope, rotate
from alignaudit_kernels.primitives import compiling_inference


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """``limit``: a host int above every position (the caller's sequence bound), so that no host read of
        positions is needed: on a GPU such a read per layer stalls the launch queue. Without it the bound is
        read from positions (a synchronization)."""
        flat = x.reshape(-1, x.shape[-2], x.shape[-1])
        positions = positions.reshape(-1).to(x.device)
        if limit is None:
            limit = int(positions.max()) + 1 if positions.numel() else 0
        rotate_ = rope if compiling_inference(x) else rotate  # traced without gradients: one opaque op
        rows = max(self.max_positions, limit)
        return rotate_(flat, positions, self.theta, rows, list(self.llama3 or ())).view(x.shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}" + (f", llama3={self.llama3}" if self.llama3 else "")


class StrictRouter(torch.nn.Module):
    """The strict MoE router as a module (alignaudit_kernels.route), so op capture can hook its output.

    forward(x [T, H], weight [E, H]) -> (logits fp32 [T, E], chosen int64 [T, top_k] by descending logit,
    ties to the lower expert, weights fp32 [T, top_k]). The router weight stays with the engine's own
    router module and is passed in, so checkpoints and weight syncs see no new parameter. ``layer`` names
    the decoder layer for custom_ops.ROUTING_OBSERVERS (-1: none).
    """

    def __init__(self, top_k: int, normalize: bool, layer: int = -1):
        super().__init__()
        self.top_k, self.normalize, self.layer = top_k, normalize, layer

    def forward(self, x: torch.Tensor, weight: torch.Tensor):
        return torch.ops.alignaudit.moe_route(x, weight, self.top_k, self.normalize, self.layer)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, normalize={self.normalize}, layer={self.layer}"
