"""Weights in Hugging Face names out of a running vLLM and into it (the rollout side of a weight sync).

RL frameworks (verl, slime, NeMo-RL) push a trainer's updated weights into a running vLLM through the model's
``load_weights(iterable of (hf_name, tensor))``; the engine stays up. This module does that, and reads back
what each engine holds in the same HF names so a sync can be checked bit for bit:

    vllm_to_hf        vLLM Qwen3 parameters -> HF tensors (qkv_proj split [q | k | v], gate_up_proj [gate | up])
    load_into_vllm    model.load_weights(...) on the running engine, then vLLM's own post-load step
(The trainer's side, Megatron parameters -> HF names, is alignaudit.engines.megatron.weights.megatron_to_hf;
checksums of either side: alignaudit.engines.base.checksums.)

vLLM's CPU backend packs each linear weight for oneDNN after loading and frees the parameter
(UnquantizedLinearMethod.process_weights_after_loading -> dispatch_cpu_unquantized_gemm(remove_weight=True)),
so a later load_weights has nowhere to write and the packed copy would go stale. ``keep_vllm_cpu_weights``
(called before the engine starts) keeps the parameters; after each load, vLLM's post-load step packs the new
weights again. Checksums of the parameters alone would not notice a stale packed copy, so
``stale_packed_layers`` checks the packed GEMMs themselves: each must give, bit for bit, what a GEMM packed
afresh from the current parameter gives on a probe input.
"""

from __future__ import annotations

import os

import torch

from alignaudit.engines.layouts import split_blocks
from alignaudit.inputs.checkpoint import ModelSpec

# Fault injection for the sync check's negative control (tests only): "stale-packed-weights" skips the
# post-load repacking, so vLLM keeps computing with the old weights while its parameters hold the new ones.
FAULT = "ALIGNAUDIT_FAULT"


def vllm_to_hf(model, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF-named tensors of a vLLM dense decoder (vllm/model_executor/models/qwen3.py, qwen2.py, llama.py):
    what the running engine computes with. Raises ValueError if a linear weight was freed (see the module docstring)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            raise ValueError(f"vLLM freed {name} after packing it; call keep_vllm_cpu_weights before the engine starts")
        if ".qkv_proj." in name:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), split_blocks(param, [q, kv, kv], dim=0), strict=True):
                out[name.replace("qkv_proj", part)] = t.detach()
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), param.chunk(2, dim=0), strict=True):
                out[name.replace("gate_up_proj", part)] = t.detach()
        else:
            out[name] = param.detach()
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


_kept = False


def keep_vllm_cpu_weights() -> None:
    """Make vLLM's CPU linear layers keep their parameters after packing them (idempotent; the worker process
    runs nothing else). A no-op where vLLM does not free them, and under the strict plugin, which keeps the
    weights and computes with them directly."""
    global _kept
    if _kept:
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        def process(self, layer):
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)

        UnquantizedLinearMethod.process_weights_after_loading = process  # type: ignore[method-assign]  # the patch
    _kept = True


