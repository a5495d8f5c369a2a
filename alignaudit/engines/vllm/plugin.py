"""vLLM general plugin: the strict path inside vLLM, for alignaudit and for a user's own RL stack.

Registered under the ``vllm.general_plugins`` entry point (pyproject.toml), so vLLM calls ``register()``
in every process it starts. It does nothing unless ALIGNAUDIT_STRICT names ops ("all", or a list such
as "rmsnorm,rope"); then it replaces, for every model vLLM loads (all patches live here):
    linear     UnquantizedLinearMethod.apply and LogitsProcessor._apply_head (the lm_head, in head_dtype)
               with alignaudit_kernels.linear; row-parallel layers with K in ROW_PARALLEL_SEGMENTS segments, and at
               tensor-parallel size > 1 RowParallelLinear.forward combines the ranks' fp32 partials in
               rank order instead of all-reducing rounded outputs; on the CPU the weights stay in place (no
               oneDNN repacking); Qwen3MoeSparseMoeBlock.forward with the strict MoE layer
               (alignaudit::moe_route on a StrictRouter module, alignaudit::moe_experts), its expert weights
               kept in place on the CPU too (no grouped-GEMM prepacking)
    rmsnorm    RMSNorm.forward with alignaudit_kernels.rms_norm (fused residual add,
               rounded once to the storage dtype, then normalized)
    rope       RotaryEmbedding.forward with alignaudit::rope_qk (query and key in one launch; alignaudit::rope for a
               query alone) (neox style, rotary_dim == head_size; plain, or Llama3RotaryEmbedding with its
               scaling read from the module)
    silu       SiluAndMul.forward with alignaudit_kernels.silu_and_mul
    logprobs   Sampler.compute_logprobs with alignaudit_kernels.log_softmax (prompt and sample logprobs), and
               model runner V2's compute_token_logprobs (its fused kernel) with token_logprobs / log_softmax;
               processed logprobs (logprobs_mode=processed_logprobs, as TRL, verl and NeMo-RL run vLLM): the
               temperature, top-k and top-p through alignaudit.engines.sampling (the functions a trainer
               replays them with), then the strict log-softmax (refused under model runner V2)
    attention  the CPU_ATTN backend (CPU) or the FLASH_ATTN backend (CUDA) with strict paged attention
               (alignaudit.engines.vllm.attention_cpu, vllm_cuda_attention); exp from ALIGNAUDIT_STRICT_EXP
The kernels are torch.library custom ops while torch.compile traces them (alignaudit_kernels::*, and
alignaudit::rope/rope_qk/moe_route/moe_experts), opaque to it, so compiled and eager vLLM agree.
vLLM's compile cache is bypassed (VLLM_DISABLE_COMPILE_CACHE=1 unless set): its key does not see these
patches, so a graph compiled without them could otherwise be loaded.

Use in your own vLLM server: ``pip install alignaudit`` beside vLLM, then
``ALIGNAUDIT_STRICT=all vllm serve ...`` (docs/strict.md).
"""

from __future__ import annotations

import logging
import os
import sys
import types

import torch

import alignaudit_kernels as K
from alignaudit.inputs.strict_ops import ENV, check_platform, parse_strict

# A child of vLLM's "vllm" logger, so that the line register() writes has vLLM's handler and format (vllm/logger.py
# configures "vllm" with propagate False: a logger of another name would print nothing).
log = logging.getLogger("vllm.plugins.alignaudit_strict")
_applied: set[str] = set()
_originals: dict[tuple[type | types.ModuleType, str], object] = {}


def register() -> None:
    """vLLM's entry point: apply the ops named in ALIGNAUDIT_STRICT (idempotent, additive), and say in vLLM's
    log, once per process, which ops are strict ("alignaudit strict ops active in vLLM: ...").

    Raises:
        InputError: on ROCm without ALIGNAUDIT_ROCM_UNCHECKED=1 (alignaudit.inputs.strict_ops.check_platform).
    """
    ops = parse_strict(os.environ.get(ENV))
    todo = ops - _applied
    if not todo:
        return
    warning = check_platform(ops, where=ENV)  # raises on ROCm unless told otherwise
    if warning:
        _say(warning)
    import alignaudit.engines.custom_ops  # noqa: F401  (registers torch.ops.alignaudit.*)

    # vLLM's torch.compile cache is keyed by the model code and config, not by these patches: a graph
    # compiled earlier without them would be loaded and run instead. Bypass the cache unless told otherwise.
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

    _mark_built_models()
    for op in sorted(todo):
        PATCHES[op]()
        _applied.add(op)
    _say(f"alignaudit strict ops active in vLLM: {', '.join(sorted(_applied))}")


