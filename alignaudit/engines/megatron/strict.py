"""Strict path for Megatron-Core: a layer spec (ModuleSpec) and a GPTModel with a strict logprob head.

Build a model the way a Megatron trainer does, with the strict spec in place of the local one:

    ops = frozenset(STRICT_OPS)                            # alignaudit.inputs.strict_ops.STRICT_OPS, or a subset
    spec = strict_block_spec(config.num_layers, ops, rotary_base=theta, qk_layernorm=True)  # Qwen3: q/k norms
    model = StrictGPTModel(config, spec, vocab_size=..., max_sequence_length=..., rotary_base=theta,
                           position_embedding_type="rope", strict_ops=ops, ...)

(alignaudit.engines.megatron.adapter.MegatronEngine builds it so, from a ModelSpec.)

Per op:
    linear     ColumnParallelLinear / RowParallelLinear subclasses (and GPTModel.output_layer) whose
               forward is alignaudit_kernels.linear; row-parallel layers reduce K in ROW_PARALLEL_SEGMENTS
               segments and, at tensor-parallel size > 1, combine the ranks' fp32 partials in rank order
               (the bits of size 1), not an all-reduce of rounded outputs
    rmsnorm    StrictRMSNorm for input, pre-MLP, q/k and final norms; the residual adds stay Megatron's
               bias-dropout-add, which rounds ``residual + x`` once in the storage dtype (the kernels'
               rounding point 1); dropout must be 0
    silu       StrictMLP: linear_fc1 -> silu_and_mul -> linear_fc2
    rope       StrictCoreAttention rotates q and k itself (GPTModel is built without rope), at the positions
               StrictGPTModel.forward is given (position_ids; default each row's index), or, packed, at each
               token's index in its sequence
    attention  StrictCoreAttention: alignaudit_kernels.varlen_attention over the sequences of the batch:
               each row's one run of unmasked tokens (right or left padding, from the attention mask), or,
               packed (THD, packed_seq_params), the cu_seqlens of the pack
    logprobs   StrictGPTModel.compute_language_model_loss returns -token_logprobs (the loss whose
               negation RL trainers read as logprobs); at tensor-parallel size > 1
               token_logprobs_vocab_parallel over each rank's vocabulary shard
Forward and backward work (the kernels are autograd Functions). A sequence gets the same bits alone, in a
right- or left-padded batch, or packed (tests/engines/test_strict_layouts.py). What the strict kernels do not
compute is refused with a ValueError before anything runs: context, pipeline and expert parallelism, sequence
parallelism, masks that are not causal over one run of tokens per row, and packings with padded cu_seqlens.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

import alignaudit_kernels as K
from alignaudit.engines.strict_modules import RopeOp, StrictRouter
from alignaudit_kernels.primitives import to_device


def _tp_group(module):
    """The module's tensor-parallel group (megatron.core keeps it as ``tp_group``), or None at size 1."""
    group = getattr(module, "tp_group", None)
    return group if group is not None and group.size() > 1 else None


class StrictColumnParallelLinear(ColumnParallelLinear):
    """Output features split over ranks: each rank's shard is an independent strict linear (K whole). At
    tensor-parallel size > 1 the input passes Megatron's copy-to-region (identity forward, all-reduce of the
    input gradient backward), as ColumnParallelLinear does, so replicated parameters upstream get the same
    gradient on every rank."""

    def forward(self, input_, weight=None, runtime_gather_output=None, **kwargs):
        if _tp_group(self) is not None:
            if getattr(self, "gather_output", False):
                raise ValueError("strict column-parallel linear does not gather its output")
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            input_ = copy_to_tensor_model_parallel_region(input_)
        w = self.weight if weight is None else weight
        bias = None if self.skip_bias_add else self.bias
        return K.linear(input_, w, bias), (self.bias if self.skip_bias_add else None)


