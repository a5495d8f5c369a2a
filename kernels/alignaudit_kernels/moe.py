"""Strict mixture-of-experts layer (Qwen3-MoE style): router, top-k routing, SwiGLU experts, combine.

One definition for every engine, each step with its order and rounding fixed:
    logits  = x @ W_router^T       fp32: x and W upcast, alignaudit_kernels.linear's K order, never rounded to
                                   the model dtype (a bf16 router logit is the usual cause of routing flips)
    chosen  = the top_k largest logits per token, in descending order; equal logits -> the lower expert
              index first (a stable sort of -logits; torch.topk leaves ties unspecified)
    weights = normalize (Qwen3's norm_topk_prob): softmax over the chosen logits, i.e. the top-k
              probabilities renormalized; otherwise softmax over all experts gathered at the chosen ones.
              fp32, primitives.exp, primitives.fixed_sum over the experts (or the k chosen)
    y_r     = down_e(silu_mul(gate_e(x), up_e(x))) for e = chosen[r]: alignaudit_kernels.linear and silu_mul,
              each rounded to x.dtype, as the dense strict MLP rounds
    out     = round(((w_0 * y_0) + w_1 * y_1) + ...)   fp32 products and sums in the chosen order, rounded once
A token's result depends on that token alone: the expert GEMMs are row-invariant and every other step is
per token, so the batch around it, and which other tokens share its experts, cannot change its bits.
Forward only (the strict path of rollout and rescoring; training the router is out of scope here).
"""

from __future__ import annotations

import torch

from alignaudit_kernels.grouped_linear import block_m_for, grouped_linear, plan_experts_triton
from alignaudit_kernels.matmul import linear
from alignaudit_kernels.primitives import cdiv, env_choice, exp, fixed_sum, no_gradient, triton, use_triton
from alignaudit_kernels.silu import silu_and_mul, silu_mul


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool):
    """Router logits, chosen experts and their weights for tokens x [T, H].

    Returns:
        logits fp32 [T, E]; chosen int64 [T, top_k] (descending logit, ties to the lower index);
        weights fp32 [T, top_k].
    Raises:
        ValueError: top_k outside [1, E].
    """
    num_experts = router_weight.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} outside [1, {num_experts}]")
    logits = linear(x.float(), router_weight.float())
    order = torch.sort(-logits, dim=-1, stable=True).indices
    chosen = order[:, :top_k]
    if normalize:
        picked = logits.gather(1, chosen)
        z = exp(picked - picked[:, :1])  # the first chosen logit is the largest
        return logits, chosen, z / fixed_sum(z)[:, None]
    z = exp(logits - logits.gather(1, order[:, :1]))
    return logits, chosen, (z / fixed_sum(z)[:, None]).gather(1, chosen)


DISPATCHES = ("gathered", "grouped", "every_expert")
DISPATCH_ENV = "ALIGNAUDIT_MOE_DISPATCH"


def asked_dispatch() -> str:
    """ALIGNAUDIT_MOE_DISPATCH: "auto" (unset) or one of DISPATCHES.

    Raises:
        ValueError: any other value, naming the ones there are.
    """
    return env_choice(DISPATCH_ENV, ("auto", *DISPATCHES))


def dispatch_for(x: torch.Tensor) -> str:
    """The dispatch ``combine_experts`` uses when none is given: ``asked_dispatch()``, where auto means "grouped" on
    the Triton backend (no host read, so vLLM's CUDA graphs capture it; 10 to 60 times faster than gathered's host
    reads on an H200, docs/log/gpu-sessions.md 2026-12-05) and "gathered" on the CPU backend. Raises ValueError as
    asked_dispatch."""
    asked = asked_dispatch()
    if asked != "auto":
        return asked
    return "grouped" if use_triton(x) else "gathered"