# The attribute BaseModelLoader.load_model sets on every model it builds once the plugin is registered: the ops
# applied at that moment. Ops patched later do not reach a model already built (its attention backend is chosen,
# and on the CPU its linear weights packed, while it is built), so this, not the process's set, is what counts.
MODEL_MARK = "alignaudit_strict_ops"


def _mark_built_models() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if (BaseModelLoader, "load_model") in _originals:
        return
    load = BaseModelLoader.load_model

    def load_model(self, *args, **kwargs):
        model = load(self, *args, **kwargs)
        setattr(model, MODEL_MARK, tuple(sorted(_applied)))
        return model

    _patch(BaseModelLoader, "load_model", load_model)


def built_with(model: torch.nn.Module) -> tuple[str, ...]:
    """The strict ops applied when ``model`` (a loaded vLLM model, or a wrapper holding it) was built; () for a model
    built before the plugin was registered in its process, or by a loader that overrides
    ``BaseModelLoader.load_model`` (tensorizer, ...): counted as not strict."""
    for module in (model, *model.modules()):
        mark = getattr(module, MODEL_MARK, None)
        if mark is not None:
            return mark
    return ()


def _say(text: str) -> None:
    """One INFO line in vLLM's log; on stderr where vLLM has not configured its logging yet (vLLM 0.32 does so
    when the engine's arguments are made, after alignaudit's engine registers the plugin)."""
    if logging.getLogger("vllm").handlers:
        log.info(text)
    else:
        print(f"INFO alignaudit: {text}", file=sys.stderr, flush=True)


_MISSING = object()


def unregister() -> None:
    """Restore every patched attribute (for tests and notebooks)."""
    for (owner, name), original in _originals.items():
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _originals.clear()
    _applied.clear()


def _patch(owner: type | types.ModuleType, name: str, value) -> None:
    """Set ``owner.name`` (a class or module attribute), remembering what the owner itself defined there."""
    _originals.setdefault((owner, name), owner.__dict__.get(name, _MISSING))
    setattr(owner, name, value)


def _linear() -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    def apply(self, layer, x, bias=None):
        segments = K.ROW_PARALLEL_SEGMENTS if isinstance(layer, RowParallelLinear) else 1
        return K.linear(x, layer.weight, bias, segments)

    _patch(UnquantizedLinearMethod, "apply", apply)
    _patch(UnquantizedEmbeddingMethod, "apply", apply)
    _patch(RowParallelLinear, "forward", _row_parallel_forward)

    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    def apply_head(self, lm_head, hidden_states, embedding_bias):
        # head_dtype (e.g. float32) above the model dtype: vLLM casts both operands, then projects
        dtype = self.head_dtype or hidden_states.dtype
        bias = None if embedding_bias is None else embedding_bias.to(dtype)
        return K.linear(hidden_states.to(dtype), lm_head.weight.to(dtype), bias)

    _patch(LogitsProcessor, "_apply_head", apply_head)
    if current_platform.is_cpu():  # the CPU path repacks weights for oneDNN and empties layer.weight
        _patch(UnquantizedLinearMethod, "process_weights_after_loading", lambda self, layer: None)
    _mixture_of_experts()


