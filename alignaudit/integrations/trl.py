"""TRL's GRPOTrainer with alignaudit's strict path on both sides: ``StrictGRPOTrainer`` (docs/frameworks.md "TRL").

    from alignaudit.integrations.trl import StrictGRPOTrainer
    trainer = StrictGRPOTrainer(model="Qwen/Qwen3-1.7B", reward_funcs=..., args=GRPOConfig(use_vllm=True,
                                vllm_mode="colocate", ...), train_dataset=..., fail_closed=True)

What it changes against TRL's GRPOTrainer (TRL 1.16, trl/trainer/grpo_trainer.py), each because TRL's own path
would make the trainer's logprob of a sampled token another number than vLLM's:
    vLLM      TRL builds its colocated LLM itself, in this process (distributed_executor_backend
              "external_launcher"); the strict plugin (alignaudit.engines.vllm.plugin) is registered here first,
              not left to vLLM's entry-point loading (absent where alignaudit runs from a source tree, or where
              VLLM_PLUGINS leaves it out), so it patches that LLM, processed logprobs included (TRL runs vLLM
              with logprobs_mode="processed_logprobs"); VLLM_USE_V2_MODEL_RUNNER=0 unless set, since the plugin
              makes processed logprobs strict under model runner V1 only. Once TRL has built it, what computes is
              read back (the plugin's applied ops, every layer's attention implementation and linear method) and
              anything not strict stops the constructor (EngineError).
    policy    the transformers model with the strict module swap (alignaudit.api.strict_hf_model); a model given
              as an object must already be strict. Its parameters stay in model_init_kwargs' dtype (TRL's default
              float32: master weights), its forward computes in vLLM's dtype (alignaudit.engines.hf.strict
              compute_in), so a bf16 vLLM and fp32 master weights give the bits of a bf16 model, and the gradients
              reach the fp32 parameters (TRL's autocast cannot: it leaves the norms and the embedding in fp32).
    reference with beta > 0, TRL builds a stock reference model from the checkpoint; it gets the same module swap,
              compute dtype and strict fused head, so TRL's KL is 0 while the policy equals it.
    logprobs  TRL scores tokens with its fused, chunked LM head (trl/trainer/utils.py add_fused_lm_head), whose
              tiles and reductions are its own; here the fused call (``fused_lm_head=True``, the contract TRL's
              GRPOTrainer calls) runs the strict LM head, the sampling transform vLLM applied (temperature, top-k,
              top-p: alignaudit.engines.sampling, the functions the plugin uses) and the strict token logprob,
              with gradients. The objective is therefore the distribution vLLM sampled from: with top-k or top-p, a
              token alone in its kept set has logprob 0 and no gradient (docs/frameworks.md "What the strict head
              trains"); top_k=0 and top_p=1.0 train TRL's full-vocabulary objective, still bit for bit. The
              entropy (TRL's metric and its entropy bonus) is that distribution's, with its gradient.
    positions TRL passes no position_ids; its prompts are left-padded, so each row's positions come from the
              attention mask (cumulative sum - 1), the positions vLLM computed the prompt at.
    the hook  ``compute_loss`` (transformers.Trainer's documented override point, which TRL's step calls after
              the rollout and the trainer's old logprobs exist and before the loss and its backward) compares
              the trainer's old logprobs with vLLM's for every completion token (alignaudit.api.mismatch_metrics),
              logs ``alignaudit/mismatches``, ``alignaudit/tokens``, ``alignaudit/ulp_max`` and
              ``alignaudit/max_abs_diff`` beside TRL's own metrics, and with ``fail_closed=True`` raises
              ``AlignmentError`` before the backward pass of the first micro-batch whose logprobs differ.
Refused at construction, with the reason (InputError, before TRL builds anything): vLLM off or in server mode,
TRL's importance-sampling correction off (its logp difference and the old logprobs the hook compares are computed
only with it), min_p, a repetition penalty, generation_kwargs, structured outputs (vllm_structured_outputs_regex),
vllm_model_impl other than vLLM's own, the LM head cast to fp32 (vLLM projects in the model's dtype), peft_config
(LoRA) or a PEFT model, quantization_config, a model_init_kwargs dtype other than auto/float32/bfloat16/float16, and
vLLM's model runner V2 chosen explicitly.
"""

