"""alignaudit's Python API: what a user script or a training loop calls (docs/api.md).

    strict_megatron_model(model)   a Megatron-Core GPTModel with every op strict, weights from an HF checkpoint
    strict_hf_model(model)         a transformers model with the strict module swap
    token_logprobs(model, ...)     per-token logprobs of token ids under either model (the trainer's side)
    compare(model, ...)            a whole comparison, as ``alignaudit compare`` runs it -> Comparison
    mismatch_metrics(train, rollout)    the metrics of one RL step's logprobs, as compare reports them
    verify_weight_sync(trainer, rollout)  the weights sent against what the rollout engine computes with -> WeightSync
    load_vllm_weights(llm, weights)       a weight sync into a running vLLM, its post-load repacking included
    vllm_weights(llm)                     the weights a running vLLM holds, in HF names
    verify_strict_vllm(llm)               that a running vLLM computes with the strict kernels, read back

Every argument either takes effect or raises alignaudit.errors.InputError (one line naming it and the fix)
before any engine starts; the checks are the CLI's own, from the typer-free request builder both call
(alignaudit.pipelines.requests).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from alignaudit.errors import InputError

API_NAMES = ("ops", "device='cuda'")  # how this module's user spells the strict ops and a CUDA device


def _settings(dtype: str, device: str, ops: str, exp: str, spec, seed: int = 0):
    """EngineSettings for a strict model of ``spec`` built in this process for the caller's trainer, validated
    as the CLI validates them (the kernel switches as for a run that trains)."""
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.inputs.strict_ops import (
        check_kernel_switches,
        check_strict_exp,
        format_strict,
        parse_strict,
    )
    from alignaudit.pipelines.requests import check_dtype, resolve_device

    device = resolve_device(device)
    strict = parse_strict(ops, option="ops")
    if not strict:
        raise InputError(f"ops {ops!r} selects no strict op, so the model would not be strict; pass 'all' or a comma "
                         "list of alignaudit.inputs.strict_ops.STRICT_OPS")
    check_kernel_switches(strict, bool(spec.num_experts), True, device, API_NAMES)
    return EngineSettings(check_dtype(dtype), device, seed, {}, strict=format_strict(strict),
                          strict_exp=check_strict_exp(exp, strict, device, ("exp", *API_NAMES)))


def _check_number(name: str, value, expected: str = "a number") -> None:
    """Refuse a value that is not a real number (bool, str, None, ...). Raises InputError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} {value!r}: {expected}")


def _spec(model: str | Path, random_weights: bool, seed: int = 0):
    from alignaudit.inputs.checkpoint import resolve_model

    return resolve_model(str(model), random_weights=random_weights, seed=seed)


def strict_megatron_model(model: str | Path = "qwen3-tiny", ops: str = "all", dtype: str = "bf16",
                          device: str = "auto", exp: str = "portable", random_weights: bool = False):
    """A Megatron-Core StrictGPTModel (alignaudit.engines.megatron.strict) of ``model``, built as alignaudit's
    own Megatron engine builds it: a one-rank process group if none exists (gloo on CPU, NCCL on CUDA), Megatron's
    model-parallel state and RNG tracker, the TransformerConfig from config.json, and the HF weights converted
    (alignaudit.engines.megatron.weights). Call it as a GPTModel: ``model(input_ids [b, s], position_ids,
    attention_mask, labels=labels)`` gives the per-token loss, whose negation is the logprob; the batch layouts
    it takes are in docs/strict.md.

    Args:
        model: an HF checkpoint directory, a hub id in the local cache, a fixture name, or a preset with
            ``random_weights``. ops: "all" or a comma list of alignaudit.inputs.strict_ops.STRICT_OPS.
        dtype: "bf16", "fp16" or "fp32". device: "cpu", "cuda" or "auto". exp: strict attention's exp,
            "portable" or "native" (CUDA).
    Raises:
        InputError: a bad argument (the CLI's message). EngineError: megatron-core is not installed.
    """
    from alignaudit.engines import load_engine_class

    spec = _spec(model, random_weights)
    engine = load_engine_class("megatron")(spec, _settings(dtype, device, ops, exp, spec))
    return engine.gpt


