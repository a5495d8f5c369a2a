"""What an engine adds to become a trainer: gradients that are ready to step, and the optimizer that steps them.

``Engine.training(lr, clip_grad, offload_fraction, adam)`` returns one of these; the RL trainer
(alignaudit.training.trainer) calls ``zero_grad`` before a batch, ``finalize_grads`` after its backward passes and
``step`` once. ``adam`` is the caller's optimizer class for parameters the engine has no optimizer of its own for
(alignaudit.training.optim.MixedPrecisionAdam: ``adam(params, lr, clip_grad, tp_group=None)``, ``step()`` returning the
grad norm); engines may not import rl/, so it is passed in.
"""

from __future__ import annotations


class PlainTraining:
    """The engine's parameters under ``adam``; no gradient buffers of the engine's own (HF).

    Raises:
        ValueError: ``offload_fraction`` > 0 (no engine-side optimizer offload here).
    """

    def __init__(self, engine, lr: float, clip_grad: float, offload_fraction: float, adam):
        if offload_fraction:
            raise ValueError(
                f"optimizer offload is megatron.core's (CUDA only); {engine.name} on "
                f"{engine.settings.device} cannot offload {offload_fraction}"
            )
        self.optimizer = adam(list(engine.model.parameters()), lr, clip_grad)
        self.name = adam.name

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def finalize_grads(self) -> None:
        """Nothing to reduce: one process holds every gradient."""

    def step(self) -> float:
        """One update; the global grad norm before clipping."""
        return float(self.optimizer.step())
