"""The protocol every engine adapter implements, and the settings they share.

An adapter wraps one inference or training stack (transformers, Megatron-Core, vLLM) behind two calls:
build the model from a ModelSpec, and return teacher-forced per-token logprobs for a TokenBatch. Heavy
imports stay inside each adapter module, so the rest of alignaudit imports on any machine.
"""

from __future__ import annotations

import difflib
import types
import typing
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from alignaudit.engines.weight_transfer import checksums, load_and_check
from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.request import EngineSettings, Replay


def applied_exp(model: torch.nn.Module) -> str | None:
    """The exp that ``model``'s strict attention modules compute with, read back from the modules (their
    ``strict_exp``) for the manifest; None when no module computes strict attention."""
    found = {str(m.strict_exp) for m in model.modules() if getattr(m, "strict_attention", False)}
    return ",".join(sorted(found)) or None


def applied_kernel(model: torch.nn.Module) -> str | None:
    """The kernel that ``model``'s strict attention modules compute with (alignaudit_kernels.attention.KERNELS), read
    back from the modules (their ``strict_kernel``) for the manifest; None when no module computes strict attention."""
    found = {getattr(m, "strict_kernel", "portable") for m in model.modules() if getattr(m, "strict_attention", False)}
    return ",".join(sorted(found)) or None


def require_flash(settings: EngineSettings, spec: ModelSpec) -> None:
    """Where ``settings`` ask for the flash attention kernel, refuse a GPU or build that cannot run it, as the engine
    loads (the parent checked everything it can without a CUDA context: alignaudit.inputs.strict_ops).

    Raises:
        InputError: alignaudit_kernels.attention.flash_unavailable's reason."""
    if settings.strict_attention != "flash" or "attention" not in settings.strict_ops:
        return
    from alignaudit_kernels.attention import flash_unavailable

    if reason := flash_unavailable(settings.device, settings.torch_dtype, spec.head_dim):
        raise InputError(f"--strict-attention flash: {reason}")


def fp32_head(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, strict: bool) -> torch.Tensor:
    """The lm_head in fp32: both operands cast to fp32, then one projection (torch's, or the strict kernel).
    The cast-then-project form of vLLM's LogitsProcessor._apply_head (vllm/model_executor/layers/
    logits_processor.py) for a head_dtype above the model dtype."""
    args = (x.float(), weight.float(), None if bias is None else bias.float())
    if strict:
        import alignaudit_kernels as K

        return K.linear(*args)
    return torch.nn.functional.linear(*args)


def int_option(options: dict[str, Any], key: str, default: int, minimum: int = 1) -> int:
    """An integer engine option; InputError names the key and the expectation."""
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"option {key}={value!r}: expected an integer >= {minimum}")
    return value


def first_lines(e: BaseException, limit: int = 400) -> str:
    """An exception message's non-empty lines joined by ": ", cut at ``limit`` characters (one line)."""
    return ": ".join(line.strip() for line in str(e).splitlines() if line.strip())[:limit]


def reject_unknown(engine: str, options: dict[str, Any], known: set[str], hint: str) -> None:
    """Raise InputError for option keys the engine does not understand, with where to look them up."""
    unknown = sorted(set(options) - known)
    if unknown:
        guesses = [g for key in unknown for g in difflib.get_close_matches(key, known, n=1)]
        guess = f" (did you mean {', '.join(guesses)}?)" if guesses else ""
        raise InputError(f"{engine} does not understand option(s) {', '.join(unknown)}{guess}; {hint}")


def reject_wrong_types(engine: str, options: dict[str, Any], annotations: dict[str, Any]) -> None:
    """Raise InputError for an option whose value does not fit the engine's declared field type.

    ``annotations``: field name -> type annotation (e.g. ``dataclasses.fields(EngineArgs)``). Only the
    annotations ``value_fits`` understands are checked; the engine judges the rest when it loads.
    """
    for key, value in options.items():
        annotation = annotations.get(key)
        if annotation is not None and value_fits(value, annotation) is False:
            raise InputError(
                f"option {key}={value!r}: {engine} expects {_describe(annotation)} "
                f'(values are parsed as JSON: true, 4, 0.5, "text")'
            )