def strict_hf_model(model: str | Path = "qwen3-tiny", ops: str = "all", dtype: str = "bf16", device: str = "auto",
                    exp: str = "portable", random_weights: bool = False, compute_dtype: str | None = None):
    """A transformers model of ``model`` with the strict module swap (alignaudit.engines.hf.strict.make_strict),
    in eval mode. Logprobs: ``token_logprobs(model, ...)`` (strict, as every engine's strict path). Arguments
    and errors as ``strict_megatron_model``, and ``compute_dtype``: "bf16", "fp16" or "fp32", the dtype the forward
    computes in where it differs from ``dtype``, the parameters' (mixed precision: ``dtype="fp32",
    compute_dtype="bf16"`` keeps fp32 master weights and gives the bits of the bf16 model a rollout engine holds after
    a weight sync; alignaudit.engines.hf.strict.compute_in). InputError for another value, or with ``ops`` other than
    all (a default op would compute in its parameters' dtype)."""
    from alignaudit.engines import load_engine_class
    from alignaudit.engines.hf.strict import compute_in
    from alignaudit.inputs.request import DTYPES
    from alignaudit.pipelines.requests import check_dtype

    spec = _spec(model, random_weights)
    compute = check_dtype(compute_dtype) if compute_dtype is not None else None
    built = load_engine_class("hf")(spec, _settings(dtype, device, ops, exp, spec)).model
    if compute is not None and compute != check_dtype(dtype):
        compute_in(built, DTYPES[compute])
    return built


def token_logprobs(model, sequences: list[list[int]] | list[torch.Tensor]) -> list[torch.Tensor]:
    """Teacher-forced logprobs of each sequence's tokens 1..n-1 under ``model`` (a model from
    ``strict_megatron_model`` or ``strict_hf_model``), the sequences right-padded into one batch. Returns one fp32
    tensor of n - 1 values per sequence, on the CPU; strict models give each sequence the bits it has alone.

    Raises:
        InputError: a sequence shorter than 2 tokens, or a model of neither kind.
    """
    import alignaudit_kernels as K

    megatron = hasattr(model, "compute_language_model_loss")
    if not megatron and not (hasattr(model, "config") and hasattr(model, "generate")):
        raise InputError(f"token_logprobs takes a model from strict_megatron_model or strict_hf_model, not "
                         f"{type(model).__name__}")
    vocab = model.vocab_size if megatron else model.config.vocab_size
    limit = model.max_sequence_length if megatron else model.config.max_position_embeddings
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, (list, tuple)):
        raise InputError(f"sequences: a list of token-id sequences (lists of int or 1-D integer tensors), not "
                         f"{type(sequences).__name__}")
    seqs = [_token_ids(i, s, vocab, limit) for i, s in enumerate(sequences)]
    if not seqs:
        raise InputError("token_logprobs needs at least one sequence")
    device = next(model.parameters()).device
    b, t = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], valid[i, :len(s)] = s, True
    ids, valid = ids.to(device), valid.to(device)
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        if megatron:  # Megatron-Core GPTModel: the pads masked as keys
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), 1)
            mask = (causal[None] | ~valid[:, None, :])[:, None]
            rows = -model(ids, None, mask, labels=labels).float()
        else:  # transformers
            logits = model(input_ids=ids, attention_mask=valid.long()).logits
            rows = K.token_logprobs(logits, labels).float()
    return [rows[i, :len(s) - 1].cpu() for i, s in enumerate(seqs)]


