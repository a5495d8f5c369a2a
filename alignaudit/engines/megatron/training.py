"""Megatron-Core as a trainer, as megatron-lm trains: the model inside megatron.core's DistributedDataParallel
(fp32 gradient buffers), megatron.core's own mixed-precision Adam on CUDA (``get_megatron_optimizer``, optionally
with its optimizer CPU offload) and the caller's Adam on the CPU (megatron.core's optimizer allocates its
bookkeeping with ``device='cuda'`` and checks CUDA type names: megatron/core/optimizer/optimizer.py), and
megatron-lm's gradient finalization after the backward passes (``finalize_model_grads``: the data-parallel
reduction and the tensor-parallel all-reduce of the q/k layernorm grads, of which each rank holds its own heads').
The same algorithm on both devices, not the same bits (torch's Adam rounds its update differently from
megatron.core's fused one on the GPU).
"""

from __future__ import annotations


class MegatronTraining:
    """A built MegatronEngine's model wrapped for training (see the module docstring).

    Args:
        engine: the MegatronEngine. lr: Adam learning rate. clip_grad: max global grad norm.
        offload_fraction: of the optimizer state, the fraction megatron.core keeps and updates in host memory
            (alignaudit.rl.memory; CUDA only). adam: the optimizer class for the CPU (alignaudit.engines.training).
    Raises:
        ValueError: offload_fraction > 0 on the CPU.
    """

    def __init__(self, engine, lr: float, clip_grad: float, offload_fraction: float, adam):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        if offload_fraction and engine.settings.device != "cuda":
            raise ValueError(
                f"optimizer offload is megatron.core's (CUDA only); megatron on "
                f"{engine.settings.device} cannot offload {offload_fraction}"
            )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=offload_fraction > 0
        )
        self.ddp = DistributedDataParallel(engine.config, ddp_config, module=engine.model)
        if engine.settings.device == "cuda":
            self.optimizer = megatron_cuda_optimizer(self.ddp, engine.config, lr, clip_grad, offload_fraction)
            self.name = "megatron.core.optimizer.get_megatron_optimizer " + (
                f"(DistributedOptimizer, HybridDeviceOptimizer: {offload_fraction} of the state on the host)"
                if offload_fraction
                else "(Float16OptimizerWithFloat16Params)"
            )
        else:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group() if engine.tp_size > 1 else None
            self.optimizer = adam(list(self.ddp.parameters()), lr, clip_grad, tp_group=group)
            self.name = adam.name

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.ddp.zero_grad_buffer()

    def finalize_grads(self) -> None:
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads([self.ddp])

    def step(self) -> float:
        """One update; the global grad norm before clipping."""
        result = self.optimizer.step()
        if isinstance(result, tuple):  # megatron.core: (update_successful, grad_norm, num_zeros)
            return float(result[1])
        return float(result)


def megatron_cuda_optimizer(ddp_model, config, lr: float, clip_grad: float, offload_fraction: float = 0.0):
    """megatron.core's own mixed-precision Adam for a DDP-wrapped Megatron model (CUDA only).

    ``offload_fraction`` > 0: megatron.core's optimizer CPU offload (the distributed optimizer over a DDP
    built with use_distributed_optimizer, HybridDeviceOptimizer keeping that fraction of the fp32 main
    weights and Adam state on the host; the precision-aware path, so that the distributed optimizer keeps no
    second fp32 copy on the GPU: megatron/core/optimizer/__init__.py, optimizer_config.py). Weight decay is
    0, so its AdamW mode is Adam.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    offload = {}
    if offload_fraction:
        offload = {
            "use_distributed_optimizer": True,
            "optimizer_cpu_offload": True,
            "optimizer_offload_fraction": offload_fraction,
            "use_precision_aware_optimizer": True,
        }
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        clip_grad=clip_grad,
        **offload,
    )
    return get_megatron_optimizer(opt_config, [ddp_model])
