"""Pieces the engine integrations share."""

from __future__ import annotations

import torch

import alignaudit_kernels as K
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


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, rows: int, llama3: list[float]) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by the angles of ``positions`` [tokens] (int) from the tables of
    ``rows`` positions; ``llama3`` [factor, low_freq_factor, high_freq_factor, original_max_position_embeddings]
    for llama3 rope scaling, or [] for none. A position >= rows fails a device-side assert (a RuntimeError on
    the CPU, a CUDA error at the next synchronization on a GPU) instead of reading past the tables."""
    if positions.numel():
        torch._assert_async(positions.max() < rows, "strict rope: a position past the rope tables")
    scaling = (llama3[0], llama3[1], llama3[2], int(llama3[3])) if llama3 else None
    cos, sin = K.rope_tables(rows, x.shape[-1], theta, str(x.device), scaling)
    return K.apply_rope(x, positions, cos, sin)


@torch.library.custom_op("alignaudit::rope", mutates_args=())
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rows: int, llama3: list[float]) -> torch.Tensor:
    """``rotate`` as one opaque op (vLLM, and torch.compile of the other engines): the tables are built
    eagerly (a compiled torch.cos could round otherwise), with no host read of positions."""
    return rotate(x, positions, theta, rows, llama3)


@rope.register_fake
def _(x, positions, theta, rows, llama3):
    return x.new_empty(x.shape)


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
        import alignaudit.strict.custom_ops  # noqa: F401  (opaque to torch.compile, as vLLM needs)

        return torch.ops.alignaudit.moe_route(x, weight, self.top_k, self.normalize, self.layer)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, normalize={self.normalize}, layer={self.layer}"
