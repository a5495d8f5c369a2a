"""Hugging Face transformers engine: the reference layout, and the path FSDP-style trainers use.

Logprobs: ``log_softmax(logits.float(), -1)`` gathered at the next token, the formula of TRL's
``selective_log_softmax`` for float32 logits. Logits come out of the model in its dtype.

Options (``--train-opt`` / ``--infer-opt``):
    attn_implementation  "eager" (default), "sdpa", "flex_attention", ...
    micro_batch_size     sequences per forward pass, right-padded (default 1)
"""

from __future__ import annotations

from typing import Any, cast

import torch

from alignaudit.engines.base import (
    Engine,
    applied_exp,
    applied_kernel,
    first_lines,
    fp32_head,
    micro_batch_option,
    reject_unknown,
    reject_wrong_types,
    require_flash,
    right_padded,
)
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import EngineSettings

ROUTING_REPLAYED = {
    "mechanism": "alignaudit.engines.routing_replay.replayed_router_forward",
    "weights": "softmax(router logits, fp32) at the replayed experts, renormalized when norm_topk_prob",
}


class HFEngine(Engine):
    name = "hf"

    @classmethod
    def check_options(cls, options):
        reject_unknown(
            "hf",
            options,
            {"attn_implementation", "micro_batch_size"},
            "hf accepts attn_implementation and micro_batch_size",
        )
        reject_wrong_types("hf", options, {"attn_implementation": str})
        micro_batch_option(options)

    def __init__(self, spec: ModelSpec, settings: EngineSettings):
        super().__init__(spec, settings)
        from transformers import AutoModelForCausalLM

        options = dict(settings.options)
        self.attn_implementation = str(options.get("attn_implementation", "eager"))
        self.micro_batch_size = micro_batch_option(options)
        try:
            # output_loading_info=True: (model, info), which transformers' annotation (the model) does not say; the
            # model stays Any, as before: its submodules (lm_head, model.layers) are read by attribute
            model, info = cast(
                "tuple[Any, dict]",
                AutoModelForCausalLM.from_pretrained(
                    spec.path,
                    dtype=settings.torch_dtype,
                    attn_implementation=self.attn_implementation,
                    device_map=settings.device if settings.device == "cuda" else None,
                    output_loading_info=True,
                ),
            )
            self.model = model.to(settings.device)
        except (ImportError, ValueError) as e:
            raise InputError(
                f"transformers cannot load {spec.name} with attn_implementation="
                f"{self.attn_implementation}: {first_lines(e)}"
            ) from e
        self.loading = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(self.loading.values()):
            raise InputError(f"transformers did not load {spec.name} completely: {self.loading}")
        self.model.eval()
        self.strict_modules: list[str] = []
        if settings.strict_ops:
            from alignaudit.engines.hf.strict import make_strict

            require_flash(settings, spec)
            self.strict_modules = make_strict(
                self.model, settings.strict_ops, spec.rope_llama3, settings.strict_exp, settings.strict_attention
            )
        if settings.lm_head_dtype == "fp32":
            head, strict = self.model.lm_head, "linear" in settings.strict_ops
            head.forward = lambda x: fp32_head(x, head.weight, head.bias, strict)

    @torch.no_grad()
    def prompt_logprobs(self, batch: TokenBatch) -> list[torch.Tensor]:
        return self.batched_logprobs(batch)

    def micro_batch_logprobs(self, rows: list[int], seqs: list[tuple[int, ...]]) -> list[torch.Tensor]:
        ids, valid = right_padded(seqs)
        ids, valid = ids.to(self.settings.device), valid.to(self.settings.device)
        self.set_spans(rows, [len(s) for s in seqs])
        if self.routing_replay is not None:
            from alignaudit.engines.routing_replay import batch_routing

            for layer, target in enumerate(self._replay_targets):  # the gate flattens [batch, tokens]
                target["ids"] = batch_routing(self.routing_replay[layer], rows, ids.shape[1], seq_first=False)
        logits = self.model(input_ids=ids, attention_mask=valid.long()).logits
        lp = self.token_logprobs(logits[:, :-1], ids[:, 1:])
        if self.vocab_sink is not None:
            vocab = self.log_softmax_rows(logits[:, :-1])
            for j, (r, s) in enumerate(zip(rows, seqs, strict=True)):
                self.vocab_sink(r, vocab[j, : len(s) - 1])
        results = []
        for j, (r, s) in enumerate(zip(rows, seqs, strict=True)):
            seq_lp = lp[j, : len(s) - 1]
            replay = self.replay_rows(r, len(s))
            if replay is not None:
                from alignaudit.engines.sampling import process_logits

                span, kwargs = replay
                processed = process_logits(logits[j, :-1][span], **kwargs)
                seq_lp = torch.cat([seq_lp[: span.start], self.token_logprobs(processed, ids[j, 1:][span])])
            results.append(seq_lp)
        return results

    def replay_routing(self, routing, lengths):
        """Each Qwen3MoeSparseMoeBlock's gate routes to the given experts (routing_replay.replayed_router_forward:
        its own softmax, gathered at them). Raises InputError as Engine.replay_routing says."""
        from alignaudit.engines.routing_replay import check_routing, replayed_router_forward

        gates = [layer.mlp.gate for layer in self.model.model.layers if hasattr(layer.mlp, "experts")]
        if not gates or any(hasattr(layer.mlp, "strict_router") for layer in self.model.model.layers):
            raise InputError(
                "hf replays routing of its own MoE router only (a Qwen3 MoE model, --strict without linear)"
            )
        check_routing(routing, len(gates), self.spec.experts_per_token, self.spec.num_experts, lengths)
        self.routing_replay = routing
        self._replay_targets = [{} for _ in gates]
        for gate, target in zip(gates, self._replay_targets, strict=True):
            gate.forward = replayed_router_forward(gate, target)

    @torch.no_grad()
    def rollout(self, batch, sampling):
        """One sequence at a time through ``model.generate`` (KV cache, sampling seeded per request; temperature 0:
        greedy, as rl's held-out evaluation asks). EOS is not a stop token (``eos_token_id`` is emptied), so no logits
        processor masks it. With ``vocab_sink`` set
        (rl --full-vocab), ``vocab_sink(i, rows)`` gets request i's log_softmax_rows of its decode logits, float32
        [max_new_tokens, V]."""
        sequences, logprobs = [], []
        sink, self.vocab_sink = self.vocab_sink, None  # the prompt rows scored below are not decode rows
        try:
            self._rollout(batch, sampling, sink, sequences, logprobs)
        finally:
            self.vocab_sink = sink
        return type(batch)(tuple(sequences), batch.texts, batch.source), logprobs

    def _rollout(self, batch, sampling, sink, sequences: list, logprobs: list) -> None:
        for i, prompt in enumerate(batch.sequences):
            torch.manual_seed(sampling.seed + i)
            ids = torch.tensor([prompt], device=self.settings.device)
            how = (
                {
                    "do_sample": True,
                    "temperature": sampling.temperature,
                    "top_k": sampling.top_k or None,
                    "top_p": sampling.top_p,
                }
                if sampling.temperature > 0
                else {"do_sample": False}
            )  # 0: greedy
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **how,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=[],
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            generated = out.sequences[0, len(prompt) :]
            step_logits = torch.cat(out.logits)  # raw logits of each decode step, [new, V]
            sampled = self.token_logprobs(step_logits, generated).cpu()
            if sink is not None:  # rl --full-vocab: the rows the sampled logprobs are gathered from
                sink(i, self.log_softmax_rows(step_logits).cpu())
            prompt_lp = self.prompt_logprobs(type(batch)((prompt,)))[0]
            sequences.append(tuple(prompt) + tuple(generated.tolist()))
            logprobs.append(torch.cat([prompt_lp, sampled.float()]))
            self.progress(i + 1, len(batch.sequences))

    def hf_weights(self, diverged: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The model's tensors in HF names (the tied lm_head left out, as checkpoints store it)."""
        return {
            k: v
            for k, v in self.model.state_dict().items()
            if not (self.spec.tie_word_embeddings and k == "lm_head.weight")
        }

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy new weights (HF names) into the model in place.

        Raises:
            InputError: a tensor the model lacks, or a model tensor missing from ``tensors``.
        """
        held = self.model.state_dict()
        unknown = sorted(set(tensors) - set(held))
        missing = sorted(set(self.hf_weights()) - set(tensors))
        if unknown or missing:
            raise InputError(f"weight sync into hf: unknown tensors {unknown[:3]}, missing {missing[:3]}")
        for name, tensor in tensors.items():
            held[name].copy_(tensor)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """fp32 log p(target) from logits [..., V]: TRL's formula, or the strict kernel."""
        if "logprobs" in self.settings.strict_ops:
            import alignaudit_kernels as K

            return K.token_logprobs(logits, targets)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]

    def log_softmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax rows [..., V] of logits [..., V], by the formula ``token_logprobs`` gathers from: TRL's
        ``log_softmax(logits.float(), -1)``, or the strict kernel's log_softmax (bit for bit the rows its
        token_logprobs gathers, alignaudit_kernels.logprobs)."""
        if "logprobs" in self.settings.strict_ops:
            import alignaudit_kernels as K

            return K.log_softmax(logits)
        return torch.log_softmax(logits.float(), dim=-1)

    def vocab_row_formula(self) -> str:
        return (
            "alignaudit_kernels.log_softmax(logits)"
            if "logprobs" in self.settings.strict_ops
            else "log_softmax(logits.float(), -1)"
        ) + " over the model's output logits"

    def install_taps(self, tap):
        from alignaudit.engines.hf import taps as hf_taps

        return hf_taps.install(self.model, tap)

    def settings_record(self) -> dict:
        return {
            "attn_implementation": self.attn_implementation,
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": getattr(self, "micro_batches_run", None),
            "dtype": str(self.model.dtype),
            "logprob_formula": (
                "alignaudit_kernels.token_logprobs"
                if "logprobs" in self.settings.strict_ops
                else "log_softmax(logits.float(), -1).gather(next_token)"
            )
            + (
                "; generated tokens: the same formula on process_logits(logits, **replay)"
                if self.replay is not None
                else ""
            ),
            "replay": self.replay.to_dict() if self.replay is not None else None,
            "routing_replay": ROUTING_REPLAYED if self.routing_replay is not None else None,
            "strict": self.settings.strict,
            "strict_modules": len(self.strict_modules),
            "attention_exp": applied_exp(self.model),
            "attention_kernel": applied_kernel(self.model),
            "lm_head_dtype": "float32"
            if self.settings.lm_head_dtype == "fp32"
            else str(self.model.lm_head.weight.dtype),
            "module_mode": "train" if self.model.training else "eval",
            "weights": {"checkpoint_tensors": self.spec.tensors, **self.loading},
        }
