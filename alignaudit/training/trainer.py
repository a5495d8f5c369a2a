"""The training side of the RL loop, inside its worker: score, update, export.

A ``Trainer`` wraps a batch-major Engine (megatron or hf) that has built the model from the checkpoint, and
adds what a trainer does between rollouts:
    score        old_logprobs of the rollout's tokens: the engine's own logprob function, eval mode, no
                 gradient (the function an RL trainer uses, the one ``compare`` measures)
    train_step   the same forward with gradient, the clipped GRPO loss over generated tokens, one optimizer
                 step (alignaudit.training.optim); micro-batches accumulate gradients, the loss is normalized by
                 the batch's generated-token count
    weights      the model's weights in HF names and dtype (engines/vllm/weights.py), for the rollout engine
The engine makes itself trainable (``Engine.training``: Megatron inside megatron.core's DistributedDataParallel
with megatron.core's optimizer on CUDA, alignaudit.engines.megatron.training; otherwise alignaudit's
MixedPrecisionAdam, alignaudit.training.optim).
"""

from __future__ import annotations

import time

import torch

from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import Replay
from alignaudit.training.losses import clipped_policy_loss, kl_k3


class Trainer:
    """One training engine with its optimizer.

    Args:
        engine: a built MegatronEngine or HFEngine. lr: Adam learning rate. clip_grad: max grad norm.
        offload_fraction: of the optimizer state, the fraction megatron.core keeps and updates in host memory
            (alignaudit.rl.memory; CUDA Megatron only, 0 elsewhere).
        kl_coef: weight of the k3 KL term against the reference policy (the weights at the start; losses.kl_k3);
            > 0 keeps one copy of the starting weights on the model's device. 0: no reference, no KL term.
    Raises:
        ValueError: offload_fraction > 0 for a trainer that is not Megatron on CUDA (the engine's training()).
    """

    def __init__(self, engine, lr: float, clip_grad: float, offload_fraction: float = 0.0, kl_coef: float = 0.0):
        from alignaudit.training.optim import MixedPrecisionAdam

        self.engine = engine
        self.kl_coef = kl_coef
        self.reference = [p.detach().clone() for p in engine.model.parameters()] if kl_coef > 0 else None
        self.training = engine.training(lr, clip_grad, offload_fraction, MixedPrecisionAdam)
        self.optimizer_name = self.training.name

    def score(self, batch: TokenBatch, replay: Replay | None) -> list[torch.Tensor]:
        """fp32 logprobs [len - 1] per sequence, in eval mode without gradient."""
        self.engine.replay = replay
        self.engine.model.eval()
        return self.engine.prompt_logprobs(batch)

    def train_step(
        self,
        batch: TokenBatch,
        prompt_lengths: list[int],
        advantages: list[float],
        rollout_logprobs: list[list[float]],
        clip_eps: float,
        replay: Replay | None,
    ) -> dict:
        """One GRPO update on the generated tokens of ``batch``.

        Args:
            rollout_logprobs: per sequence, the rollout engine's logprobs of its generated tokens.
            advantages: per sequence. prompt_lengths: per sequence.
        Returns:
            {"loss", "grad_norm", "clip_fraction", "forward_logprobs", "kl_ref", "optimizer_s"}: the loss summed
            over micro-batches (the KL term included), the global grad norm before clipping, the training
            forward's logprobs of the generated tokens (which must equal ``score``'s bit for bit: the same
            function, with gradient), the mean k3 KL to the reference policy (None without one), and the
            seconds of the optimizer step (grad-norm clipping, Adam, the weights written back; host offload
            included).
        """
        from alignaudit.engines.base import micro_batches

        engine = self.engine
        reference = (
            self._reference_logprobs(self.reference, batch, prompt_lengths, replay)
            if self.reference is not None
            else None
        )
        engine.replay = replay
        engine.model.train()
        self.training.zero_grad()
        total = sum(len(s) - p for s, p in zip(batch.sequences, prompt_lengths, strict=True))
        loss_sum, taken, kl_sum, forward = 0.0, 0.0, 0.0, [None] * len(batch.sequences)
        for rows in micro_batches(batch, engine.micro_batch_size):
            seqs = [batch.sequences[r] for r in rows]
            lps = engine.micro_batch_logprobs(rows, seqs)
            new = torch.cat([lp[prompt_lengths[r] - 1 :] for r, lp in zip(rows, lps, strict=True)])
            old = torch.tensor([x for r in rows for x in rollout_logprobs[r]], dtype=torch.float32, device=new.device)
            adv = torch.tensor(
                [advantages[r] for r in rows for _ in rollout_logprobs[r]], dtype=torch.float32, device=new.device
            )
            loss, stats = clipped_policy_loss(new, old, adv, clip_eps)
            if reference is not None:
                kl = kl_k3(new, torch.cat([reference[r] for r in rows]).to(new.device))
                loss = loss + self.kl_coef * kl.mean()
                kl_sum += float(kl.sum())
            (loss * (len(new) / total)).backward()
            loss_sum += float(loss) * len(new) / total
            taken += stats["clip_fraction"] * len(new) / total
            for r, lp in zip(rows, lps, strict=True):
                forward[r] = lp[prompt_lengths[r] - 1 :].detach().cpu().tolist()
        self.training.finalize_grads()
        on_cuda = engine.settings.device == "cuda"
        if on_cuda:
            torch.cuda.synchronize()  # the backward's kernels done, and below the optimizer's: its seconds alone
        stepped = time.perf_counter()
        grad_norm = self.training.step()
        if on_cuda:
            torch.cuda.synchronize()
        optimizer_s = time.perf_counter() - stepped
        engine.model.eval()
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "clip_fraction": taken,
            "forward_logprobs": forward,
            "kl_ref": kl_sum / total if reference is not None else None,
            "optimizer_s": round(optimizer_s, 3),
        }

    @torch.no_grad()
    def _reference_logprobs(
        self, reference: list[torch.Tensor], batch: TokenBatch, prompt_lengths: list[int], replay: Replay | None
    ) -> list:
        """The reference policy's fp32 logprobs of each sequence's generated tokens: the starting weights
        (``reference``) swapped into the model one parameter at a time (exact copies, so the model's own weights
        come back bit for bit), the engine's eval-mode logprob function, the weights swapped back."""
        params = list(self.engine.model.parameters())
        _swap(params, reference)
        try:
            lps = self.score(batch, replay)
        finally:
            _swap(params, reference)
        return [lp[p - 1 :] for lp, p in zip(lps, prompt_lengths, strict=True)]

    def weights(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The model's weights in HF names (bf16 or the model dtype) on the model's device, views of the
        parameters where the layout allows (alignaudit.engines.megatron.weights.megatron_to_hf), and the replicated
        parameters whose tensor-parallel copies differ (a state bug; [] at size 1 and for HF). Collective at size > 1.
        """
        diverged: list[str] = []
        weights = self.engine.hf_weights(diverged)
        return {k: v.detach() for k, v in weights.items()}, diverged


def _swap(params: list, reference: list[torch.Tensor]) -> None:
    """Exchange each parameter's values with its reference copy, in place."""
    for param, ref in zip(params, reference, strict=True):
        held = param.detach().clone()
        param.data.copy_(ref)
        ref.copy_(held)