def _mixture_of_experts() -> None:
    """Qwen3 MoE blocks compute the strict MoE layer (part of "linear": the router and expert linears)."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from vllm.platforms import current_platform

    from alignaudit.engines.strict_modules import StrictRouter

    original_init = Qwen3MoeSparseMoeBlock.__init__

    def __init__(self, vllm_config, prefix: str = "", *args, **kwargs):
        from vllm.model_executor.models.utils import extract_layer_index

        original_init(self, vllm_config, prefix, *args, **kwargs)
        config = vllm_config.model_config.hf_text_config
        if self.tp_size > 1 or self.ep_size > 1 or self.shared_expert is not None:
            raise NotImplementedError("the strict MoE layer in vLLM runs one rank without shared experts")
        self.strict_router = StrictRouter(
            config.num_experts_per_tok, bool(config.norm_topk_prob), extract_layer_index(prefix)
        )

    def forward(self, hidden_states):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        _, chosen, weights = self.strict_router(x, self.gate.weight)
        experts = self.experts.routed_experts  # w13 [E, 2I, H] as [gate | up], w2 [E, H, I]
        out = torch.ops.alignaudit.moe_experts(x, chosen, weights, experts.w13_weight, experts.w2_weight)
        return out.view(hidden_states.shape)

    _patch(Qwen3MoeSparseMoeBlock, "__init__", __init__)
    _patch(Qwen3MoeSparseMoeBlock, "forward", forward)
    # vLLM converts the expert weights after loading into the layout of the MoE kernel it picked: packed and
    # padded for the CPU's grouped GEMM, [up | gate] or blocked for FlashInfer's CUDA kernels
    # (fused_moe/oracle/unquantized.py). The strict layer reads them as loaded, [gate | up].
    if current_platform.is_cpu():
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        _patch(CPUUnquantizedExperts, "process_weights_after_loading", lambda self, layer: None)
    else:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        _patch(UnquantizedFusedMoEMethod, "process_weights_after_loading", lambda self, layer: None)


def _row_parallel_forward(self, input_):
    """vLLM's RowParallelLinear at tensor-parallel size > 1, strict: each rank's fp32 partial over its
    ROW_PARALLEL_SEGMENTS / tp segments, gathered, added by the top of the segment tree in rank order, bias
    added, rounded once (alignaudit_kernels.combine_partials); not an all-reduce of rounded outputs."""
    from vllm.distributed import tensor_model_parallel_all_gather

    if self.tp_size == 1 or not self.reduce_results:
        output = self.quant_method.apply(self, input_, None if self.skip_bias_add else self.bias)
    else:
        if not self.input_is_parallel:
            raise NotImplementedError("strict row-parallel linear expects parallel input (input_is_parallel)")
        partial = torch.ops.alignaudit.linear_partial(input_, self.weight, K.ROW_PARALLEL_SEGMENTS // self.tp_size)
        parts = tensor_model_parallel_all_gather(partial.unsqueeze(0), dim=0)  # [tp, ..., N], rank order
        output = K.combine_partials(list(parts.unbind(0)), None if self.skip_bias_add else self.bias, input_.dtype)
    if not self.return_bias:
        return output
    return output, (self.bias if self.skip_bias_add else None)


def _rmsnorm() -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm

    def forward(self, x, residual=None):
        if getattr(self, "variance_size_override", None) is not None:
            raise NotImplementedError("strict RMSNorm does not support variance_size_override")
        if residual is None:
            return K.rms_norm(x, self.weight, self.variance_epsilon)
        return K.rms_norm(x, self.weight, self.variance_epsilon, residual=residual)

    _patch(RMSNorm, "forward", forward)


def _rope() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding

    def forward(self, positions, query, key=None, *args, **kwargs):
        if (
            not self.is_neox_style
            or self.rotary_dim != self.head_size
            or type(self) not in (RotaryEmbedding, Llama3RotaryEmbedding)
        ):
            raise NotImplementedError(
                f"strict rope supports neox-style RotaryEmbedding and Llama3RotaryEmbedding, not {type(self).__name__}"
            )
        theta, limit, d = float(self.base), self.max_position_embeddings, self.head_size
        llama3 = (
            [
                float(self.scaling_factor),
                float(self.low_freq_factor),
                float(self.high_freq_factor),
                float(self.orig_max_position),
            ]
            if type(self) is Llama3RotaryEmbedding
            else []
        )
        flat = positions.reshape(-1)
        q = query.view(flat.shape[0], -1, d)
        if key is None:
            return torch.ops.alignaudit.rope(q, flat, theta, limit, llama3).view(query.shape), None
        q, k = torch.ops.alignaudit.rope_qk(q, key.view(flat.shape[0], -1, d), flat, theta, limit, llama3)
        return q.view(query.shape), k.view(key.shape)

    _patch(RotaryEmbedding, "forward", forward)


def _silu() -> None:
    from vllm.model_executor.layers.activation import SiluAndMul

    _patch(SiluAndMul, "forward", lambda self, x: K.silu_and_mul(x))


def _logprobs() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    _patch(Sampler, "compute_logprobs", staticmethod(lambda logits: K.log_softmax(logits)))
    _patch(Sampler, "apply_temperature", staticmethod(_apply_temperature))
    for name in ("forward_native", "forward_cpu"):  # what TopKTopPSampler.__init__ binds in processed modes
        if name in TopKTopPSampler.__dict__:
            _patch(TopKTopPSampler, name, _processed(TopKTopPSampler.__dict__[name]))
    try:  # model runner V2 (vllm/v1/worker/gpu/): its own fused max + logsumexp kernel, called by module name
        from vllm.v1.worker.gpu.sample import logprob as runner_v2
        from vllm.v1.worker.gpu.sample.sampler import Sampler as SamplerV2
    except ImportError:
        return
    _patch(runner_v2, "compute_token_logprobs", _token_logprobs_columns)
    _patch(SamplerV2, "__init__", _refuse_processed(SamplerV2.__init__))


def _apply_temperature(logits: torch.Tensor, temp: torch.Tensor, all_random: bool) -> torch.Tensor:
    """Sampler.apply_temperature, through the function the trainer replays it with (engines/sampling.py):
    fp32 [B, V] / temp [B]; greedy rows (temperature ~0) divided by 1, as vLLM does."""
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    from alignaudit.engines.sampling import scale_by_temperature

    if not all_random:
        temp = torch.where(temp < _SAMPLING_EPS, 1.0, temp)
    return scale_by_temperature(logits, temp)


PROCESSED_MODES = ("processed_logprobs", "processed_logits")


def _processed(forward):
    """TopKTopPSampler.forward_native / forward_cpu with strict processed logprobs: top-k and top-p through the
    function the trainer replays them with (alignaudit.engines.sampling.truncate, each row alone where top-p
    applies), the logprobs through the strict log-softmax; vLLM's own sampler then draws from the truncated
    logits (called with no top-k/top-p left to apply). Other logprob modes run vLLM's forward unchanged."""
    from alignaudit.engines.sampling import truncate

    def strict_forward(self, logits, generators, k, p):
        mode = self.logprobs_mode
        if mode not in PROCESSED_MODES:
            return forward(self, logits, generators, k, p)
        logits = truncate(logits.float(), k, p)
        processed = K.log_softmax(logits) if mode == "processed_logprobs" else logits
        self.logprobs_mode = "raw_logprobs"  # vLLM's forward returns no processed values of its own then
        try:
            sampled, _ = forward(self, logits, generators, None, None)
        finally:
            self.logprobs_mode = mode
        return sampled, processed

    return strict_forward