class _RowParallel(torch.autograd.Function):
    """The strict row-parallel product over ranks: forward as ``StrictRowParallelLinear`` says; backward
    the local products' gradients (the tree sum passes the output gradient to every rank's partial
    unchanged), products in the input dtype (matmul.linear_backward), as the strict linear's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        partial = K.linear_partial(x, weight, K.ROW_PARALLEL_SEGMENTS // group.size())
        parts = [torch.empty_like(partial) for _ in range(group.size())]
        torch.distributed.all_gather(parts, partial.contiguous(), group=group)
        return K.combine_partials(parts, bias, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        from alignaudit_kernels.matmul import linear_backward

        return (*linear_backward(grad, *ctx.saved_tensors, ctx.has_bias), None)


class StrictRowParallelLinear(RowParallelLinear):
    """K split over ranks: K reduced in ROW_PARALLEL_SEGMENTS segments; at tensor-parallel size t each rank
    computes its S/t segments' fp32 partial, the partials are gathered and added in rank order by the top
    of the segment tree, the bias is added and the sum rounded once (alignaudit_kernels.combine_partials):
    the bits of tensor-parallel size 1."""

    def forward(self, input_, **kwargs):
        bias = None if self.skip_bias_add else self.bias
        out_bias = self.bias if self.skip_bias_add else None
        group = _tp_group(self)
        if group is None:
            return K.linear(input_, self.weight, bias, K.ROW_PARALLEL_SEGMENTS), out_bias
        return _RowParallel.apply(input_, self.weight, bias, group), out_bias


class StrictRMSNorm(torch.nn.Module):
    """RMSNorm with Megatron's norm constructor signature (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        return K.rms_norm(x, self.weight, self.eps)


