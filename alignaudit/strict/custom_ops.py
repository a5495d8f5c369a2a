"""Strict kernels as torch.library custom ops (namespace ``alignaudit``) where vLLM needs more than the
kernel functions, which become opaque ops of their own under torch.compile (alignaudit_kernels.primitives.
opaque_op): the row-parallel partial product and the MoE router and experts (rope: strict/common.py).

torch.compile treats a custom op as opaque: it neither fuses its arithmetic with neighbouring ops nor
contracts its multiplies and adds into FMAs, so a compiled engine (vLLM's default) computes exactly what
the kernel's contract says. Forward only; each op has a fake implementation for tracing.
Importing this module registers the ops (once per process).
"""

from __future__ import annotations

import torch

import alignaudit_kernels as K
import alignaudit.strict.common  # noqa: F401  (registers alignaudit::rope)


@torch.library.custom_op("alignaudit::linear_partial", mutates_args=())
def linear_partial(x: torch.Tensor, weight: torch.Tensor, k_segments: int) -> torch.Tensor:
    return K.linear_partial(x, weight, k_segments)


@linear_partial.register_fake
def _(x, weight, k_segments):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


# layer -> fn(logits, chosen): called by moe_route with each routing decision it makes. An opaque op runs
# eagerly inside a compiled graph, so this sees the routing where module hooks cannot (vLLM's compiled
# model), as vLLM's own router.capture_fn does for its fused MoE. Op capture (engines/vllm_taps.py) sets it.
ROUTING_OBSERVERS: dict[int, object] = {}


@torch.library.custom_op("alignaudit::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
              layer: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    return (x.new_empty((t, weight.shape[0]), dtype=torch.float32), x.new_empty((t, top_k), dtype=torch.int64),
            x.new_empty((t, top_k), dtype=torch.float32))


@torch.library.custom_op("alignaudit::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x [T, H], chosen/weights [T, top_k], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x.dtype."""
    return K.combine_experts(x, chosen, weights, gate_up, down)


@moe_experts.register_fake
def _(x, chosen, weights, gate_up, down):
    return torch.empty_like(x)
