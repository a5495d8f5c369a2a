"""The training side of the RL loop, inside its worker: score, update, export.

A ``Trainer`` wraps a batch-major Engine (megatron or hf) that has built the model from the checkpoint, and
adds what a trainer does between rollouts:
    score        old_logprobs of the rollout's tokens: the engine's own logprob function, eval mode, no
                 gradient (the function an RL trainer uses, the one ``compare`` measures)
    train_step   the same forward with gradient, the clipped GRPO loss over generated tokens, one optimizer
                 step (alignaudit.rl.optim); micro-batches accumulate gradients, the loss is normalized by
                 the batch's generated-token count
    export       the model's weights in HF names and dtype (engines/weight_sync.py), for the rollout engine
Megatron runs inside megatron.core's DistributedDataParallel (fp32 gradient buffers, as megatron-lm); its
optimizer is megatron.core's own on CUDA and alignaudit's identical MixedPrecisionAdam on CPU.
"""

from __future__ import annotations

import torch

from alignaudit.prompts import TokenBatch
from alignaudit.rl.grpo import clipped_policy_loss


class Trainer:
    """One training engine with its optimizer.

    Args:
        engine: a built MegatronEngine or HFEngine. lr: Adam learning rate. clip_grad: max grad norm.
    """

    def __init__(self, engine, lr: float, clip_grad: float):
        self.engine = engine
        self.ddp = None
        if engine.name == "megatron":
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

            self.ddp = DistributedDataParallel(engine.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                               module=engine.model)
            params = list(self.ddp.parameters())
            if engine.settings.device == "cuda":
                from alignaudit.rl.optim import megatron_cuda_optimizer

                self.optimizer = megatron_cuda_optimizer(self.ddp, engine.config, lr, clip_grad)
                self.optimizer_name = ("megatron.core.optimizer.get_megatron_optimizer "
                                       "(Float16OptimizerWithFloat16Params)")
            else:
                from megatron.core import parallel_state

                group = parallel_state.get_tensor_model_parallel_group() if engine.tp_size > 1 else None
                self.optimizer = self._mixed_precision(params, lr, clip_grad, group)
        else:
            self.optimizer = self._mixed_precision(list(engine.model.parameters()), lr, clip_grad)

    def _mixed_precision(self, params, lr, clip_grad, tp_group=None):
        from alignaudit.rl.optim import MixedPrecisionAdam

        self.optimizer_name = MixedPrecisionAdam.name
        return MixedPrecisionAdam(params, lr, clip_grad, tp_group=tp_group)

    def score(self, batch: TokenBatch, replay: dict | None) -> list[torch.Tensor]:
        """fp32 logprobs [len - 1] per sequence, in eval mode without gradient."""
        self.engine.replay = replay
        self.engine.model.eval()
        return self.engine.prompt_logprobs(batch)

    def train_step(self, batch: TokenBatch, prompt_lengths: list[int], advantages: list[float],
                   rollout_logprobs: list[list[float]], clip_eps: float, replay: dict | None) -> dict:
        """One GRPO update on the generated tokens of ``batch``.

        Args:
            rollout_logprobs: per sequence, the rollout engine's logprobs of its generated tokens.
            advantages: per sequence. prompt_lengths: per sequence.
        Returns:
            {"loss", "grad_norm", "clip_fraction", "forward_logprobs"}: the loss summed over micro-batches,
            the global grad norm before clipping, and the training forward's logprobs of the generated tokens
            (which must equal ``score``'s bit for bit: the same function, with gradient).
        """
        from alignaudit.engines.base import micro_batches

        engine = self.engine
        engine.replay = replay
        engine.model.train()
        self.optimizer.zero_grad()
        if self.ddp is not None:
            self.ddp.zero_grad_buffer()
        total = sum(len(s) - p for s, p in zip(batch.sequences, prompt_lengths))
        loss_sum, taken, forward = 0.0, 0.0, [None] * len(batch.sequences)
        for rows in micro_batches(batch, engine.micro_batch_size):
            seqs = [batch.sequences[r] for r in rows]
            lps = engine.micro_batch_logprobs(rows, seqs)
            new = torch.cat([lp[prompt_lengths[r] - 1:] for r, lp in zip(rows, lps)])
            old = torch.tensor([x for r in rows for x in rollout_logprobs[r]], dtype=torch.float32, device=new.device)
            adv = torch.tensor([advantages[r] for r in rows for _ in rollout_logprobs[r]], dtype=torch.float32,
                               device=new.device)
            loss, stats = clipped_policy_loss(new, old, adv, clip_eps)
            (loss * (len(new) / total)).backward()
            loss_sum += float(loss) * len(new) / total
            taken += stats["clip_fraction"] * len(new) / total
            for r, lp in zip(rows, lps):
                forward[r] = lp[prompt_lengths[r] - 1:].detach().cpu().tolist()
        if self.ddp is not None:
            # megatron-lm's own step: data-parallel grad sync, and the tensor-parallel all-reduce of the
            # q/k layernorm grads (each rank holds the grad of its own heads only)
            from megatron.core.distributed.finalize_model_grads import finalize_model_grads

            finalize_model_grads([self.ddp])
        grad_norm = self._step()
        engine.model.eval()
        return {"loss": loss_sum, "grad_norm": grad_norm, "clip_fraction": taken, "forward_logprobs": forward}

    def _step(self) -> float:
        result = self.optimizer.step()
        if isinstance(result, tuple):  # megatron.core: (update_successful, grad_norm, num_zeros)
            return float(result[1])
        return float(result)

    def export(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The model's weights in HF names (bf16 or the model dtype), on the CPU, and the replicated
        parameters whose tensor-parallel copies differ (a state bug; [] at size 1 and for HF)."""
        diverged: list[str] = []
        weights = self.engine.hf_weights(diverged) if self.engine.name == "megatron" else self.engine.hf_weights()
        return {k: v.detach().cpu().contiguous() for k, v in weights.items()}, diverged