def _refuse_processed(init):
    """Model runner V2's Sampler.__init__, refusing processed logprobs: its fused Triton sampling kernels apply
    temperature, top-k and top-p, which the strict path does not replace."""

    def strict_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.logprobs_mode in PROCESSED_MODES:
            raise NotImplementedError(
                f"alignaudit strict logprobs: vLLM's model runner V2 computes "
                f"{self.logprobs_mode} in its own sampling kernels; use model runner V1 "
                "runner (VLLM_USE_V2_MODEL_RUNNER=0) or raw_logprobs"
            )

    return strict_init


def _token_logprobs_columns(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Model runner V2's compute_token_logprobs, strict: logits [B, V], token_ids [B, k] -> fp32 logprobs
    [B, k] (vllm/v1/worker/gpu/sample/logprob.py); one column through token_logprobs, more through
    log_softmax (the same bits, alignaudit_kernels.logprobs)."""
    token_ids = token_ids.long()
    if token_ids.shape[1] == 1:
        return K.token_logprobs(logits, token_ids[:, 0])[:, None]
    return K.log_softmax(logits).gather(1, token_ids)


# The strict attention backends by vLLM platform: the backend each overrides, and the class (a dotted path, which
# vLLM imports in each of its processes). The CPU platform selects CPU_ATTN and nothing else; on CUDA, FLASH_ATTN
# is the one vLLM selects on Hopper, batch-invariant mode included.
ATTENTION_BACKENDS = {
    "cpu": ("CPU_ATTN", "alignaudit.engines.vllm.attention_cpu.StrictCPUAttentionBackend"),
    "cuda": ("FLASH_ATTN", "alignaudit.engines.vllm.attention_cuda.StrictFlashAttentionBackend"),
}


def _attention() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None
    if platform is not None:
        member, backend = ATTENTION_BACKENDS[platform]
        register_backend(AttentionBackendEnum[member], backend)
    else:
        raise NotImplementedError(
            f"strict attention inside vLLM runs on its CPU and CUDA platforms, not on "
            f"{type(current_platform).__name__}; drop 'attention' from ALIGNAUDIT_STRICT"
        )


PATCHES = {
    "linear": _linear,
    "rmsnorm": _rmsnorm,
    "rope": _rope,
    "silu": _silu,
    "logprobs": _logprobs,
    "attention": _attention,
}
