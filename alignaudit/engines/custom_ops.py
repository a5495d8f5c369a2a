"""Strict kernels as torch.library custom ops (namespace ``alignaudit``) where vLLM needs more than the
kernel functions, which become opaque ops of their own under torch.compile (alignaudit_kernels.primitives.
opaque_op): rope (with the tables built eagerly), the row-parallel partial product, the MoE router and experts.
rope and linear_partial run where no gradient is recorded and are registered as ``opaque_op`` registers (less
host time a call; a call that would record a gradient is refused). The MoE ops stay ``torch.library.custom_op``s:
trainers call them with gradients recorded, which opaque_op refuses at the call, while custom_op raises only if a
backward reaches the op itself.

torch.compile treats a custom op as opaque: it neither fuses its arithmetic with neighbouring ops nor
contracts its multiplies and adds into FMAs, so a compiled engine (vLLM's default) computes exactly what
the kernel's contract says. Forward only; each op has a fake implementation for tracing.
Importing this module registers the ops (once per process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import alignaudit_kernels as K
from alignaudit_kernels.primitives import opaque_op


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, rows: int, llama3: list[float]) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by the angles of ``positions`` [tokens] (int) from tables of at least
    ``rows`` positions (rope_tables rounds up to whole TABLE_ROWS; a table row does not depend on the table's
    length, so a position in that margin rotates correctly); ``llama3`` [factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings] for llama3 rope scaling, or [] for none. A position
    past the tables is never read: an IndexError on the CPU, NaN rows on a GPU (alignaudit_kernels.apply_rope
    checks in the kernel; a device-side assert cost three launches per call, in every layer of every vLLM
    step)."""
    return K.apply_rope(x, positions, *_tables(x, theta, rows, llama3))


def _tables(x: torch.Tensor, theta: float, rows: int, llama3: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables (fp32 [>= rows, head_dim / 2], cached per process) for x's head_dim and device."""
    scaling = (llama3[0], llama3[1], llama3[2], int(llama3[3])) if llama3 else None
    return K.rope_tables(rows, x.shape[-1], theta, str(x.device), scaling)


@opaque_op(
    "rope",
    "(Tensor x, Tensor positions, float theta, int rows, float[] llama3) -> Tensor",
    lambda x, positions, theta, rows, llama3: x.new_empty(x.shape),
    namespace="alignaudit",
)
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, rows: int, llama3: list[float]) -> torch.Tensor:
    """``rotate`` as one opaque op (vLLM, and torch.compile of the other engines): the tables are built
    eagerly (a compiled torch.cos could round otherwise), with no host read of positions."""
    return rotate(x, positions, theta, rows, llama3)


@opaque_op(
    "rope_qk",
    "(Tensor q, Tensor k, Tensor positions, float theta, int rows, float[] llama3) -> (Tensor, Tensor)",
    lambda q, k, *rest: (q.new_empty(q.shape), k.new_empty(k.shape)),
    namespace="alignaudit",
)
def rope_qk(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float, rows: int, llama3: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope`` of queries q [tokens, query heads, head_dim] and keys k [tokens, KV heads, head_dim] as one
    opaque op and one kernel launch (alignaudit_kernels.apply_rope_qk): the bits of two ``rope`` calls, with one
    dispatch, one table lookup and one launch less in every attention layer of an eager step."""
    return K.apply_rope_qk(q, k, positions, *_tables(q, theta, rows, llama3))


@opaque_op(
    "linear_partial",
    "(Tensor x, Tensor weight, int k_segments) -> Tensor",
    lambda x, weight, k_segments: x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32),
    namespace="alignaudit",
)
def linear_partial(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> torch.Tensor:
    return K.linear_partial(x, weight, k_segments)


# layer -> fn(logits, chosen): called by moe_route with each routing decision it makes. An opaque op runs
# eagerly inside a compiled graph, so this sees the routing where module hooks cannot (vLLM's compiled
# model), as vLLM's own router.capture_fn does for its fused MoE. Op capture (engines/vllm/taps.py) sets it.
ROUTING_OBSERVERS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {}


@torch.library.custom_op("alignaudit::moe_route", mutates_args=())
def moe_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, layer: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H] -> (logits fp32 [T, E], chosen int64 [T, top_k], weights fp32 [T, top_k]);
    ``layer`` keys ROUTING_OBSERVERS."""
    logits, chosen, weights = K.route(x, weight, top_k, normalize)
    observer = ROUTING_OBSERVERS.get(layer)
    if observer is not None:
        observer(logits, chosen)
    return logits, chosen.contiguous(), weights.contiguous()


@moe_route.register_fake
def _(x, weight, top_k, normalize, layer=-1):
    t = x.shape[0]
    return (
        x.new_empty((t, weight.shape[0]), dtype=torch.float32),
        x.new_empty((t, top_k), dtype=torch.int64),
        x.new_empty((t, top_k), dtype=torch.float32),
    )


@torch.library.custom_op("alignaudit::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """x [T, H], chosen/weights [T, top_k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x.dtype."""
    return K.combine_experts(x, chosen, weights, gate_up, down)


@moe_experts.register_fake
def _(x, chosen, weights, gate_up, down):
    return torch.empty_like(x)
