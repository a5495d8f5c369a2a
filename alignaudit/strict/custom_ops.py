"""The strict kernels as torch.library custom ops (namespace ``alignaudit``), for inference engines.

torch.compile treats a custom op as opaque: it neither fuses its arithmetic with neighbouring ops nor
contracts its multiplies and adds into FMAs, so a compiled engine (vLLM's default) computes exactly what
the kernel's contract says. Forward only; each op has a fake implementation for tracing.
Importing this module registers the ops (once per process).
"""

from __future__ import annotations

import torch

import alignaudit_kernels as K


@torch.library.custom_op("alignaudit::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_segments: int = 1) -> torch.Tensor:
    return K.linear(x, weight, bias, k_segments)


@linear.register_fake
def _(x, weight, bias=None, k_segments=1):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("alignaudit::linear_partial", mutates_args=())
def linear_partial(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> torch.Tensor:
    return K.linear_partial(x, weight, k_segments)


@linear_partial.register_fake
def _(x, weight, k_segments):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("alignaudit::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return K.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("alignaudit::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = K.rms_norm(x, weight, eps, residual=residual)
    return y, s


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("alignaudit::rope", mutates_args=())
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, max_positions: int,
         llama3: list[float]) -> torch.Tensor:
    """x [tokens, heads, head_dim], positions [tokens]; ``llama3`` [factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings] for llama3 rope scaling, or [] for none."""
    scaling = (llama3[0], llama3[1], llama3[2], int(llama3[3])) if llama3 else None
    cos, sin = K.rope_tables(max_positions, x.shape[-1], theta, str(x.device), scaling)
    return K.apply_rope(x, positions, cos, sin)


@rope.register_fake
def _(x, positions, theta, max_positions, llama3):
    return torch.empty_like(x)


@torch.library.custom_op("alignaudit::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return K.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("alignaudit::log_softmax", mutates_args=())
def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return K.log_softmax(logits)


@log_softmax.register_fake
def _(logits):
    return logits.new_empty(logits.shape, dtype=torch.float32)