def _token_ids(i: int, sequence, vocab: int, limit: int) -> torch.Tensor:
    """Sequence ``i`` as a 1-D int64 tensor. Raises InputError for what the model cannot score."""
    if isinstance(sequence, (str, bytes)):
        raise InputError(f"sequence {i} is text; give token ids (tokenize it first)")
    try:
        ids = torch.as_tensor(sequence)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise InputError(f"sequence {i}: not a list of token ids ({str(e).splitlines()[0]})") from None
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"sequence {i}: token ids must be one list (or 1-D tensor) of integers, not "
                         f"{ids.dtype} of shape {tuple(ids.shape)}")
    if len(ids) < 2:
        raise InputError(f"sequence {i} has {len(ids)} token(s); token_logprobs needs at least 2 (the first has no "
                         "logprob)")
    if len(ids) > limit:
        raise InputError(f"sequence {i} has {len(ids)} tokens, more than the model's {limit} positions; shorten it")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise InputError(f"sequence {i} has a token id outside the vocabulary [0, {vocab}); score ids of this model")
    return ids.long()


@dataclass
class Comparison:
    """A finished comparison (``compare``): summary.json's numbers as attributes, the tables as DataFrames.

    Attributes:
        path: the run directory (run.json, the captures, tokens.parquet, sequences.parquet, summary.json).
        tokens_compared, mismatches: tokens with a logprob on both sides, and those not bitwise equal.
        ulp_max, max_abs_diff: the largest fp32 ULP distance and |lp_train - lp_infer| (None without finite pairs).
        generated: the same record for the sampled tokens alone (rollout mode), else None.
        summary: all of summary.json (docs/output.md explains every field).
        tokens, sequences: tokens.parquet (one row per token) and sequences.parquet (one per sequence).
    """

    path: Path
    tokens_compared: int
    mismatches: int
    ulp_max: int | None
    max_abs_diff: float | None
    generated: dict | None
    summary: dict = field(repr=False)
    tokens: pd.DataFrame = field(repr=False)
    sequences: pd.DataFrame = field(repr=False)

    @property
    def bitwise_equal(self) -> bool:
        """Every compared token bitwise equal (and at least one compared)."""
        return self.tokens_compared > 0 and self.mismatches == 0