class StrictMLP(MLP):
    """SwiGLU MLP whose activation is alignaudit_kernels.silu_and_mul (fc1 output is [gate | up])."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(K.silu_and_mul(intermediate))


class StrictMoELayer(torch.nn.Module):
    """Stands in for MoELayer (router.weight [E, H]; experts.local_experts[j].linear_fc1.weight [2I, H] as
    [gate | up], linear_fc2.weight [H, I]; strict_router: a StrictRouter): the strict MoE layer
    (alignaudit_kernels.route, combine_experts) on [seq * batch, H], one rank. Returns (output, None) as
    MoELayer does."""

    def forward(self, hidden_states, *args, **kwargs):
        experts = self.experts.local_experts
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, chosen, weights = self.strict_router(x, self.router.weight)
        out = K.combine_experts(
            x, chosen, weights, [e.linear_fc1.weight for e in experts], [e.linear_fc2.weight for e in experts]
        )
        return out.view(hidden_states.shape), None


class StrictCoreAttention(MegatronModule):
    """Core attention that applies strict rope (``strict_rope``) and/or computes strict attention
    (``strict_attention``; otherwise Megatron's DotProductAttention). Inputs are [seq, batch, heads, dim];
    q_rope and k_rope are modules so op capture can see them."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        *,
        rotary_base: float,
        strict_rope: bool,
        strict_attention: bool,
        llama3: tuple | None = None,
        exp: str = "portable",
        kernel: str = "portable",
    ):
        super().__init__(config=config)
        self.strict_rope, self.strict_attention, self.strict_exp = strict_rope, strict_attention, exp
        self.strict_kernel = kernel
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.q_rope = RopeOp(config.kv_channels, rotary_base, 4096, llama3) if strict_rope else None
        self.k_rope = RopeOp(config.kv_channels, rotary_base, 4096, llama3) if strict_rope else None
        self.stock = (
            None
            if strict_attention
            else DotProductAttention(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout,
                softmax_scale,
                cp_comm_type,
                pg_collection,
            )
        )
        # set by StrictGPTModel.forward for one forward (what every layer would otherwise derive again)
        self.position_ids, self.position_limit, self.cu_seqlens = None, 0, None

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        if packed_seq_params is not None:  # THD: [tokens, heads, dim], sequences by cu_seqlens
            cu, positions, limit = (
                pack_layout(packed_seq_params, query.shape[0], query.device)
                if self.cu_seqlens is None
                # StrictGPTModel.forward read it once
                else (self.cu_seqlens, self.position_ids, self.position_limit)
            )
        else:  # [seq, batch, heads, dim]
            sq, b = query.shape[:2]
            positions = (
                torch.arange(sq, device=query.device)[:, None].expand(sq, b)
                if self.position_ids is None
                else self.position_ids.T
            )
            limit = sq if self.position_ids is None else self.position_limit
        if self.strict_rope:
            query, key = self.q_rope(query, positions, limit), self.k_rope(key, positions, limit)
        if not self.strict_attention:
            return self.stock(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        if packed_seq_params is not None:
            return K.varlen_attention(
                query, key, value, cu, self.scale, exp=self.strict_exp, kernel=self.strict_kernel
            ).flatten(1)
        q, k, v = (t.transpose(0, 1).reshape(b * sq, t.shape[2], t.shape[3]) for t in (query, key, value))
        cu = self.cu_seqlens if self.cu_seqlens is not None else padded_cu_seqlens(attention_mask, b, sq)
        out = K.varlen_attention(
            q, k, v, cu, self.scale, exp=self.strict_exp, kernel=self.strict_kernel
        )  # [b * sq, heads, dim]
        return out.view(b, sq, -1).transpose(0, 1).contiguous()


def packed_cu_seqlens(packed_seq_params, tokens: int) -> torch.Tensor:
    """The sequences of a THD pack (megatron.core.packed_seq_params.PackedSeqParams) as host cu_seqlens
    [sequences + 1] (int64) over its ``tokens`` rows.

    Raises:
        ValueError: a format other than "thd", query and key sequences that differ, padded cu_seqlens that
            differ from the unpadded ones, or cu_seqlens that do not cover the pack.
    """
    p = packed_seq_params
    if p.qkv_format != "thd":
        raise ValueError(f"StrictGPTModel: packed_seq_params.qkv_format {p.qkv_format!r} is not computed; pack as thd")
    cu = p.cu_seqlens_q.detach().cpu().long()
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(p, name)
        if other is not None and not torch.equal(other.detach().cpu().long(), cu):
            raise ValueError(
                f"StrictGPTModel: packed_seq_params.{name} differs from cu_seqlens_q; strict attention "
                "computes packs of whole, unpadded sequences (each its own queries and keys)"
            )
    if cu[0] != 0 or int(cu[-1]) != tokens or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"StrictGPTModel: cu_seqlens_q {cu.tolist()} do not cut the pack of {tokens} tokens into sequences"
        )
    return cu


