"""Hugging Face transformers: the adapter, where each canonical op lives in it, and its strict module swap."""

from __future__ import annotations

from alignaudit.engines.kind import EngineKind


class HFKind(EngineKind):
    """transformers' eager model on one process: trains (rl) and samples rollouts (model.generate)."""

    name = "hf"
    display = "Hugging Face transformers"
    adapter = "alignaudit.engines.hf.adapter:HFEngine"
    gives_vocab_rows = True
    requires = "transformers"
    install = "pip install alignaudit"
    trains = True
    rolls_out = True


    def replays_routing(self, settings) -> bool:
        """Its default MoE router (Qwen3MoeTopKRouter) replays; the strict MoE layer (--strict with linear)
        routes by its own kernel (alignaudit_kernels.route) and does not."""
        return "linear" not in settings.strict_ops


KIND = HFKind()
