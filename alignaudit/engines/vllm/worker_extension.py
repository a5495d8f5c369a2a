"""Methods vLLM mixes into its workers (``EngineArgs.worker_extension_cls``), so that alignaudit can reach an engine
whose model runs in another process (vLLM's ``AsyncLLM``: the engine core and its worker are processes of their
own), by name through ``collective_rpc``: no function is pickled across processes, so vLLM's
VLLM_ALLOW_INSECURE_SERIALIZATION stays off. RL frameworks reach their rollout workers the same way (verl's and
TRL's vLLM worker extensions): what the model computes with, and the weight sync of ``alignaudit rl``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from alignaudit.engines.vllm import plugin

if TYPE_CHECKING:
    import torch

# vLLM loads general plugins from installed entry points only, so in a process of vLLM's own (AsyncLLM's engine
# core) run from a source checkout the strict ops would be missing: found on the H200, where the read-back check
# caught FlashAttentionImpl under --strict. vLLM imports this module there (WorkerWrapperBase.init_worker) before it
# builds the model, so the ops of ALIGNAUDIT_STRICT are registered here too (idempotent; nothing without it).
plugin.register()

EXTENSION = "alignaudit.engines.vllm.worker_extension.KernelReadback"
# Set by VLLMEngine.prepare_for_weight_updates in the process that starts the engine, inherited by vLLM's engine
# process: the CPU linear layers there must keep their weights too, or a later load has nowhere to write.
KEEP_WEIGHTS_ENV = "ALIGNAUDIT_KEEP_VLLM_WEIGHTS"
if os.environ.get(KEEP_WEIGHTS_ENV) == "1":
    from alignaudit.engines.vllm.weights import keep_vllm_cpu_weights

    keep_vllm_cpu_weights()


class KernelReadback:
    """Mixed into vLLM's worker class: ``self`` is the worker (vllm/v1/worker/worker_base.py: ``get_model``,
    ``vllm_config``)."""

    if TYPE_CHECKING:  # the worker's own, declared for the type checker only (a definition here would shadow them)
        vllm_config: Any

        def get_model(self) -> torch.nn.Module: ...

    def alignaudit_kernels(self) -> dict:
        """weights.kernels_of the loaded model, read back in the worker."""
        from alignaudit.engines.vllm.weights import kernels_of

        return kernels_of(self.get_model())

    def alignaudit_sync_weights(self, transport: str, path: str | None, handles: str | None, spec: dict) -> dict:
        """rl's weight sync in the worker that holds the model: weight_transfer.load_and_check's reply (``spec``: the
        checkpoint's ModelSpec.to_dict(), for the HF names)."""
        from alignaudit.engines.vllm.weights import load_into_model, stale_packed_layers, vllm_to_hf
        from alignaudit.engines.weight_transfer import load_and_check
        from alignaudit.inputs.checkpoint import ModelSpec

        model, model_spec = self.get_model(), ModelSpec(**spec)
        return load_and_check(
            lambda: vllm_to_hf(model, model_spec),
            lambda tensors: load_into_model(model, self.vllm_config, tensors),
            lambda: stale_packed_layers(model),
            transport,
            path,
            handles,
        )

    def alignaudit_checksums(self, spec: dict) -> dict:
        """sha256 of every weight the worker's model holds, in HF names."""
        from alignaudit.engines.vllm.weights import vllm_to_hf
        from alignaudit.engines.weight_transfer import checksums
        from alignaudit.inputs.checkpoint import ModelSpec

        return checksums(vllm_to_hf(self.get_model(), ModelSpec(**spec)))
