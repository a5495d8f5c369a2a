"""Megatron-Core: the adapter, its taps, the HF <-> Megatron weight map, its options and refusals, and the strict
layer spec.
"""

from __future__ import annotations

from alignaudit.engines.kind import EngineKind


class MegatronKind(EngineKind):
    """Megatron-Core's GPTModel (local layer spec); tensor-parallel ranks are processes alignaudit starts."""

    name = "megatron"
    display = "Megatron-Core"
    adapter = "alignaudit.engines.megatron.adapter:MegatronEngine"
    gives_vocab_rows = True
    requires = "megatron.core"
    install = "pip install 'alignaudit[megatron]'"
    tp_option = "tensor_model_parallel_size"
    trains = True
    spawns_ranks = True
    offloads_optimizer = True

    def check_tensor_parallel(self, spec, tp: int) -> None:
        """Megatron also splits the query groups and the vocabulary (it does not pad or replicate them)."""
        super().check_tensor_parallel(spec, tp)
        self._must_divide(spec, tp, [("query groups", spec.num_query_groups), ("vocabulary", spec.vocab_size)])

    def check_settings(self, settings, mode: str, role: str) -> None:
        from alignaudit.engines.megatron.options import check_options

        check_options(settings, f"--{role}-opt")

    def replays_routing(self, settings) -> bool:
        """Its default MoE router (TopKRouter, through Megatron-Core's RouterReplay) replays; the strict MoE
        layer (--strict with linear) routes by its own kernel (alignaudit_kernels.route) and does not."""
        return "linear" not in settings.strict_ops


KIND = MegatronKind()
