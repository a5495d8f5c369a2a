"""Methods vLLM mixes into its workers (``EngineArgs.worker_extension_cls``), so that alignaudit can ask an engine
whose model runs in another process (vLLM's ``AsyncLLM``: the engine core and its worker are processes of their
own) what it computes with, by name through ``collective_rpc``: no function is pickled across processes, so
vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION stays off. RL frameworks reach their rollout workers the same way
(verl's and TRL's vLLM worker extensions).
"""

from __future__ import annotations

from alignaudit.engines.vllm import plugin

# vLLM loads general plugins from installed entry points only, so in a process of vLLM's own (AsyncLLM's engine
# core) run from a source checkout the strict ops would be missing: found on the H200, where the read-back check
# caught FlashAttentionImpl under --strict. vLLM imports this module there (WorkerWrapperBase.init_worker) before it
# builds the model, so the ops of ALIGNAUDIT_STRICT are registered here too (idempotent; nothing without it).
plugin.register()

EXTENSION = "alignaudit.engines.vllm.worker_extension.KernelReadback"


class KernelReadback:
    """Mixed into vLLM's worker class: ``self`` is the worker (vllm/v1/worker/worker_base.py, ``get_model``)."""

    def alignaudit_kernels(self) -> dict:
        """weights.kernels_of the loaded model, read back in the worker."""
        from alignaudit.engines.vllm.weights import kernels_of

        return kernels_of(self.get_model())