def pack_layout(packed_seq_params, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A THD pack's (host cu_seqlens int64 [sequences + 1], positions int64 [tokens] on ``device``: each token's
    place in its sequence, the longest sequence: a host int above every position). Read once a forward
    (StrictGPTModel.forward): the cu_seqlens' read from the device and the positions' copy to it would otherwise
    make the host wait for the stream in every layer. Raises ValueError as ``packed_cu_seqlens``."""
    cu = packed_cu_seqlens(packed_seq_params, tokens)
    lengths = cu[1:] - cu[:-1]
    positions = torch.arange(tokens) - torch.repeat_interleave(cu[:-1], lengths)
    return cu, to_device(positions, device), int(lengths.max()) if len(lengths) else 0


def padded_cu_seqlens(attention_mask: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
    """The sequences strict attention computes for a padded batch of ``b`` rows of ``s`` tokens, as host
    cu_seqlens over the b * s rows taken row by row: in each row, the one run of tokens the mask lets attend
    each other causally, and the padding before and after it, each a sequence of its own (pads attend only
    pads, so no real token ever sees one). ``attention_mask``: None (every row one sequence) or bool,
    broadcastable to [b, 1, s, s], True = masked (Megatron's convention); a key no query attends is padding.
    One device synchronization.

    Raises:
        ValueError: a mask that is not bool, or that is not causal over one contiguous run of tokens per row
            (a hole, a bidirectional block, a pad a real token attends).
    """
    return _cu_seqlens(*mask_runs(attention_mask, b, s), s)


def _cu_seqlens(start: torch.Tensor, end: torch.Tensor, s: int) -> torch.Tensor:
    """cu_seqlens over the rows of s tokens each: every row's pads before its run, the run, the pads after."""
    rows = torch.arange(0, (len(start) + 1) * s, s)
    cuts = torch.stack([rows[:-1], rows[:-1] + start, rows[:-1] + end, rows[1:]], dim=1).flatten()
    return torch.unique_consecutive(cuts)


def mask_runs(attention_mask: torch.Tensor | None, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's run of tokens [start, end) (host int64 [b] each) from a padded batch's mask (see
    ``padded_cu_seqlens``); every row whole without a mask.

    Raises:
        ValueError: as ``padded_cu_seqlens``, and for a mask that is not broadcastable to [b, 1, s, s].
    """
    if attention_mask is None:
        return torch.zeros(b, dtype=torch.long), torch.full((b,), s)
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            f"StrictGPTModel: attention_mask must be bool (True = masked), as Megatron's; got {attention_mask.dtype}"
        )
    try:
        attend = ~attention_mask.expand(b, 1, s, s)[:, 0].cpu()  # [b, query, key]
    except RuntimeError:
        raise ValueError(
            f"StrictGPTModel: attention_mask {tuple(attention_mask.shape)} does not broadcast to "
            f"[batch, 1, seq, seq] = {(b, 1, s, s)}"
        ) from None
    valid = attend.any(dim=1)  # keys some query attends
    index = torch.arange(s)
    start = torch.where(valid.any(1), valid.int().argmax(1), 0)
    end = torch.where(valid.any(1), s - valid.flip(1).int().argmax(1), 0)
    inside = (index >= start[:, None]) & (index < end[:, None])
    causal = index[None, :] <= index[:, None]
    expected = causal[None] & inside[:, :, None] & inside[:, None, :]
    if not (torch.equal(valid, inside) and torch.equal(attend & inside[:, :, None], expected)):
        raise ValueError(
            "StrictGPTModel: attention_mask must be causal over one contiguous run of tokens per row, "
            "padding masked as keys (left or right padding); strict attention computes no other mask"
        )
    return start, end


def strict_layer_spec(
    ops: frozenset[str],
    rotary_base: float,
    qk_layernorm: bool = True,
    llama3: tuple | None = None,
    num_experts: int = 0,
    exp: str = "portable",
    kernel: str = "portable",
) -> ModuleSpec:
    """The local GPT layer spec with the strict ops swapped in (``llama3``: ModelSpec.rope_llama3; ``exp`` and
    ``kernel``: the strict attention's, alignaudit_kernels.attention). An MoE layer keeps Megatron's MoELayer in the
    spec; StrictGPTModel swaps its forward for the strict one.

    Raises:
        alignaudit.errors.InputError: strict ops on ROCm (alignaudit.inputs.strict_ops.check_platform).
    """
    from alignaudit.inputs.strict_ops import guard_platform

    guard_platform(ops, "strict_layer_spec")
    spec = get_gpt_layer_local_spec(
        qk_layernorm=qk_layernorm, normalization="RMSNorm", num_experts=num_experts or None, moe_grouped_gemm=False
    )
    layer = spec.submodules
    attn = layer.self_attention.submodules
    if "rmsnorm" in ops:
        layer.input_layernorm = layer.pre_mlp_layernorm = StrictRMSNorm
        if qk_layernorm:
            attn.q_layernorm = attn.k_layernorm = StrictRMSNorm
    if "linear" in ops:
        attn.linear_qkv = StrictColumnParallelLinear
        attn.linear_proj = StrictRowParallelLinear
    if {"linear", "silu"} & ops and not num_experts:
        linear = "linear" in ops
        layer.mlp = _mlp_spec(
            StrictMLP if "silu" in ops else MLP,
            MLPSubmodules(
                linear_fc1=StrictColumnParallelLinear if linear else ColumnParallelLinear,
                linear_fc2=StrictRowParallelLinear if linear else RowParallelLinear,
            ),
        )
    if {"rope", "attention"} & ops:
        attn.core_attention = ModuleSpec(
            module=StrictCoreAttention,
            params={
                "rotary_base": rotary_base,
                "strict_rope": "rope" in ops,
                "strict_attention": "attention" in ops,
                "llama3": llama3,
                "exp": exp,
                "kernel": kernel,
            },
        )
    return spec


def _mlp_spec(mlp_cls, submodules):
    """An MLP spec in the form this megatron-core builds: a partial of ``as_mlp_submodule`` (0.19+), or
    a ModuleSpec (0.16)."""
    if hasattr(mlp_cls, "as_mlp_submodule"):
        return functools.partial(mlp_cls.as_mlp_submodule, submodules=submodules)
    return ModuleSpec(module=mlp_cls, submodules=submodules)


def strict_block_spec(
    num_layers: int,
    ops: frozenset[str],
    rotary_base: float,
    qk_layernorm: bool = True,
    llama3: tuple | None = None,
    num_experts: int = 0,
    exp: str = "portable",
    kernel: str = "portable",
) -> TransformerBlockSubmodules:
    """A TransformerBlockSubmodules of strict layers; the final norm is strict too with "rmsnorm"; ``exp`` and
    ``kernel``: the strict attention's exp and kernel (alignaudit_kernels.attention.EXP_CHOICES, KERNELS)."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    layer = strict_layer_spec(ops, rotary_base, qk_layernorm, llama3, num_experts, exp, kernel)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=StrictRMSNorm if "rmsnorm" in ops else LNImpl
    )


# megatron.core parallelism the strict kernels do not compute, and why (ValueError at StrictGPTModel()).
REFUSED_PARALLELISM = {
    "context_parallel_size": "strict attention holds each sequence's keys on one rank",
    "pipeline_model_parallel_size": "alignaudit builds and checks the strict model as one pipeline stage",
    "expert_model_parallel_size": "the strict MoE layer computes every expert on one rank",
}


def check_parallelism(config) -> None:
    """Refuse a TransformerConfig whose parallelism the strict model would not compute as Megatron does.

    Raises:
        ValueError: naming the setting and why (REFUSED_PARALLELISM; sequence_parallel: the strict row-parallel
            product gathers the ranks' fp32 partials and adds them in rank order, where sequence parallelism
            reduce-scatters rounded outputs).
    """
    for name, why in REFUSED_PARALLELISM.items():
        if (getattr(config, name, 1) or 1) > 1:
            raise ValueError(f"StrictGPTModel: {name}={getattr(config, name)} is not supported: {why}; use 1")
    if getattr(config, "sequence_parallel", False):
        raise ValueError(
            "StrictGPTModel: sequence_parallel is not supported: the strict row-parallel product adds "
            "the ranks' fp32 partials in rank order and keeps activations whole; turn it off"
        )


def _position_ids(position_ids: torch.Tensor | None, input_ids: torch.Tensor, config) -> torch.Tensor | None:
    """``position_ids`` [b, s] if they differ from each row's index (a left-padded batch's), else None.

    Raises:
        ValueError: other than [b, s], or given with activation recomputation (a recomputed layer would not see
            them).
    """
    if position_ids is None:
        return None
    b, s = input_ids.shape[:2]
    if tuple(position_ids.shape) != (b, s) and tuple(position_ids.shape) != (1, s):
        raise ValueError(f"StrictGPTModel: position_ids {tuple(position_ids.shape)} must be [batch, seq] = {(b, s)}")
    position_ids = position_ids.expand(b, s)
    if torch.equal(position_ids, torch.arange(s, device=position_ids.device).expand(b, s).to(position_ids.dtype)):
        return None
    if getattr(config, "recompute_granularity", None) is not None:
        raise ValueError(
            "StrictGPTModel: position_ids other than each row's index with recompute_granularity set: "
            "a recomputed layer would rotate at the index; turn recomputation off or pack the batch "
            "(packed_seq_params)"
        )
    return position_ids


class StrictGPTModel(GPTModel):
    """GPTModel whose output layer and logprob head are strict (per ``strict_ops``); with strict rope, the
    model's own rotary embedding is turned off (StrictCoreAttention rotates instead)."""

    def __init__(self, config, transformer_layer_spec, *args, strict_ops: frozenset[str] = frozenset(), **kwargs):
        check_parallelism(config)
        if "rope" in strict_ops:
            kwargs["position_embedding_type"] = "none"
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        self.strict_ops = strict_ops
        self._core_attention = [m for m in self.modules() if isinstance(m, StrictCoreAttention)]
        if "linear" in strict_ops and getattr(self, "output_layer", None) is not None:
            self.output_layer.__class__ = StrictColumnParallelLinear
        if "linear" in strict_ops:
            from megatron.core.transformer.moe.moe_layer import MoELayer

            for module in self.modules():
                if type(module) is MoELayer:
                    module.strict_router = StrictRouter(config.moe_router_topk, not config.moe_router_pre_softmax)
                    module.__class__ = StrictMoELayer

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        """GPTModel.forward for the batches trainers feed: input_ids [b, s] with a causal or padding mask (bool,
        True = masked) and position_ids (strict rope rotates at them; Megatron's own rope would not read them),
        or a THD pack ([1, tokens] with packed_seq_params). A layout the strict attention or rope would not
        compute as asked raises ValueError naming the argument, never is computed otherwise."""
        positions, cu, limit = None, None, 0
        if kwargs.get("packed_seq_params") is not None:
            if input_ids.dim() != 2 or input_ids.shape[0] != 1:
                raise ValueError(
                    f"StrictGPTModel: a THD pack is input_ids [1, tokens], not {tuple(input_ids.shape)}; "
                    "concatenate the sequences and give their cu_seqlens"
                )
            if self._core_attention:  # strict rope or attention reads the pack (else Megatron's own attention)
                cu, positions, limit = pack_layout(kwargs["packed_seq_params"], input_ids.shape[1], input_ids.device)
        else:
            if "rope" in self.strict_ops:
                positions = _position_ids(position_ids, input_ids, self.config)
            if "attention" in self.strict_ops:
                start, end = mask_runs(attention_mask, *input_ids.shape[:2])
                if "rope" in self.strict_ops and position_ids is None and bool((start > 0).any()):
                    raise ValueError(
                        "StrictGPTModel: a left-padded row needs position_ids (0 from its first token); "
                        "without them its tokens would be rotated at their index in the row"
                    )
                cu = _cu_seqlens(start, end, input_ids.shape[1])
            limit = int(positions.max()) + 1 if positions is not None else 0  # one synchronization, not one a layer
        for module in self._core_attention:
            module.position_ids, module.position_limit, module.cu_seqlens = positions, limit, cu
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            for module in self._core_attention:
                module.position_ids = module.cu_seqlens = None

    def compute_language_model_loss(self, labels, logits):
        if "logprobs" not in self.strict_ops:
            return super().compute_language_model_loss(labels, logits)
        # logits [s, b, v] (v: this rank's vocabulary shard), labels [b, s] -> per-token loss [b, s], as Megatron
        # returns it. At tensor-parallel size > 1 the ranks all-reduce the row statistics, never the logits
        # (as Megatron's vocab-parallel cross-entropy does); the strict sums are exact, so: the bits of size 1.
        group = _tp_group(self.output_layer)
        if group is not None:
            shard = logits.shape[-1]
            return -K.token_logprobs_vocab_parallel(
                logits.transpose(0, 1), labels, group.rank() * shard, shard * group.size(), group
            )
        return -K.token_logprobs(logits.transpose(0, 1), labels)
