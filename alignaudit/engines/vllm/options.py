"""vLLM options: the EngineArgs/SamplingParams settings alignaudit refuses, and why, checked before any engine
starts.

    VLLM_SET_BY_ALIGNAUDIT  settings alignaudit sets itself (use its flag instead)
    VLLM_REFUSED            settings that have no effect on what alignaudit measures, or that make the values
                            something other than logprobs (each a function of the value and the mode giving the
                            reason, or None where the value is fine)
    VLLM_RANGES             numeric settings out of the range vLLM's config accepts
docs/cli.md lists the same tables for users.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from alignaudit.errors import InputError
from alignaudit.inputs.strict_ops import runner_v2_asked

VLLM_SET_BY_ALIGNAUDIT: dict[str, str] = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "max_tokens": "--max-new-tokens",
    "min_tokens": "--max-new-tokens and --ignore-eos (min_tokens would mask EOS)",
    "ignore_eos": "--stop-at-eos / --ignore-eos",
    "logprobs": "alignaudit (the sampled token's logprob)",
    "prompt_logprobs": "--prompt-logprobs / --no-prompt-logprobs",
    "n": "--group-size",
    "detokenize": "alignaudit (token ids only)",
    "dtype": "--dtype / --infer-dtype",
    "model": "--model",
    "enable_sleep_mode": "rl --sleep-level (on CUDA; nothing else puts vLLM to sleep, so it would have no effect)",
}
ONE_ENGINE = "alignaudit runs vLLM as one engine, split by tensor_parallel_size only"
VLLM_REFUSED: dict[str, Callable[[Any, str], str | None]] = {
    "enable_prefix_caching": lambda v, mode: (
        (
            "has no effect in prompt mode: vLLM never reads the prefix cache for a request that asks for prompt "
            "logprobs (skip_reading_prefix_cache); in rollout mode it takes --no-prompt-logprobs"
        )
        if v and mode == "prompt"
        else None
    ),
    "skip_reading_prefix_cache": lambda v, mode: (
        ("reading the prefix cache with prompt logprobs crashes vLLM 0.32 (KeyError in the scheduler)")
        if v is False
        else None
    ),
    "logprobs_mode": lambda v, mode: (
        f"{v} are logits, not logprobs; the other engine computes logprobs"
        if v in ("raw_logits", "processed_logits")
        else "processed_logprobs apply to sampled tokens only (vLLM's prompt logprobs are always raw), so they "
        "need --mode rollout"
        if v == "processed_logprobs" and mode == "prompt"
        else None
    ),
    "pipeline_parallel_size": lambda v, mode: ONE_ENGINE if v not in (None, 1) else None,
    "data_parallel_size": lambda v, mode: ONE_ENGINE if v not in (None, 1) else None,
    "hf_overrides": lambda v, mode: (
        "set the lm_head dtype with --lm-head-dtype, for both engines"
        if isinstance(v, dict) and "head_dtype" in v
        else None
    ),
}

VLLM_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    # numeric EngineArgs settings vLLM would refuse only at engine start (its config's validation), after the other
    # engine has run: checked here first. Non-numbers are left to the type check.
    "max_model_len": (lambda v: v == -1 or v >= 1, "an integer >= 1, or -1 (fit to memory)"),
    "gpu_memory_utilization": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "kv_cache_memory_bytes": (lambda v: v >= 1, "a positive number of bytes"),
    "max_num_seqs": (lambda v: v >= 1, "1 or more"),
    "max_num_batched_tokens": (lambda v: v >= 1, "1 or more"),
}


def check_options(settings, mode: str, role: str) -> None:
    """Refuse an EngineArgs/SamplingParams setting that alignaudit sets itself, that has no effect on what is
    measured, or that makes the values something other than logprobs (the tables above). Strict processed
    logprobs are the plugin's (its "logprobs" op), under model runner V1 only: with VLLM_USE_V2_MODEL_RUNNER set
    they are refused. ``mode``: "prompt" or "rollout"; ``role``: "train" or "infer".

    Raises:
        InputError: the setting, the reason and the fix.
    """
    flag = f"--{role}-opt"
    for key, value in settings.options.items():
        if key in VLLM_SET_BY_ALIGNAUDIT:
            raise InputError(
                f"vllm {key} is set by alignaudit; use {VLLM_SET_BY_ALIGNAUDIT[key]} instead of {flag} {key}"
            )
        reason = VLLM_REFUSED.get(key, lambda v, m: None)(value, mode)
        if key == "logprobs_mode" and value == "processed_logprobs" and role == "train":
            reason = "the training side scores teacher-forced tokens, whose logprobs vLLM always computes raw"
        if reason:
            raise InputError(f"vllm {key}={json.dumps(value)}: {reason}; drop {flag} {key}")
        fits, expected = VLLM_RANGES.get(key, (None, ""))
        if fits is not None and _is_number(value) and not fits(value):
            raise InputError(f"vllm {key}={json.dumps(value)}: expected {expected}; fix {flag} {key}")
    processed = str(settings.options.get("logprobs_mode")).startswith("processed")
    if runner_v2_asked() and "logprobs" in settings.strict_ops and processed:
        raise InputError(
            "vllm logprobs_mode=processed_logprobs with VLLM_USE_V2_MODEL_RUNNER set: model runner V2 "
            "applies temperature, top-k and top-p in its own sampling kernels, which strict logprobs do "
            "not replace; unset VLLM_USE_V2_MODEL_RUNNER (alignaudit then runs model runner V1)"
        )
    _check_quantization(settings, flag)
    _check_graph_settings(settings, flag)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN too: no range holds it


ENGINE_GRAPH_SETTINGS = ("max_cudagraph_capture_size", "cudagraph_capture_sizes")  # EngineArgs fields
COMPILATION_GRAPH_SETTINGS = (*ENGINE_GRAPH_SETTINGS, "cudagraph_mode")  # the same, and the mode, in compilation_config


def _asks_for_graphs(key: str, value) -> bool:
    """Whether a CUDA-graph setting asks for graphs: not cudagraph_mode NONE, an empty size list or size 0."""
    if key == "cudagraph_mode":
        return str(value).upper() not in ("NONE", "0")
    return bool(value)


def _check_graph_settings(settings, flag: str) -> None:
    """CUDA-graph settings (EngineArgs' ``max_cudagraph_capture_size`` and ``cudagraph_capture_sizes``, or those and
    ``cudagraph_mode`` inside ``compilation_config``) take effect only where vLLM captures graphs: not on the CPU
    (vLLM 0.32's CPU platform resolves ``cudagraph_mode`` to NONE and captures no sizes, read back on the fixture)
    and not with ``enforce_eager``. A value asking for no graph (NONE, [], 0) is accepted there; on CUDA with graphs
    on, a ``max_cudagraph_capture_size`` below 1 is refused (vLLM asserts >= 1 at engine start). Elsewhere the
    settings are read back into engine_settings.resolved (cudagraph_mode, cudagraph_capture_sizes), which also shows
    combinations vLLM itself resolves to fewer graphs (vllm/config/vllm.py).

    Raises:
        InputError: naming the setting, the reason and the fix.
    """
    compilation = settings.options.get("compilation_config")
    size = settings.options.get("max_cudagraph_capture_size")
    mode = compilation.get("cudagraph_mode") if isinstance(compilation, dict) else None
    graphs_off = bool(settings.options.get("enforce_eager")) or (
        mode is not None and not _asks_for_graphs("cudagraph_mode", mode)
    )
    if settings.device != "cpu" and _is_number(size) and not size >= 1 and not graphs_off:
        raise InputError(
            f"vllm max_cudagraph_capture_size={json.dumps(size)}: vLLM asserts it is >= 1 while it "
            f"captures CUDA graphs (vllm/config/vllm.py); for no graphs pass {flag} enforce_eager=true "
            f'or compilation_config {{"cudagraph_mode": "NONE"}}'
        )
    given = [
        (key, f"drop {flag} {key}") for key in ENGINE_GRAPH_SETTINGS if _asks_for_graphs(key, settings.options.get(key))
    ]
    if isinstance(compilation, dict):
        given += [
            (f"compilation_config.{key}", f"remove {key} from {flag} compilation_config")
            for key in COMPILATION_GRAPH_SETTINGS
            if _asks_for_graphs(key, compilation.get(key))
        ]
    if not given:
        return
    name, fix = given[0]
    if settings.device == "cpu":
        raise InputError(
            f"vllm {name}: vLLM on the CPU captures no CUDA graphs (cudagraph_mode resolves to NONE), "
            f"so it would have no effect; run it with --device cuda or {fix}"
        )
    if settings.options.get("enforce_eager"):
        raise InputError(
            f"vllm {name} with enforce_eager: an eager engine captures no CUDA graphs; {fix} or enforce_eager"
        )


def _check_quantization(settings, flag: str) -> None:
    """FP8 rollouts (``quantization=fp8``, ``kv_cache_dtype=fp8*``) run on CUDA only and never under the strict op
    that would not cover them: a strict linear replaces ``UnquantizedLinearMethod.apply`` only (a quantized layer
    keeps vLLM's kernel), and strict attention reads bf16/fp16 KV caches only (engines/vllm/attention_cuda.py).

    Raises:
        InputError: naming the setting, the reason and the fix.
    """
    quantization = settings.options.get("quantization")
    kv_cache_dtype = str(settings.options.get("kv_cache_dtype", "auto"))
    fp8_kv = kv_cache_dtype.startswith("fp8")
    if settings.device == "cpu" and (fp8_kv or (quantization and "fp8" in str(quantization))):
        key = "kv_cache_dtype" if fp8_kv else "quantization"
        raise InputError(
            f"vllm {key}={json.dumps(settings.options[key])}: vLLM's CPU wheel has no fp8 kernels "
            f"(its _C::static_scaled_fp8_quant takes no arguments there); run it with --device cuda "
            f"or drop {flag} {key}"
        )
    if quantization is not None and "linear" in settings.strict_ops:
        raise InputError(
            f"vllm quantization={json.dumps(quantization)}: strict linear replaces vLLM's unquantized "
            f"linear method only, so the quantized layers would stay vLLM's; drop linear from --strict "
            f"or {flag} quantization"
        )
    if kv_cache_dtype not in ("auto", "bfloat16", "float16") and "attention" in settings.strict_ops:
        raise InputError(
            f"vllm kv_cache_dtype={json.dumps(kv_cache_dtype)}: strict attention reads bf16/fp16 KV "
            f"caches only; drop attention from --strict or {flag} kv_cache_dtype"
        )


# SamplingParams settings that change the distribution vLLM samples from before its processed logprobs, and their
# neutral values: the trainer's replay (alignaudit.engines.sampling) is temperature, top-k and top-p only, so under
# logprobs_mode=processed_logprobs the two sides would score different distributions at every token.
NOT_REPLAYED: dict[str, tuple] = {
    "min_p": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "structured_outputs": (None,),
    "logits_processors": (None, []),
}


def check_vllm_sampling(options: dict, engine_fields: set[str], mode: str, role: str) -> None:
    """SamplingParams settings only act on sampled tokens: refused in prompt mode and on the training side; under
    processed logprobs, a setting the trainer's replay does not apply (NOT_REPLAYED) is refused too. Runs in the
    option-check worker, which imports vLLM's EngineArgs to tell the two kinds apart.

    Raises:
        InputError: naming the setting.
    """
    flag = f"--{role}-opt"
    processed = options.get("logprobs_mode") == "processed_logprobs"
    for key, value in options.items():
        if key not in engine_fields and (mode == "prompt" or role == "train"):
            raise InputError(
                f"vllm {key} is a sampling setting and has no effect on teacher-forced (prompt) logprobs; "
                f"drop {flag} {key}"
            )
        if processed and key in NOT_REPLAYED and value not in NOT_REPLAYED[key]:
            raise InputError(
                f"vllm {key}={json.dumps(value, default=str)} with logprobs_mode=processed_logprobs: vLLM "
                "applies it before its processed logprobs, and the trainer replays temperature, top-k "
                f"and top-p only, so the two would score different distributions; drop {flag} {key}, or "
                "compare raw logprobs"
            )


def check_sampling_params(sampling_params_cls, options: dict, engine_fields: set[str], role: str) -> None:
    """vLLM's own checks of the SamplingParams settings in ``options`` (SamplingParams.__post_init__: ranges such as
    presence_penalty in [-2, 2], top_p in (0, 1]), made before any engine starts rather than by vLLM after the other
    engine has run.

    Raises:
        InputError: with vLLM's reason.
    """
    sampling = {k: v for k, v in options.items() if k not in engine_fields}
    if not sampling:
        return
    try:
        sampling_params_cls(**sampling)
    except Exception as e:  # noqa: BLE001 - vLLM 0.32 raises VLLMValidationError (not a ValueError), others ValueError
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"vllm refuses --{role}-opt {', '.join(sorted(sampling))}: {reason}") from None
