"""The trainer's optimizer: Adam on fp32 main parameters for bf16/fp16 model parameters, as megatron-lm trains.

On CUDA a Megatron trainer uses ``megatron.core.optimizer.get_megatron_optimizer`` itself
(alignaudit.engines.megatron.training), which cannot run on a CPU. ``MixedPrecisionAdam`` is the
same algorithm for the CPU and for the HF trainer, step for step (not bit for bit: torch.optim.Adam's update
rounds differently from the fused Adam megatron.core runs on the GPU):
    1. main grads = the model params' fp32 gradients (Megatron DDP's ``main_grad`` buffers where present,
       else ``param.grad`` upcast);
    2. global L2 norm of all main grads; where clip_grad / (norm + 1e-6) < 1, every main grad is scaled by
       that factor (megatron/core/optimizer/clip_grads.py, clip_grad_by_total_norm_fp32);
    3. torch.optim.Adam on the fp32 main params (bias-corrected, betas (0.9, 0.999), eps 1e-8);
    4. each model param = its main param rounded to the model dtype.
With lr 0 step 3 changes nothing and step 4 writes back the same bits: the weights stay exactly as they were.
At tensor-parallel size > 1 each rank updates its own shards; the norm of step 2 covers every rank's.
"""

from __future__ import annotations

import torch


class MixedPrecisionAdam:
    """Adam over fp32 copies of ``params`` (see the module docstring).

    Args:
        params: the model's trainable parameters (bf16, fp16 or fp32).
        lr: learning rate (>= 0). clip_grad: max global grad norm (<= 0: no clipping).
    """

    name = "alignaudit.training.optim.MixedPrecisionAdam"

    def __init__(
        self,
        params,
        lr: float,
        clip_grad: float = 1.0,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        tp_group=None,
    ):
        self.params = [p for p in params if p.requires_grad]
        self.tp_group = tp_group  # tensor parallelism: the grad norm is over every rank's shards
        self.main = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.clip_grad = clip_grad
        self.adam = torch.optim.Adam(self.main, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()

    @torch.no_grad()
    def step(self) -> float:
        """One update; returns the global grad norm before clipping (fp32, as a Python float)."""
        for main, p in zip(self.main, self.params, strict=True):
            grad = getattr(p, "main_grad", None)
            grad = p.grad if grad is None else grad
            main.grad = torch.zeros_like(main) if grad is None else grad.float().clone()
        norm = self._global_norm()
        scale = self.clip_grad / (norm + 1e-6)
        if self.clip_grad > 0 and scale < 1.0:  # megatron/core/optimizer/clip_grads.py's condition
            for m in self.main:
                m.grad.mul_(scale)
        self.adam.step()
        for main, p in zip(self.main, self.params, strict=True):
            p.data.copy_(main.data)
        return float(norm)

    def _global_norm(self) -> torch.Tensor:
        """L2 norm of all main grads. At tensor-parallel size > 1 the squares of sharded parameters
        (Megatron's ``tensor_model_parallel`` attribute) are summed over every rank, replicated ones counted
        once (rank 0), as megatron/core/optimizer/clip_grads.py counts them."""
        if self.tp_group is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in self.main]))
        rank = torch.distributed.get_rank(self.tp_group)
        squares = torch.zeros((), dtype=torch.float32, device=self.main[0].device)
        for main, p in zip(self.main, self.params, strict=True):
            if getattr(p, "tensor_model_parallel", False) or rank == 0:
                squares = squares + main.grad.square().sum()
        torch.distributed.all_reduce(squares, group=self.tp_group)
        return squares.sqrt()
