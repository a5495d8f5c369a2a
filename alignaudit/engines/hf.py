"""Hugging Face transformers engine: the reference layout, and the path FSDP-style trainers use.

Logprobs: ``log_softmax(logits.float(), -1)`` gathered at the next token, the formula of TRL's
``selective_log_softmax`` for float32 logits. Logits come out of the model in its dtype.

Options (``--train-opt`` / ``--infer-opt``):
    attn_implementation  "eager" (default), "sdpa", "flex_attention", ...
    micro_batch_size     sequences per forward pass, right-padded (default 1)
"""

from __future__ import annotations

import torch

from alignaudit.engines.base import Engine, EngineSettings, micro_batches, reject_unknown, right_padded
from alignaudit.models import ModelSpec
from alignaudit.prompts import TokenBatch


class HFEngine(Engine):
    name = "hf"

    def __init__(self, spec: ModelSpec, settings: EngineSettings):
        super().__init__(spec, settings)
        from transformers import AutoModelForCausalLM

        options = dict(settings.options)
        reject_unknown("hf", options, {"attn_implementation", "micro_batch_size"},
                       "hf accepts attn_implementation and micro_batch_size")
        self.attn_implementation = options.get("attn_implementation", "eager")
        self.micro_batch_size = int(options.get("micro_batch_size", 1))
        self.model = AutoModelForCausalLM.from_pretrained(
            spec.path, dtype=settings.torch_dtype, attn_implementation=self.attn_implementation
        ).to(settings.device)
        self.model.eval()

    @torch.no_grad()
    def prompt_logprobs(self, batch: TokenBatch) -> list[torch.Tensor]:
        results: list[torch.Tensor] = []
        for rows in micro_batches(batch, self.micro_batch_size):
            seqs = [batch.sequences[r] for r in rows]
            ids, valid = right_padded(seqs)
            ids, valid = ids.to(self.settings.device), valid.to(self.settings.device)
            self.set_spans(rows, [len(s) for s in seqs])
            logits = self.model(input_ids=ids, attention_mask=valid.long()).logits
            lp = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            results.extend(lp[j, : len(s) - 1].cpu() for j, s in enumerate(seqs))
        return results

    def install_taps(self, tap):
        from alignaudit.engines import hf_taps

        return hf_taps.install(self.model, tap)

    def settings_record(self) -> dict:
        return {
            "attn_implementation": self.attn_implementation,
            "micro_batch_size": self.micro_batch_size,
            "dtype": str(self.model.dtype),
            "logprob_formula": "log_softmax(logits.float(), -1).gather(next_token)",
        }
