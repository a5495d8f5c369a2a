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

    def rollout_shape(self, settings, sampling):
        """As every engine's (EngineKind.rollout_shape), and micro_batch_size refused: a rollout generates and scores
        one sequence at a time (HFEngine.rollout), so it would have no effect. Raises InputError."""
        from alignaudit.errors import InputError

        if settings.options.get("micro_batch_size", 1) != 1:
            raise InputError(
                "hf micro_batch_size: an hf rollout generates and scores one sequence at a time, so it "
                "would have no effect; drop it from --infer-opt (it applies where hf scores)"
            )
        return super().rollout_shape(settings, sampling)

    def replays_routing(self, settings) -> bool:
        """Its default MoE router (Qwen3MoeTopKRouter) replays; the strict MoE layer (--strict with linear)
        routes by its own kernel (alignaudit_kernels.route) and does not."""
        return "linear" not in settings.strict_ops


KIND = HFKind()