def compare(model: str | Path = "qwen3-tiny", *, train: str = "megatron", infer: str = "vllm",
            strict: str | None = None,
            mode: str = "prompt", prompts: str | Path | None = None, random_prompts: int | None = None,
            prompt_len: int | None = None, dtype: str = "bf16", device: str = "auto",
            train_options: dict[str, Any] | None = None, infer_options: dict[str, Any] | None = None,
            max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
            top_p: float | None = None,
            group_size: int | None = None, stop_at_eos: bool | None = None, prompt_logprobs: bool | None = None,
            engine_mode: str | None = None, arrival_gap: float | None = None,
            random_weights: bool = False, seed: int = 0, clip_eps: float = 0.2, out: str | Path | None = None,
            force: bool = False, replay_routing: bool = False, full_vocab: bool = False, repeat: int = 1
            ) -> Comparison:
    """Run ``alignaudit compare`` from Python: the same validation, engines (each in its own worker process),
    outputs and sealed run.json, into ``out`` (default: a new alignaudit-runs/compare-<time> directory; an
    existing non-empty one needs ``force``; where the run fails, the complete results it replaced stay in
    ``out/.alignaudit-previous/``). Arguments are the CLI's options (docs/cli.md): ``strict`` "all" or a
    comma list; ``train_options`` / ``infer_options`` the ``--train-opt`` / ``--infer-opt`` settings;
    ``replay_routing`` is ``--replay-routing`` (summary["routing_replay"]).
    ``full_vocab`` is ``--full-vocab`` (the summary's ``vocab`` record and the tokens' ``vocab_*`` columns);
    ``repeat`` is ``--repeat`` (prompt mode: runs per engine on the same token ids, summary["repeats"]).
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``: None is 32, 1.0, 0 (off), 1.0 (off) in rollout mode; a
    value given in prompt mode is refused, the default's too.
    The rollout shape (mode "rollout"): ``group_size`` (``--group-size``), ``stop_at_eos`` and ``prompt_logprobs``
    (None: the rollout engine's default, vLLM's being EOS on and no prompt logprobs; ``--stop-at-eos/--ignore-eos``,
    ``--prompt-logprobs/--no-prompt-logprobs``), ``engine_mode`` "offline" or "async" and ``arrival_gap`` seconds
    (``--engine-mode``, ``--arrival-gap``; 0.02 in async mode). None leaves a setting unset: one given where it would
    not take effect (prompt mode, an offline arrival gap) is refused. The shape resolved is run.json's ``rollout``.

    Raises:
        InputError: any bad argument, before any engine starts. EngineError: an engine failed.
    """
    import json

    from alignaudit.capture import outdir
    from alignaudit.capture.rundir import COMPARE_OUTPUTS, SEQUENCES, TOKENS
    from alignaudit.pipelines.requests import (
        ModelArgs,
        OutputArgs,
        PairArgs,
        PromptArgs,
        SamplingArgs,
        build_request,
        out_dir,
    )
    from alignaudit.pipelines.runs import compare as run_compare

    if mode not in ("prompt", "rollout"):
        raise InputError(f"mode {mode!r}: choose prompt or rollout")
    if prompts is not None and not isinstance(prompts, (str, Path)):
        raise InputError(f"prompts: a file path (JSONL or text lines), not {type(prompts).__name__}; token ids go in "
                         "a JSONL file of {\"token_ids\": [...]} lines")
    for name, opts in (("train_options", train_options), ("infer_options", infer_options)):
        if opts is not None and not isinstance(opts, dict):
            raise InputError(f"{name}: a dict of engine settings, not {type(opts).__name__}")
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed),
                        ("random_prompts", random_prompts), ("prompt_len", prompt_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{name} {value!r}: an integer")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("clip_eps", clip_eps)):
        if value is not None or name == "clip_eps":
            _check_number(name, value)
    if out is not None and not isinstance(out, (str, Path)):
        raise InputError(f"out {out!r}: a directory path (str or pathlib.Path)")
    for name, value in (("force", force), ("random_weights", random_weights)):
        if not isinstance(value, bool):
            raise InputError(f"{name} {value!r}: True or False")
    try:
        options = [[f"{k}={json.dumps(v)}" for k, v in (opts or {}).items()] for opts in (train_options, infer_options)]
    except TypeError as e:
        raise InputError(f"engine options must be JSON values (numbers, strings, booleans, lists): {e}") from e
    pair = PairArgs(train=train, infer=infer, dtype=dtype, device=device, train_opt=options[0] or None,
                    infer_opt=options[1] or None, strict=strict)
    sampling = SamplingArgs(mode, max_new_tokens, temperature, top_k, top_p, group_size, stop_at_eos, prompt_logprobs,
                            engine_mode, arrival_gap)
    with _argument_names():
        request = build_request(ModelArgs(str(model), random_weights, seed),
                                PromptArgs(Path(prompts) if prompts is not None else None, random_prompts, prompt_len),
                                pair, sampling, clip_eps, replay_routing=replay_routing, full_vocab=full_vocab,
                                repeat=repeat)
        path = out_dir(OutputArgs(str(out) if out is not None else None, force), "compare", COMPARE_OUTPUTS)
    try:
        with _argument_names():
            summary = run_compare(request, path)
    finally:
        outdir.release(path)  # a failed run keeps the complete results force=True replaced (out/.alignaudit-previous)
    return Comparison(path, summary["tokens_compared"], summary["mismatches"], summary["ulp_max"],
                      summary["max_abs_diff"], summary.get("generated"), summary,
                      pd.read_parquet(path / TOKENS), pd.read_parquet(path / SEQUENCES))


# CLI flags whose compare() argument is not the flag's own name with underscores
_FLAG_ARGUMENTS = {"--train-opt": "train_options", "--infer-opt": "infer_options", "--ignore-eos": "stop_at_eos=False",
                   "--no-prompt-logprobs": "prompt_logprobs=False"}


@contextmanager
def _argument_names():
    """Re-raise the request builder's InputError (written for the CLI) with compare()'s argument names in place of
    the CLI's flags: ``--max-new-tokens`` -> ``max_new_tokens``, ``--infer-opt`` -> ``infer_options``."""
    import inspect

    try:
        yield
    except InputError as e:
        names = set(inspect.signature(compare).parameters)

        def spell(match: re.Match) -> str:
            flag = match.group(0)
            name = flag[2:].replace("-", "_")
            return _FLAG_ARGUMENTS.get(flag, name if name in names else flag)

        raise InputError(re.sub(r"--[a-z][a-z0-9-]*", spell, str(e))) from e


def mismatch_metrics(train_logprobs, rollout_logprobs, mask: torch.Tensor | None = None,
                     clip_eps: float = 0.2) -> dict:
    """The mismatch metrics of one RL step, computed as ``compare`` computes them (summary.json's fields:
    tokens_compared, mismatches, mismatch_fraction, ulp_max, ulp_histogram, max_abs_diff, NaN/Inf counts and
    ``rl``: importance-ratio range, clip fraction at ``clip_eps``, token_mult_prob_error, probability
    differences, K3 KL; docs/output.md has each formula).

    Args:
        train_logprobs, rollout_logprobs: the trainer's and the rollout engine's logprobs of the same tokens:
            two lists of 1-D tensors (one per sequence, equal lengths pairwise), or two [B, T] tensors with
            ``mask`` [B, T] (bool, True = a token to compare, e.g. the response mask).
        clip_eps: the PPO clip range the clip fraction counts against.
    Raises:
        InputError: shapes or lengths that disagree, no token to compare, or a compared value above 0 (+inf
            included: alignaudit.inputs.values.check_logprob_signs).
    """
    from alignaudit.comparison.token_diff import compare_tokens, summarize_tokens
    from alignaudit.inputs.values import check_logprob_signs
    from alignaudit.pipelines.requests import check_clip_eps

    _check_number("clip_eps", clip_eps, "a number in (0, 1)")
    check_clip_eps(clip_eps)
    train, rollout = _rows(train_logprobs, mask, "train_logprobs"), _rows(rollout_logprobs, mask, "rollout_logprobs")
    if len(train) != len(rollout) or any(a.shape != b.shape for a, b in zip(train, rollout, strict=True)):
        raise InputError(f"train_logprobs and rollout_logprobs disagree: {[len(a) for a in train]} tokens per "
                         f"sequence vs {[len(b) for b in rollout]}")
    for name, rows in (("train_logprobs", train), ("rollout_logprobs", rollout)):
        check_logprob_signs(name, rows, [f"sequence {i}" for i in range(len(rows))])
    seq = [torch.full((len(a),), i) for i, a in enumerate(train)]
    tokens = pd.DataFrame({
        "seq": torch.cat(seq).numpy() if seq else [],
        "pos": torch.cat([torch.arange(len(a)) for a in train]).numpy() if train else [],
        "lp_train": torch.cat(train).numpy() if train else [],
        "lp_infer": torch.cat(rollout).numpy() if rollout else [],
    })
    return summarize_tokens(compare_tokens(tokens), clip_eps)


def _rows(logprobs, mask, name: str) -> list[torch.Tensor]:
    """One fp32 CPU tensor per sequence from a list of 1-D tensors or a [B, T] tensor with ``mask``; each checked by
    ``_fp32``."""
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.is_meta):
        raise InputError(f"mask must be a bool tensor (True = a token to compare), not "
                         f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if isinstance(logprobs, torch.Tensor):
        if logprobs.dim() != 2:
            raise InputError(f"{name}: a [B, T] tensor (with mask) or a list of 1-D tensors, not shape "
                             f"{tuple(logprobs.shape)}")
        if mask is None:
            mask = torch.ones_like(logprobs, dtype=torch.bool)
        if mask.shape != logprobs.shape:
            raise InputError(f"mask {tuple(mask.shape)} and {name} {tuple(logprobs.shape)} differ in shape")
        values = _fp32(logprobs, name)
        return [row[m] for row, m in zip(values, mask.cpu(), strict=True)]
    if mask is not None:
        raise InputError(f"mask applies to [B, T] tensors; {name} is a list of sequences")
    if isinstance(logprobs, (str, bytes)) or not isinstance(logprobs, (list, tuple)):
        raise InputError(f"{name}: a list of 1-D tensors (one per sequence) or a [B, T] tensor, not "
                         f"{type(logprobs).__name__}")
    rows = []
    for i, row in enumerate(logprobs):
        if isinstance(row, (str, bytes)):
            raise InputError(f"{name}[{i}] is text; give numbers")
        try:
            # Python floats are float64: kept as such, so _fp32 refuses what fp32 would round
            tensor = row if isinstance(row, torch.Tensor) else torch.as_tensor(row, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"{name}[{i}]: not a sequence of numbers ({str(e).splitlines()[0]})") from None
        if tensor.dim() != 1:
            raise InputError(f"{name}: each sequence's logprobs must be 1-D; give a [B, T] tensor with a mask instead")
        rows.append(_fp32(tensor, f"{name}[{i}]"))
    return rows


def _fp32(values: torch.Tensor, name: str) -> torch.Tensor:
    """``values`` as fp32 on the CPU, refusing what fp32 would change: alignaudit compares fp32 bit patterns (what
    engines record), into which bf16 and fp16 convert exactly; float64 only where every value converts exactly.

    Raises:
        InputError: a meta tensor, a non-floating dtype (int, bool, complex), or float64 values fp32 cannot hold.
    """
    if values.is_meta:
        raise InputError(f"{name} is a meta tensor (no values); give the logprobs themselves")
    if not values.is_floating_point():
        raise InputError(f"{name} has dtype {values.dtype}; logprobs are floating point (fp32 as engines record them)")
    values = values.detach().cpu()
    converted = values.float()
    if values.dtype == torch.float64:
        same = (converted.double() == values) | (values.isnan() & converted.isnan())
        if not bool(same.all()):
            raise InputError(f"{name} holds float64 logprobs that fp32 cannot hold exactly; alignaudit compares the "
                             "fp32 values engines record: pass those (or .float() both sides yourself, knowing it "
                             "rounds)")
    return converted


@dataclass
class WeightSync:
    """The result of ``verify_weight_sync``.

    Attributes:
        equal: every tensor present on both sides with the same bits (dtype, shape and bytes), none missing, and
            (where the rollout side is a running vLLM) no packed copy computing with other weights.
        differing: names whose dtype, shape or bytes differ. missing: names on one side only (trainer-only
            names first, then rollout-only).
        stale_packed: vLLM layers (module names) whose packed CPU GEMM computes with weights other than the
            layer's parameter; [] where nothing is packed (GPU, the strict path) or where the rollout side was
            given as a dict (see ``covers_engine_copies``).
        covers_engine_copies: True where the rollout side was the running engine, so the copies it computes with
            were checked too; False for a dict of tensors, which shows what the dict holds and nothing else.
        checksums: sha256 of each trainer tensor's bytes, by name (alignaudit.engines.base.checksums).
    """

    equal: bool
    differing: list[str]
    missing: list[str]
    stale_packed: list[str] = field(default_factory=list)
    covers_engine_copies: bool = False
    checksums: dict[str, str] = field(default_factory=dict, repr=False)


def verify_weight_sync(trainer: dict[str, torch.Tensor], rollout) -> WeightSync:
    """Check that the rollout engine computes, bit for bit, with the weights the trainer sent (in HF names: e.g.
    ``dict(model.named_parameters())`` of an HF model). A weight sync that changes one bit breaks bitwise
    alignment however strict the kernels are.

    Args:
        trainer: HF name -> tensor, the weights sent.
        rollout: the running vLLM ``LLM`` of this process (offline, VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's
            colocate mode runs it), or a dict of HF name -> tensor read back from the engine. Given the LLM, the
            check covers what vLLM computes with: its parameters (qkv_proj and gate_up_proj split into HF names)
            and, on its CPU backend, each packed GEMM, which must give on a probe input the bits of a GEMM packed
            afresh from the parameter (alignaudit.engines.vllm.weights.stale_packed_layers). A framework that
            calls ``model.load_weights`` without vLLM's post-load step (TRL 1.16 does) leaves those packed copies
            stale while the parameters hold the new weights; ``load_vllm_weights`` does both steps. Given a dict,
            only the dict is compared (``covers_engine_copies`` False).
    Raises:
        InputError: empty or non-tensor sides, a meta, quantized, sparse or non-floating tensor (inputs.values
            check_weight: a byte view of a quantized one crashed the process); a vLLM whose CPU backend freed its
            linear weights after packing them (nothing to read back: call ``keep_vllm_weights()`` before building the
            LLM).
    """
    from alignaudit.engines.weight_transfer import checksums
    from alignaudit.inputs.values import check_weight

    stale: list[str] = []
    engine = _is_vllm(rollout)
    if engine:
        from alignaudit.engines.vllm.weights import stale_packed_layers

        stale = stale_packed_layers(rollout.apply_model(lambda m: m)[0])
        rollout = vllm_weights(rollout)
    for name, side in (("trainer", trainer), ("rollout", rollout)):
        if not isinstance(side, dict) or not all(isinstance(t, torch.Tensor) for t in side.values()):
            raise InputError(f"{name}: a dict of HF name -> tensor (e.g. dict(model.named_parameters())), or for the "
                             f"rollout side the running vLLM LLM, not {type(side).__name__}")
        for key, tensor in side.items():
            check_weight(f"{name}[{key!r}]", tensor)
    if not trainer:
        raise InputError("trainer holds no weights: an empty sync would pass unchecked; give the tensors sent")
    missing = sorted(set(trainer) - set(rollout)) + sorted(set(rollout) - set(trainer))
    differing = [name for name in sorted(set(trainer) & set(rollout))
                 if trainer[name].dtype != rollout[name].dtype or trainer[name].shape != rollout[name].shape
                 or not torch.equal(_bytes(trainer[name]), _bytes(rollout[name]))]
    return WeightSync(not differing and not missing and not stale, differing, missing, stale, engine,
                      checksums(trainer))


def keep_vllm_weights() -> None:
    """Keep vLLM's CPU linear weights after it packs them (call before building the LLM): vLLM 0.32's CPU backend
    otherwise frees each parameter once packed for oneDNN, so a later ``load_weights`` has nowhere to write and
    ``verify_weight_sync`` nothing to read. A no-op on other platforms and under the strict plugin (which computes
    with the parameters themselves)."""
    from alignaudit.engines.vllm.weights import keep_vllm_cpu_weights

    keep_vllm_cpu_weights()


def load_vllm_weights(llm, weights: dict[str, torch.Tensor]) -> None:
    """Push HF-named ``weights`` into the running vLLM ``llm`` as verl, slime and NeMo-RL do (``model.load_weights``)
    and then run vLLM's own post-load step, which repacks the CPU GEMMs (without it they keep computing with the
    old weights), and drop its cached prefixes (computed with the old weights).

    Every tensor is checked before any is written (vLLM's loader writes them one by one, so a bad one found late would
    leave the engine half-updated): its name and shape against the checkpoint vLLM was built from
    (inputs.checkpoint.weight_shapes), a real floating dtype (not quantized, not meta).

    Raises:
        InputError: ``llm`` is not a vLLM LLM running in this process, ``weights`` not a non-empty dict of tensors, or
            a tensor that is not one of the model's (name, shape, dtype), naming it; nothing is written then.
    """
    from alignaudit.engines.vllm.weights import load_into_vllm
    from alignaudit.inputs.checkpoint import weight_shapes
    from alignaudit.inputs.values import check_weight

    if not _is_vllm(llm):
        raise InputError(f"llm: a vLLM LLM running in this process, not {type(llm).__name__}")
    if not isinstance(weights, dict) or not weights or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise InputError("weights: a non-empty dict of HF name -> tensor")
    shapes = weight_shapes(llm.llm_engine.model_config.model)
    for name, tensor in weights.items():
        if name not in shapes:
            raise InputError(f"weights[{name!r}]: not a tensor of this model's checkpoint; nothing was loaded")
        if tuple(tensor.shape) != shapes[name]:
            raise InputError(f"weights[{name!r}] has shape {tuple(tensor.shape)}, the model's is {shapes[name]}; "
                             "nothing was loaded")
        try:
            check_weight(f"weights[{name!r}]", tensor)
        except InputError as e:
            raise InputError(f"{e}; nothing was loaded") from None
    load_into_vllm(llm, weights)


def verify_strict_vllm(llm, ops: str = "all") -> dict:
    """Read back that the vLLM ``llm`` (an offline ``LLM``) computes with alignaudit's strict kernels: every op of
    ``ops`` applied by the strict plugin when the model was built (in the process that holds it; an op registered
    later does not count, since the model's attention backend and CPU weight layout are fixed as it is built), every
    attention layer on the strict implementation, every linear layer on the method the plugin replaces. For a vLLM
    your framework builds (with ALIGNAUDIT_STRICT set), after it is built and before its rollouts count.

    Returns:
        what was read back: ``{"attention_impls": {class: strict exp or None}, "linear_methods": [...],
        "strict_ops": [...]}`` (alignaudit.engines.vllm.weights.kernels_of).
    Raises:
        InputError: ``llm`` is not a vLLM LLM, ``ops`` names no strict op, or the model sits in vLLM's engine-core
            process without VLLM_ALLOW_INSECURE_SERIALIZATION (the function cannot be sent there).
        EngineError: what computes is not strict (the first layer or op that is not, named).
    """
    from alignaudit.engines.vllm.weights import check_strict_kernels, kernels_of
    from alignaudit.inputs.strict_ops import parse_strict

    if not _is_vllm(llm):
        raise InputError(f"llm: a vLLM LLM, not {type(llm).__name__}")
    wanted = parse_strict(ops, option="ops")
    if not wanted:
        raise InputError(f"ops {ops!r} selects no strict op; pass 'all' or a comma list")
    try:
        kernels = llm.apply_model(kernels_of)[0]
    except TypeError as e:  # vLLM's msgspec encoder, sending the function to the engine-core process
        if "serializ" not in str(e):
            raise
        raise InputError("llm runs its model in vLLM's engine-core process, where LLM.apply_model cannot send the "
                         "read-back function; build it with VLLM_ENABLE_V1_MULTIPROCESSING=0 (as TRL's colocate mode "
                         "does) or set VLLM_ALLOW_INSECURE_SERIALIZATION=1") from e
    check_strict_kernels(kernels, wanted)
    return kernels


def _is_vllm(obj) -> bool:
    return type(obj).__name__ == "LLM" and hasattr(obj, "apply_model") and hasattr(obj, "llm_engine")


def vllm_weights(llm) -> dict[str, torch.Tensor]:
    """The weights a vLLM ``LLM`` running in this process holds, in HF names (qkv_proj split into q/k/v_proj,
    gate_up_proj into gate/up_proj; vllm/model_executor/models/qwen3.py, qwen2.py, llama.py): views of vLLM's
    parameters, not copies.

    Raises:
        InputError: ``llm`` is not such an LLM, or its CPU backend freed the linear weights after packing them
            (call ``keep_vllm_weights()`` before building the LLM).
    """
    from alignaudit.engines.vllm.weights import vllm_to_hf
    from alignaudit.inputs.checkpoint import load_spec

    if not _is_vllm(llm):
        raise InputError(f"llm: a vLLM LLM running in this process, not {type(llm).__name__}")
    try:
        return vllm_to_hf(llm.apply_model(lambda m: m)[0], load_spec(Path(llm.llm_engine.model_config.model)))
    except ValueError as e:
        raise InputError(f"{e} (alignaudit.api.keep_vllm_weights)") from e


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