def combine_experts(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up, down, dispatch: str | None = None
) -> torch.Tensor:
    """The experts' SwiGLU outputs for routed tokens, combined in the routing order (module docstring).

    Args:
        x: [T, H] tokens. chosen: [T, top_k] expert indices (int). weights: [T, top_k] fp32, in ``chosen``'s order.
        gate_up: [E, 2I, H], each expert's gate rows then up rows (transformers' and vLLM's fused layout), or a
            sequence of E [2I, H] tensors (Megatron's SequentialMLP experts).
        down: [E, H, I], or a sequence of E [H, I] tensors.
        dispatch: how tokens reach their experts; every one gives the same bits, since the strict linear is
            row-invariant (tests/kernels/test_moe_kernel.py):
            "gathered"      each chosen expert on its tokens, found by reading the routing on the host;
            "grouped"       the pairs sorted by expert on the device and one grouped launch per product
                            (kernels/alignaudit_kernels/grouped_linear.py; Triton; a sequence of weights is
                            stacked first): no host read, CUDA graphs can capture it;
            "every_expert"  every expert computes every token, each token keeping its chosen experts' rows
                            (no host read either; E / top_k times the work).
            None: ``dispatch_for``.
    Returns:
        [T, H] in x.dtype: round(((w_0 * y_0) + w_1 * y_1) + ...), fp32 products and sums, rounded once.
    Raises:
        ValueError: weights not fp32, an unknown dispatch, or "grouped" without the Triton backend.
    """
    t, h = x.shape
    top_k = chosen.shape[1]
    width = gate_up[0].shape[0] // 2
    if weights.dtype != torch.float32:  # a wider dtype would promote the combine past fp32, a narrower round first
        raise ValueError(f"combine_experts: routing weights in {weights.dtype}; route() gives them in float32")
    dispatch = dispatch or dispatch_for(x)
    if dispatch == "grouped":
        expert_out = _grouped(x, chosen, gate_up, down).view(t, top_k, h)
    elif dispatch == "every_expert":
        # linear is row-invariant: a token's rows have the bits of the gathered path
        expert_out = torch.zeros(t, top_k, h, dtype=x.dtype, device=x.device)
        for e in range(len(gate_up)):
            y = _expert(x, gate_up[e], down[e], width)
            expert_out = torch.where((chosen == e)[..., None], y[:, None, :], expert_out)
    elif dispatch == "gathered":
        expert_out = torch.zeros(t, top_k, h, dtype=x.dtype, device=x.device)
        for e in torch.unique(chosen).tolist():
            if not 0 <= e < len(gate_up):  # a negative index would pick an expert from the end
                raise IndexError(f"expert id {e} outside [0, {len(gate_up)})")
            token, slot = (chosen == e).nonzero(as_tuple=True)
            expert_out[token, slot] = _expert(x[token], gate_up[e], down[e], width)
    else:
        raise ValueError(f"dispatch {dispatch!r}: use one of {', '.join(DISPATCHES)}")
    return combine(expert_out, weights)


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weighted_sum``'s result: by one Triton launch where the Triton backend runs and no gradient is recorded
    (rollout, rescoring), by ``weighted_sum`` itself otherwise (autograd records it); the same bits either way."""
    one_launch = use_triton(expert_out) and no_gradient(expert_out, weights)
    return (_weighted_sum_triton if one_launch else weighted_sum)(expert_out, weights)


def weighted_sum(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The combine step in torch: expert_out [T, top_k, H] (the experts' outputs, in the routing's slot order),
    weights [T, top_k] fp32 -> [T, H] in expert_out's dtype: round(((w_0 * y_0) + w_1 * y_1) + ...), each
    product and sum an fp32 operation rounded on its own (no FMA), rounded once at the end."""
    acc = weights[:, :1] * expert_out[:, 0].float()
    for r in range(1, expert_out.shape[1]):
        acc = acc + weights[:, r : r + 1] * expert_out[:, r].float()
    return acc.to(expert_out.dtype)


