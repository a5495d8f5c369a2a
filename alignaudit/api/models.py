"""Strict models built in the caller's process, and the logprobs of token ids under them."""

from __future__ import annotations

from pathlib import Path

import torch

from alignaudit.api.checks import settings, spec_of
from alignaudit.errors import InputError


def strict_megatron_model(
    model: str | Path = "qwen3-tiny",
    ops: str = "all",
    dtype: str = "bf16",
    device: str = "auto",
    exp: str | None = None,
    random_weights: bool = False,
):
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
            "portable" or "native" (CUDA); None (default): portable. Either value given needs attention in ``ops``.
    Raises:
        InputError: a bad argument (the CLI's message). EngineError: megatron-core is not installed.
    """
    from alignaudit.engines import load_engine_class

    spec = spec_of(model, random_weights)
    engine = load_engine_class("megatron")(spec, settings(dtype, device, ops, exp, spec))
    return engine.gpt


def strict_hf_model(
    model: str | Path = "qwen3-tiny",
    ops: str = "all",
    dtype: str = "bf16",
    device: str = "auto",
    exp: str | None = None,
    random_weights: bool = False,
    compute_dtype: str | None = None,
):
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

    spec = spec_of(model, random_weights)
    compute = check_dtype(compute_dtype) if compute_dtype is not None else None
    built = load_engine_class("hf")(spec, settings(dtype, device, ops, exp, spec)).model
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
        raise InputError(
            f"token_logprobs takes a model from strict_megatron_model or strict_hf_model, not {type(model).__name__}"
        )
    vocab = model.vocab_size if megatron else model.config.vocab_size
    limit = model.max_sequence_length if megatron else model.config.max_position_embeddings
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, (list, tuple)):
        raise InputError(
            f"sequences: a list of token-id sequences (lists of int or 1-D integer tensors), not "
            f"{type(sequences).__name__}"
        )
    seqs = [_token_ids(i, s, vocab, limit) for i, s in enumerate(sequences)]
    if not seqs:
        raise InputError("token_logprobs needs at least one sequence")
    device = next(model.parameters()).device
    b, t = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(b, t, dtype=torch.long)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], valid[i, : len(s)] = s, True
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
    return [rows[i, : len(s) - 1].cpu() for i, s in enumerate(seqs)]


def _token_ids(i: int, sequence, vocab: int, limit: int) -> torch.Tensor:
    """Sequence ``i`` as a 1-D int64 tensor. Raises InputError for what the model cannot score."""
    if isinstance(sequence, (str, bytes)):
        raise InputError(f"sequence {i} is text; give token ids (tokenize it first)")
    try:
        ids = torch.as_tensor(sequence)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise InputError(f"sequence {i}: not a list of token ids ({str(e).splitlines()[0]})") from None
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(
            f"sequence {i}: token ids must be one list (or 1-D tensor) of integers, not "
            f"{ids.dtype} of shape {tuple(ids.shape)}"
        )
    if len(ids) < 2:
        raise InputError(
            f"sequence {i} has {len(ids)} token(s); token_logprobs needs at least 2 (the first has no logprob)"
        )
    if len(ids) > limit:
        raise InputError(f"sequence {i} has {len(ids)} tokens, more than the model's {limit} positions; shorten it")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise InputError(f"sequence {i} has a token id outside the vocabulary [0, {vocab}); score ids of this model")
    return ids.long()