def stale_packed_layers(model) -> list[str]:
    """Names of the layers whose packed CPU GEMM (``cpu_linear``, vllm/model_executor/layers/utils.py) does
    not compute with the layer's current weight: its output on a seeded probe input differs in any bit from
    that of a GEMM packed afresh from the weight. [] when nothing is packed (GPU, or the strict path)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    stale = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None or weight.ndim != 2 or weight.numel() == 0:
            continue
        fresh = torch.nn.Module()
        fresh.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        fresh.bias = None  # type: ignore[assignment]  # a plain attribute, as vLLM's layers hold no bias
        dispatch_cpu_unquantized_gemm(fresh, remove_weight=False)
        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(3, weight.shape[1], generator=generator).to(weight.dtype)
        with torch.no_grad():
            # cpu_linear: the function vLLM's dispatch set on each module (an attribute the type checker cannot see)
            used = module.cpu_linear(probe, weight, None)  # type: ignore[operator]
            expected = fresh.cpu_linear(probe, fresh.weight, None)  # type: ignore[operator]
        if not torch.equal(used.view(torch.uint8), expected.view(torch.uint8)):
            stale.append(name)
    return stale


def load_into_vllm(llm, tensors: dict[str, torch.Tensor]) -> None:
    """Push HF-named tensors into the running engine (``load_into_model`` on its model), then drop cached prefixes."""
    config = llm.llm_engine.vllm_config
    llm.apply_model(lambda model: load_into_model(model, config, tensors))
    llm.reset_prefix_cache()


def load_into_model(model, vllm_config, tensors: dict[str, torch.Tensor]) -> None:
    """``model.load_weights`` (as RL frameworks do), then vLLM's post-load step (on CPU: pack the new weights for
    oneDNN again), in the process that holds the model (``vllm_config``: the engine's VllmConfig)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model.load_weights(iter(tensors.items()))
    if os.environ.get(FAULT) != "stale-packed-weights":
        process_weights_after_loading(model, vllm_config.model_config, next(model.parameters()).device)


def kernels_of(model: torch.nn.Module) -> dict:
    """``{"attention_impls": {impl class: strict exp or None}, "attention_kernels": [strict attention kernel, ...],
    "linear_methods": [quant_method class, ...], "strict_ops": [op, ...]}`` of a loaded vLLM model
    (attention_cpu.attention_impls and attention_kernels, linear_methods, and the ops the
    strict plugin had applied when this model was built: plugin.built_with): what computes, read back where it
    computes (called through ``LLM.apply_model`` or the worker extension)."""
    from alignaudit.engines.vllm.attention_cpu import attention_impls, attention_kernels
    from alignaudit.engines.vllm.plugin import built_with

    return {
        "attention_impls": attention_impls(model),
        "attention_kernels": attention_kernels(model),
        "linear_methods": linear_methods(model),
        "strict_ops": sorted(built_with(model)),
    }


def check_strict_kernels(kernels: dict, strict_ops: frozenset[str], attention_kernel: str = "portable") -> None:
    """Refuse a vLLM that does not compute with the strict kernels asked for, from ``kernels_of``'s read-back;
    ``attention_kernel``: the strict attention kernel every attention layer must compute with
    (alignaudit_kernels.attention.KERNELS; ALIGNAUDIT_STRICT_ATTENTION chose it in vLLM's processes).

    Raises:
        EngineError: an op asked for that the plugin had not applied when the model was built; strict linear asked
            for and a layer on a quantized method (the plugin replaces
            UnquantizedLinearMethod only); strict attention asked for and a layer on an attention implementation
            the plugin did not replace (vLLM selected another backend, or the plugin was not registered in the
            process that built the model), or on another strict attention kernel than ``attention_kernel``.
    """
    from alignaudit.errors import EngineError

    missing = sorted(set(strict_ops) - set(kernels["strict_ops"]))
    if missing:
        raise EngineError(
            f"strict ops asked for but not applied when vLLM built this model: {', '.join(missing)}; "
            "set ALIGNAUDIT_STRICT before building the LLM (vLLM loads the plugin through alignaudit's "
            "entry point; from a source checkout, or with VLLM_PLUGINS leaving it out, call "
            "alignaudit.engines.vllm.plugin.register() first)"
        )
    quantized = [m for m in kernels["linear_methods"] if not m.startswith("Unquantized")]
    if "linear" in strict_ops and quantized:
        raise EngineError(
            f"strict linear was asked for, but vLLM computes products with {', '.join(quantized)}, "
            "which the strict plugin does not replace; drop quantization"
        )
    others = sorted(name for name, exp in kernels["attention_impls"].items() if exp is None)
    if "attention" in strict_ops and others:
        raise EngineError(
            f"strict attention was asked for, but vLLM computes attention with {', '.join(others)}: "
            "it selected a backend the strict plugin does not replace (CPU_ATTN on CPU, FLASH_ATTN "
            "on CUDA); drop attention_backend / VLLM_ATTENTION_BACKEND"
        )
    ran = kernels.get("attention_kernels") or []
    if "attention" in strict_ops and ran and ran != [attention_kernel]:
        raise EngineError(
            f"strict attention was asked for with the {attention_kernel} kernel, but vLLM computes it "
            f"with {', '.join(ran)}: ALIGNAUDIT_STRICT_ATTENTION in vLLM's environment chose another; "
            f"set it to {attention_kernel} or unset it"
        )


def linear_methods(model: torch.nn.Module) -> list[str]:
    """Class names of the ``quant_method`` of every linear and embedding layer of a loaded vLLM model, sorted
    (``UnquantizedLinearMethod``, ``Fp8LinearMethod``, ...): which kernels compute the products, read back rather
    than assumed from ``quantization``."""
    return sorted(
        {type(m.quant_method).__name__ for m in model.modules() if getattr(m, "quant_method", None) is not None}
    )