def _weighted_sum_triton(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weighted_sum`` in one Triton launch, the same operations in the same order (compiled without FMA
    contraction; forward only, no autograd): its 3 * top_k torch launches over [T, H] (upcasts, products, sums, the
    rounding) were 0.7 of the grouped MoE layer's 2.4 ms at 4096 tokens (bench/moe_gpu.py, H100, 2026-12-05).
    weights must be fp32. Bits: tests/kernels/test_moe_kernel.py."""
    t, top_k, h = expert_out.shape
    expert_out, weights = expert_out.contiguous(), weights.contiguous()
    out = torch.empty(t, h, dtype=expert_out.dtype, device=expert_out.device)
    block = 1024
    if t:
        _weighted_sum_kernel[(t, cdiv(h, block))](
            expert_out, weights, out, h, TOP_K=top_k, BLOCK=block, num_warps=4, enable_fp_fusion=False
        )
    return out


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _weighted_sum_kernel(y_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """Program (t, j): columns j * BLOCK.. of token t, its TOP_K rows y[t, r] summed in slot order."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        rows = y_ptr + t * TOP_K * H + cols
        acc = tl.load(w_ptr + t * TOP_K) * tl.load(rows, mask=mask, other=0.0).to(tl.float32)
        for r in tl.static_range(1, TOP_K):
            acc = acc + tl.load(w_ptr + t * TOP_K + r) * tl.load(rows + r * H, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _grouped(x: torch.Tensor, chosen: torch.Tensor, gate_up, down, tile=None) -> torch.Tensor:
    """[T * top_k, H]: row t * top_k + r is expert chosen[t, r]'s SwiGLU output for token t (grouped_linear; ``tile``:
    its launch tile for both products, benchmarks only)."""
    if not use_triton(x):
        raise ValueError("the grouped MoE dispatch needs the Triton backend (CUDA, or TRITON_INTERPRET=1)")
    gate_up, down = _stacked(gate_up), _stacked(down)
    experts = gate_up.shape[0]
    plan = plan_experts_triton(chosen, experts, tile[0] if tile else block_m_for(chosen.numel(), experts, x.dtype))
    hidden = silu_and_mul(grouped_linear(x, gate_up, plan, gather=True, tile=tile))
    return grouped_linear(hidden, down, plan, gather=False, tile=tile, scatter=True)  # rows back in pair order


def _stacked(weights) -> torch.Tensor:
    """[E, N, K]: a stacked tensor as it is, a sequence of E [N, K] tensors (Megatron's experts) stacked: a copy
    of every expert's weight at each call, the price of asking Megatron for the grouped dispatch."""
    return weights if isinstance(weights, torch.Tensor) else torch.stack(list(weights))


def _expert(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, width: int) -> torch.Tensor:
    """One expert's SwiGLU MLP of rows [R, H]: down(silu(gate(rows)) * up(rows)), each product rounded to rows.dtype."""
    return linear(silu_mul(linear(rows, gate_up[:width]), linear(rows, gate_up[width:])), down)


def mixture_of_experts(
    x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, normalize: bool
):
    """The strict MoE layer of the module docstring: ``route`` then ``combine_experts``.

    Args:
        x: [T, H] tokens (bf16/fp16/fp32). router_weight: [E, H]. gate_up, down: as ``combine_experts``.
        top_k: experts per token. normalize: renormalize the chosen probabilities.
    Returns:
        (out [T, H] in x.dtype, logits fp32 [T, E], chosen int64 [T, top_k]).
    """
    logits, chosen, weights = route(x, router_weight, top_k, normalize)
    return combine_experts(x, chosen, weights, gate_up, down), logits, chosen


def reference(x, router_weight, gate_up, down, top_k, normalize):
    """Plain torch in x's dtype (float64 inputs for an accuracy reference): softmax, topk, weighted sum."""
    probs = torch.softmax(x @ router_weight.T, dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    width = gate_up[0].shape[0] // 2
    out = torch.zeros_like(x)
    for r in range(top_k):
        g = torch.einsum("th,tih->ti", x, gate_up[chosen[:, r], :width])
        u = torch.einsum("th,tih->ti", x, gate_up[chosen[:, r], width:])
        out = out + top[:, r : r + 1] * torch.einsum("ti,thi->th", torch.nn.functional.silu(g) * u, down[chosen[:, r]])
    return out