from __future__ import annotations

import inspect
import os

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import FusedCausalLMOutput

import alignaudit_kernels as K
from alignaudit import api
from alignaudit.engines.vllm import plugin as vllm_plugin
from alignaudit.errors import EXIT_MISMATCH, AlignAuditError, EngineError, InputError
from alignaudit.inputs.strict_ops import (
    ATTENTION_ENV,
    ENV,
    EXP_ENV,
    check_strict_exp,
    format_strict,
    parse_strict,
    prefer_runner_v1,
    runner_v2_asked,
)

HF_DTYPES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}


def _master_dtype(model: str, dtype) -> str:
    """alignaudit's name of the dtype the policy's parameters are kept in: ``model_init_kwargs["dtype"]`` as TRL
    reads it (float32 when absent, TRL's default: fp32 master weights; "auto": the checkpoint's declared dtype).
    Raises InputError for any other value."""
    if dtype == "auto":
        from alignaudit.inputs.checkpoint import resolve_model

        dtype = resolve_model(model).dtype
    if not isinstance(dtype, (str, torch.dtype)) or dtype not in HF_DTYPES:
        raise InputError(
            f"model_init_kwargs dtype {dtype!r}: 'auto', 'float32', 'bfloat16' or 'float16' (the "
            "policy's parameters are kept in it; its forward computes in vLLM's dtype)"
        )
    return HF_DTYPES[dtype]


def _vllm_dtype(llm) -> torch.dtype:
    """The dtype TRL's colocated vLLM computes in, read back (vLLM resolves "auto" by platform: an fp32 checkpoint
    runs in bf16 or fp16, vllm/config/model.py _resolve_auto_dtype)."""
    return llm.llm_engine.model_config.dtype


def _llama3(model) -> tuple | None:
    """The llama3 rope scaling the strict ``model``'s rope computes with (its RopeOp modules'), or None."""
    from alignaudit.engines.strict_modules import RopeOp

    return next((m.llama3 for m in model.modules() if isinstance(m, RopeOp)), None)


class AlignmentError(AlignAuditError):
    """The trainer's logprob of a sampled token differs from the rollout engine's (``fail_closed``)."""

    exit_code = EXIT_MISMATCH


class StrictGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose colocated vLLM and policy both compute with alignaudit's strict kernels, so TRL's own
    ``sampling/sampling_logp_difference`` is 0 and its importance ratio 1 at every token (the module docstring).

    Args:
        model: an HF checkpoint directory, a hub id in the local cache or a fixture name (built strict here, its
            parameters in ``args.model_init_kwargs["dtype"]`` as TRL reads it: float32 when absent, "auto" the
            checkpoint's), or a model already made strict by ``alignaudit.api.strict_hf_model``. Whatever its
            parameters' dtype, its forward computes in the dtype TRL's vLLM computes in (read back once vLLM is
            built; alignaudit.engines.hf.strict.compute_in), so fp32 master weights train as TRL trains them.
            Every other positional and keyword argument is GRPOTrainer's; peft_config and quantization_config are
            refused.
        strict: the strict ops, "all" or a comma list of alignaudit.inputs.strict_ops.STRICT_OPS.
        exp: strict attention's exp, "portable" or "native" (CUDA); None (default): portable. Either value given
            needs attention in ``strict``.
        fail_closed: raise AlignmentError before the backward pass when any completion token's logprob differs.
    Raises:
        InputError: a setting under which the two sides cannot agree, or a model that is not strict (module
            docstring), before TRL builds anything.
        EngineError: TRL's vLLM, once built, does not compute with the strict kernels (read back).
    """

    def __init__(self, model, *args, strict: str = "all", exp: str | None = None, fail_closed: bool = False, **kwargs):
        try:
            given = inspect.signature(GRPOTrainer.__init__).bind(self, model, *args, **kwargs).arguments
        except TypeError as e:
            raise InputError(f"StrictGRPOTrainer: {e}") from None
        config = _check_config(given.get("args"))
        for name, why in (
            (
                "peft_config",
                "TRL then trains LoRA adapters that it merges into vLLM's weights, a sum "
                "the strict policy does not compute; train without peft_config",
            ),
            (
                "quantization_config",
                "vLLM and the policy would each quantize and dequantize in their own kernels; train unquantized",
            ),
        ):
            if given.get(name) is not None:
                raise InputError(f"StrictGRPOTrainer: {name} is not supported: {why}")
        if type(model).__module__.startswith("peft."):
            raise InputError(
                f"model: a {type(model).__name__} (PEFT) is not supported: its adapters are merged into "
                "vLLM's weights in an order the strict policy does not compute; pass the base checkpoint"
            )
        if not isinstance(fail_closed, bool):
            raise InputError(f"fail_closed {fail_closed!r}: True or False")
        ops = parse_strict(strict, option="strict")
        if not ops:
            raise InputError(f"strict {strict!r} selects no strict op; pass 'all' or a comma list")
        if runner_v2_asked():
            raise InputError(
                "VLLM_USE_V2_MODEL_RUNNER is set: vLLM's model runner V2 applies temperature, top-k and "
                "top-p in fused kernels the strict plugin does not replace; unset it"
            )
        path = isinstance(model, str) or hasattr(model, "__fspath__")
        if not path and not any(type(m).__module__ == "alignaudit.engines.hf.strict" for m in model.modules()):
            raise InputError(
                f"model: a checkpoint path or a model from alignaudit.api.strict_hf_model, not a "
                f"{type(model).__name__} without the strict module swap"
            )
        device = (
            ("cpu" if config.use_cpu or not torch.cuda.is_available() else "cuda")
            if path
            else next(model.parameters()).device.type
        )
        exp = check_strict_exp(exp, ops, device, ("exp", "strict", "a CUDA device"))
        if path:
            # model_init_kwargs: a dict or None (GRPOConfig parses a JSON string into a dict, _VALID_DICT_FIELDS)
            init_kwargs = config.model_init_kwargs or {}
            master = _master_dtype(str(model), init_kwargs.get("dtype", "float32"))  # type: ignore[union-attr]
            model = api.strict_hf_model(str(model), ops=format_strict(ops), dtype=master, device=device, exp=exp)
        os.environ[ENV], os.environ[EXP_ENV] = format_strict(ops), exp  # read by the plugin when TRL builds vLLM
        os.environ[ATTENTION_ENV] = "portable"  # the kernel the trainer's strict modules compute (make_strict)
        prefer_runner_v1()
        vllm_plugin.register()
        super().__init__(model, *args, **kwargs)
        llm = getattr(getattr(self, "vllm_generation", None), "llm", None)
        _check_vllm_is_strict(llm, ops)
        self.fail_closed = fail_closed
        self.strict_ops = ops
        self.compute_dtype = _vllm_dtype(llm)
        self._strict_policy_and_reference(ops, exp)

    def _strict_policy_and_reference(self, ops: frozenset[str], exp: str) -> None:
        """The policy, and TRL's reference model where ``beta`` > 0 (TRL builds it from the checkpoint, stock), made
        strict: the module swap on the reference in place, both computing in vLLM's dtype whatever their
        parameters' dtype (``compute_in``), both scoring through the strict fused head."""
        from alignaudit.engines.hf.strict import compute_in, make_strict

        policy = _policy(self)
        reference = getattr(self, "ref_model", None)
        models = [policy] + ([reference] if reference is not None else [])
        for m in models:
            if m is not policy:
                make_strict(m, ops, _llama3(policy), exp)
            if next(m.parameters()).dtype != self.compute_dtype:
                compute_in(m, self.compute_dtype)
            _strict_fused_head(m, self.temperature, self.top_k, self.top_p)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The in-loop hook (module docstring), then GRPOTrainer's loss."""
        self._check_alignment(inputs)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _check_alignment(self, inputs: dict) -> None:
        old, sampled = inputs.get("old_per_token_logps"), inputs.get("sampling_per_token_logps")
        if old is None or sampled is None:
            raise AlignmentError(
                "TRL gave no old and sampling logprobs for this micro-batch; the hook cannot compare "
                "them (vllm_importance_sampling_correction must stay on)"
            )
        mask = inputs["completion_mask"].bool()
        if inputs.get("tool_mask") is not None:
            mask &= inputs["tool_mask"].bool()
        metrics = api.mismatch_metrics(old.detach().float(), sampled.detach().float(), mask=mask)
        mode = "train" if _policy(self).training else "eval"
        for key in ("tokens_compared", "mismatches", "ulp_max", "max_abs_diff"):
            value = metrics[key]
            self._metrics[mode][f"alignaudit/{key}"].append(float("nan") if value is None else float(value))
        if self.fail_closed and metrics["mismatches"]:
            raise AlignmentError(
                f"{metrics['mismatches']} of {metrics['tokens_compared']} completion tokens' trainer "
                f"logprobs differ from vLLM's (max ULP {metrics['ulp_max']}, max |d| "
                f"{metrics['max_abs_diff']}); stopped before the backward pass (fail_closed)"
            )


def _policy(trainer) -> torch.nn.Module:
    """TRL's policy model, which GRPOTrainer.__init__ sets on ``trainer``. Raises EngineError where it holds none."""
    if trainer.model is None:
        raise EngineError("StrictGRPOTrainer: TRL's trainer holds no policy model")
    return trainer.model


def _check_config(config) -> GRPOConfig:
    """``config``, having refused the GRPOConfig settings under which vLLM's and the trainer's logprobs cannot agree
    (module docstring). Raises InputError naming the setting."""
    if not isinstance(config, GRPOConfig):
        raise InputError(f"args: a trl.GRPOConfig, not {type(config).__name__}")
    refusals = [
        (not config.use_vllm, "use_vllm=False: the rollout engine is then the policy itself; use_vllm=True"),
        (
            config.use_vllm and config.vllm_mode != "colocate",
            f"vllm_mode={config.vllm_mode!r}: a vLLM server "
            "runs elsewhere, where this trainer cannot turn the strict plugin on; use 'colocate' (or start the server "
            "with ALIGNAUDIT_STRICT=all and check it with alignaudit rescore)",
        ),
        (
            not config.vllm_importance_sampling_correction,
            "vllm_importance_sampling_correction=False: TRL then "
            "computes neither its logp difference nor the old logprobs the hook compares",
        ),
        (
            config.min_p not in (None, 0.0),
            f"min_p={config.min_p}: vLLM applies it before its processed logprobs, and the strict replay does not",
        ),
        (
            config.repetition_penalty != 1.0,
            f"repetition_penalty={config.repetition_penalty}: vLLM applies it "
            "before its processed logprobs, and the strict replay does not; use 1.0",
        ),
        (config.cast_lm_head_to_fp32, "cast_lm_head_to_fp32=True: vLLM projects in the model's dtype"),
        (
            bool(config.generation_kwargs),
            f"generation_kwargs={config.generation_kwargs!r}: they reach vLLM's "
            "SamplingParams, where they can change the distribution the trainer replays",
        ),
        (
            config.vllm_structured_outputs_regex is not None,
            f"vllm_structured_outputs_regex="
            f"{config.vllm_structured_outputs_regex!r}: vLLM masks the tokens the regex forbids before its processed "
            "logprobs, and the trainer does not replay the grammar; train without it",
        ),
        (
            config.vllm_model_impl not in ("auto", "vllm"),
            f"vllm_model_impl={config.vllm_model_impl!r}: vLLM then runs "
            "the transformers modules, which the strict plugin does not patch; use 'vllm'",
        ),
    ]
    truncated = (config.top_k or 0) > 0 or (config.top_p is not None and config.top_p < 1)
    if truncated:
        sampling = f"top_k={config.top_k}, top_p={config.top_p}"
        stale = config.num_iterations > 1 or (config.steps_per_generation or 1) > config.gradient_accumulation_steps
        refusals += [
            (
                config.beta != 0,
                f"beta={config.beta} with {sampling}: the reference model's truncated distribution can "
                "leave out a token the policy sampled (logprob -inf, TRL's KL infinite); with beta > 0 use top_k=0 and "
                "top_p=1.0 (the whole vocabulary at the temperature, TRL's own objective)",
            ),
            (
                stale,
                f"{sampling} with num_iterations={config.num_iterations}, steps_per_generation="
                f"{config.steps_per_generation}: the policy is updated before some tokens are rescored, and its new "
                "truncated distribution can leave out a sampled token (logprob -inf); use top_k=0 and top_p=1.0, or "
                "one optimizer step per generation",
            ),
        ]
    for refused, why in refusals:
        if refused:
            raise InputError(f"StrictGRPOTrainer: {why}")
    return config


def _check_vllm_is_strict(llm, ops: frozenset[str]) -> None:
    """Read back that TRL's colocated vLLM computes with the strict kernels (alignaudit.api.verify_strict_vllm).
    Raises EngineError when it does not, or when TRL keeps its LLM elsewhere than
    ``GRPOTrainer.vllm_generation.llm`` (TRL 1.16)."""
    if llm is None:
        raise EngineError(
            "StrictGRPOTrainer: TRL's colocated vLLM is not at trainer.vllm_generation.llm (TRL 1.16's "
            "place), so the strict kernels in it cannot be checked; use TRL 1.16"
        )
    api.verify_strict_vllm(llm, format_strict(ops))


def _strict_fused_head(model, temperature: float, top_k: int, top_p: float) -> None:
    """Make ``model(..., labels=..., fused_lm_head=True)`` (TRL's call for per-token logprobs) compute them strictly:
    positions from the attention mask, the strict LM head over the labelled positions, vLLM's sampling transform,
    the strict token logprob. Calls without ``fused_lm_head`` run the model's own forward."""
    import types

    from alignaudit.engines.sampling import process_logits

    forward = type(model).forward

    def fused(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:  # the model's own forward, every argument passed on
            extra = {
                k: v
                for k, v in (
                    ("labels", labels),
                    ("shift_labels", shift_labels),
                    ("num_items_in_batch", num_items_in_batch),
                )
                if v is not None
            }
            return forward(self, *args, **kwargs, **extra)
        if args or shift_labels is not None:
            raise InputError("the strict fused head takes input_ids and attention_mask by keyword, unshifted labels")
        mask_in = kwargs.get("attention_mask")
        if mask_in is not None and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = (mask_in.long().cumsum(-1) - 1).clamp(min=0)  # left padding: vLLM's positions
        kwargs["use_cache"] = False
        device = next(self.parameters()).device.type
        with torch.autocast(device, enabled=False):  # the strict modules fix their own precision (vLLM's dtype)
            hidden = self.model(**kwargs).last_hidden_state[:, :-1]  # [b, t - 1, H]
            targets = labels[:, 1:]
            scored = targets != -100
            logits = self.lm_head(hidden[scored])  # [n, V], strict linear
            # vLLM reads top_k 0 and -1 (TRL may pass either) as off, top_p None as 1
            processed = process_logits(logits, temperature, max(top_k or 0, 0), 1.0 if top_p is None else top_p)
            values = K.token_logprobs(processed, targets[scored])  # fp32 [n], vLLM's processed logprob bits
            log_probs = values.new_zeros(scored.shape).masked_scatter(scored, values)
            entropies = values.new_zeros(scored.shape).masked_scatter(scored, _entropy(processed))
        count = scored.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropies, label_mask=scored
        )

    model.forward = types.MethodType(fused, model)


def _entropy(processed: torch.Tensor) -> torch.Tensor:
    """fp32 [n]: the entropy of each row of the processed logits [n, V] (the distribution vLLM sampled from: the
    truncated tokens at -inf contribute 0), differentiable: TRL's entropy bonus (``entropy_coef``) trains through
    it. Written so that no NaN reaches the gradient at the truncated tokens (p = 0 there, log p = -inf)."""
    logp = torch.log_softmax(processed.float(), dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