def value_fits(value: Any, annotation: Any) -> bool | None:
    """Whether ``value`` fits ``annotation``; None when the annotation is not one of bool, int, float, str,
    None, Literal[...] or unions of them (then nothing is claimed). bool is not an int here."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        fits = [value_fits(value, a) for a in typing.get_args(annotation)]
        return True if True in fits else None if None in fits else False
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    return None


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(
        annotation, str(annotation)
    )


class Engine(ABC):
    """One engine, loaded with one checkpoint, in the worker process."""

    name: ClassVar[str]
    # batch-major engines (hf, megatron): their micro_batch_size option (micro_batch_option), read by batched_logprobs
    micro_batch_size: int | str

    def __init__(self, spec: ModelSpec, settings: EngineSettings):
        self.check_options(settings.options)
        self.spec = spec
        self.settings = settings
        self.tap = None
        self.hooks = None
        self.progress = lambda done, total: None  # the worker points this at its progress lines
        # Trainer side of a processed-logprobs rollout: generated tokens are scored under the sampling transform
        # (alignaudit.inputs.request.Replay, alignaudit.engines.sampling).
        self.replay: Replay | None = None
        # compare --replay-routing: layer -> sequence -> the rollout engine's experts, int64 [tokens, top_k]
        # (alignaudit.engines.routing_replay); the trainer's router takes them instead of its own top-k.
        self.routing_replay: dict[int, dict[int, torch.Tensor]] | None = None
        # compare --full-vocab: receives (seq, float32 rows [len - 1, V]) for each sequence prompt_logprobs scores,
        # each row the engine's whole log-softmax at that position (alignaudit.capture.vocab_rows). In rollout()
        # (rl --full-vocab): (i, float32 rows [max_new_tokens, V]) per request, the rows its sampled tokens'
        # logprobs were gathered from while decoding.
        self.vocab_sink = None

    @classmethod
    @abstractmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise InputError for an option the engine does not understand or cannot take. Imports the
        engine's own config classes, nothing heavier, so the parent can check both sides before either
        engine starts (alignaudit.workers.spawn.check_options)."""

    @classmethod  # noqa: B027 (nothing to check by default)
    def check_config(cls, spec: ModelSpec, settings: EngineSettings, role: str, mode: str) -> None:
        """Build the engine's own configuration for ``spec`` and ``settings`` (``role`` train or infer,
        ``mode`` prompt or rollout) without loading anything, so a combination the engine rejects is an
        input error before any engine runs (default: nothing)."""

    def attach(self, tap) -> None:
        """Capture canonical ops through ``tap`` (alignaudit.engines.taps.Tap) during the next forward passes."""
        self.tap = tap
        self.hooks = self.install_taps(tap)

    @abstractmethod
    def install_taps(self, tap):
        """Register the engine's hook points on ``tap``; return the alignaudit.engines.taps.Hooks to undo them."""

    def set_spans(self, rows: list[int], lengths: list[int]) -> None:
        """For batch-major engines: micro-batch row j holds all ``lengths[j]`` tokens of sequence ``rows[j]``."""
        if self.tap is not None:
            from alignaudit.engines.taps import RowSpan

            self.tap.spans = [
                RowSpan(seq=r, pos_start=0, length=n, batch_row=j)
                for j, (r, n) in enumerate(zip(rows, lengths, strict=True))
            ]

    @abstractmethod
    def prompt_logprobs(self, batch: TokenBatch) -> list[torch.Tensor]:
        """Teacher-forced logprobs: for each sequence s, a float32 tensor of shape [len(s) - 1] whose
        element t-1 is log p(s[t] | s[:t]), computed the way this engine computes it in production. With
        ``replay`` set, the generated tokens' logprobs are those of the sampling transform's distribution."""

    def vocab_row_formula(self) -> str:
        """How this engine computes the full-vocabulary rows it gives ``vocab_sink``, in words (the manifest's
        ``vocab.rows``). Raises InputError for an engine that cannot give them."""
        raise InputError(f"{self.name} cannot give full-vocabulary rows; drop --full-vocab")

    def batched_logprobs(self, batch: TokenBatch) -> list[torch.Tensor]:
        """``micro_batch_logprobs`` over the micro-batches of ``batch`` (``micro_batch_size`` option), in the
        grad mode of the caller; reports progress. For batch-major engines (hf, megatron)."""
        results: dict[int, torch.Tensor] = {}
        groups = micro_batches(batch, self.micro_batch_size)
        self.micro_batches_run = len(groups)
        done = 0
        for rows in groups:
            seqs = [batch.sequences[r] for r in rows]
            for r, lp in zip(rows, self.micro_batch_logprobs(rows, seqs), strict=True):
                results[r] = lp if lp.requires_grad else lp.cpu()
            done += len(rows)
            self.progress(done, len(batch.sequences))
        return [results[r] for r in range(len(batch.sequences))]

    def micro_batch_logprobs(self, rows: list[int], seqs: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """One forward pass over ``seqs`` (batch rows ``rows`` of the whole batch): each sequence's fp32
        logprobs [len - 1], on the engine's device, with gradient when grad mode is on."""
        raise NotImplementedError(f"{self.name} is not a batch-major engine")

    def replay_routing(self, routing: dict[int, dict[int, torch.Tensor]], lengths: list[int]) -> None:
        """Route every token of the next forward passes to the experts of ``routing`` (layer -> sequence ->
        int64 [len, top_k], the rollout engine's choice; ``lengths``: the batch's sequence lengths, checked
        against it) instead of the engine's own top-k (alignaudit.engines.routing_replay).

        Raises:
            InputError: the engine cannot replay routing, or ``routing`` does not fit the model and batch.
        """
        raise InputError(f"{self.name} cannot replay MoE routing; use --train megatron or --train hf")

    def replay_rows(self, row: int, length: int):
        """(slice of next-token logits rows to replay, sampling transform kwargs) for batch row ``row`` of
        a sequence of ``length`` tokens, or None when nothing is replayed."""
        if self.replay is None:
            return None
        from alignaudit.engines.sampling import generated_rows

        rows = generated_rows(self.replay.prompt_lengths[row], length)
        return (rows, self.replay.transform()) if rows.stop > rows.start else None

    def rollout(self, batch: TokenBatch, sampling) -> tuple[TokenBatch, list[torch.Tensor]]:
        """Sample up to ``sampling.max_new_tokens`` after each prompt (alignaudit.inputs.request.Sampling:
        temperature, top-k, top-p, and the shape the engine's kind resolved: group size, EOS, prompt logprobs,
        engine mode); request i seeded with ``sampling.seed + i``.

        Returns the full sequences (prompt + completion) and, per sequence, fp32 logprobs [len - 1]: the
        prompt positions teacher-forced, the generated positions as recorded while sampling (decode).
        """
        raise InputError(f"{self.name} cannot sample rollouts; use --infer vllm or --infer hf with --mode rollout")

    @classmethod  # noqa: B027 (nothing to prepare by default)
    def prepare_for_weight_updates(cls) -> None:
        """Called before the engine is built in a process that will load new weights into it (rl's workers).
        Nothing to do unless the engine frees, once loaded, what a later load needs."""

    def start(self, max_len: int, total_tokens: int, max_seqs: int | None = None, engine_mode: str = "offline") -> None:
        """Size a long-lived engine (rl) for sequences of up to ``max_len`` tokens, ``total_tokens`` per call and
        ``max_seqs`` sequences at once, and build it for ``engine_mode`` (Sampling.engine_mode). Engines that need
        no sizing are ready when built.

        Raises:
            InputError: an engine_mode other than "offline" for an engine without an asynchronous front end.
        """
        if engine_mode != "offline":
            raise InputError(f"{self.name} has no asynchronous front end; use --engine-mode offline")

    def training(self, lr: float, clip_grad: float, offload_fraction: float, adam):
        """This engine's model made trainable (alignaudit.engines.training): its gradients and optimizer. ``adam``:
        the optimizer class for parameters the engine has none of its own for. Raises ValueError for an
        optimizer offload the engine cannot do."""
        from alignaudit.engines.training import PlainTraining

        return PlainTraining(self, lr, clip_grad, offload_fraction, adam)

    def hf_weights(self, diverged: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, in HF names (rl's weight sync). ``diverged`` collects
        replicated parameters whose tensor-parallel copies differ (engines with no ranks of their own add none).
        """
        raise NotImplementedError(f"{self.name} does not give its weights in HF names")

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """New weights (HF names) into the running engine (rl's weight sync)."""
        raise NotImplementedError(f"{self.name} does not load weights while running")

    def stale_packed_layers(self) -> list[str]:
        """Layers whose packed GEMM does not compute with their current weight; [] for engines that pack none."""
        return []

    def weight_checksums(self) -> dict[str, str]:
        """sha256 of every weight the engine computes with, in HF names (weight_transfer.checksums)."""
        return checksums(self.hf_weights())

    def sync_weights(self, transport: str, path: str | None = None, handles: str | None = None) -> dict:
        """The trainer's weights into this engine, measured and checked (weight_transfer.load_and_check: the reply
        rl's loop reads). Engines whose model runs in another process (vLLM in async mode) run it there."""
        return load_and_check(self.hf_weights, self.load_weights, self.stale_packed_layers, transport, path, handles)

    @abstractmethod
    def settings_record(self) -> dict:
        """Every setting that reached the engine (resolved defaults included), JSON-serializable."""

    def close(self) -> None:
        """Remove hooks and release engine resources."""
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None


AUTO_BATCH_ROWS = 64
AUTO_BATCH_TOKENS = 8192


def micro_batch_option(options: dict[str, Any]) -> int | str:
    """``micro_batch_size``: an integer >= 1, or "auto" (the default; see ``micro_batches``).

    Raises:
        InputError: anything else.
    """
    value = options.get("micro_batch_size", "auto")
    if value == "auto":
        return value
    return int_option(options, "micro_batch_size", 1)


def micro_batches(batch: TokenBatch, size: int | str) -> list[list[int]]:
    """Indices of the sequences of each forward pass.

    An integer ``size``: consecutive sequences, ``size`` at a time, right-padded to the longest (what a
    trainer's micro-batch does). "auto": sequences of equal length only, in order of first appearance,
    up to ``AUTO_BATCH_ROWS`` rows and ``AUTO_BATCH_TOKENS`` tokens per pass, so nothing is padded and
    every sequence's attention runs over its own length. Padding changes fp32 bits here (the built-in
    prompts: 5 of 176 hf tokens, 4 megatron tokens); equal-length batches gave the same bits as one
    sequence at a time, fp32 and bf16, hf and megatron (tests/engines/test_engines.py; AMD EPYC with AVX-512 BF16,
    2026-11-29).
    """
    n = len(batch.sequences)
    if isinstance(size, int):  # else "auto"
        if size < 1:
            raise InputError(f"micro_batch_size must be >= 1, got {size}")
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    by_length: dict[int, list[int]] = {}
    for i, seq in enumerate(batch.sequences):
        by_length.setdefault(len(seq), []).append(i)
    groups = []
    for length, rows in by_length.items():
        step = max(1, min(AUTO_BATCH_ROWS, AUTO_BATCH_TOKENS // length))
        groups += [rows[i : i + step] for i in range(0, len(rows), step)]
    return groups


def right_padded(sequences: list[tuple[int, ...]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack sequences into ``ids`` [batch, max_len] (int64, right-padded with ``pad_id``) and
    ``valid`` [batch, max_len] (bool, False on padding). Right padding keeps causal attention of real
    tokens unchanged: no real token can see a pad token."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.int64)
    valid = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        valid[row, : len(seq)] = True
    return ids, valid
