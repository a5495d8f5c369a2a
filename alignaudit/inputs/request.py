"""What a run is asked to do, as one object: the model, the token ids, both engines, sampling.

Every command (compare, gate, bisect, rl, ablate) builds one ``Request`` from its options, validated before
any engine starts (alignaudit.pipelines.requests.build_request), and the pipeline functions take it whole, so no
command re-lists or hard-codes another's settings.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from alignaudit.errors import InputError
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.inputs.prompts import TokenBatch
from alignaudit.inputs.values import parse_json

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class EngineSettings:
    """What the user chose for one engine.

    Attributes:
        dtype: "bf16", "fp16" or "fp32": the dtype of weights and activations.
        device: "cpu" or "cuda".
        seed: seeds every RNG the engine uses (sampling in rollout mode).
        options: ``--train-opt`` / ``--infer-opt`` KEY=VALUE pairs, values parsed as JSON where they parse.
        strict: strict ops to swap in ("" none, "all", or a comma list of alignaudit.inputs.strict_ops.STRICT_OPS).
        lm_head_dtype: "model" (the lm_head runs in ``dtype``) or "fp32" (hidden states and lm_head weight
            cast to fp32 before the projection, as vLLM's ``head_dtype: float32`` and RL trainers do).
        strict_exp: the exp inside strict attention (alignaudit_kernels.attention.EXP_CHOICES): "portable"
            (the same bits on every backend) or "native" (the GPU's exp2 instruction: faster, the same bits
            only where one GPU architecture runs both engines; needs strict attention on CUDA).
        strict_attention: the strict attention kernel (alignaudit_kernels.attention.KERNELS): "portable" (the
            package's own, every backend) or "flash" (FlashAttention-3 at one key split; Hopper GPUs).
    """

    dtype: str = "bf16"
    device: str = "cpu"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    strict: str = ""
    lm_head_dtype: str = "model"
    strict_exp: str = "portable"
    strict_attention: str = "portable"

    @property
    def strict_ops(self) -> frozenset[str]:
        from alignaudit.inputs.strict_ops import parse_strict

        return parse_strict(self.strict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)


def parse_options(pairs: list[str] | None) -> dict[str, Any]:
    """``["a=1", "b=true", "c=eager"]`` -> ``{"a": 1, "b": True, "c": "eager"}`` (JSON where it parses).

    Raises:
        InputError: an item without ``=``.
    """
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"option {pair!r} is not KEY=VALUE (e.g. --infer-opt enforce_eager=true)")
        options[key] = _option_value(key, value)
    return options


def _option_value(key: str, value: str):
    """A KEY=VALUE option's value: JSON where it parses as JSON (true, 4, [1, 2], {...}), read one way
    (parse_json: a repeated key or an integer too long is refused); else the string itself (a path, a name)."""
    try:
        json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return value
    except ValueError:
        pass  # JSON with an integer too long for Python: parse_json says so
    return parse_json(value, f"option {key}")


@dataclass(frozen=True)
class EngineRun:
    """One side of a comparison: an engine name and its settings."""

    engine: str
    settings: EngineSettings

    def label(self) -> str:
        """``megatron (bf16, cpu, strict all)``: the engine as tables and progress lines name it."""
        strict = f", strict {self.settings.strict}" if self.settings.strict else ""
        exp = f", {self.settings.strict_exp} exp" if self.settings.strict_exp != "portable" else ""
        exp += ", flash attention" if self.settings.strict_attention == "flash" else ""
        head = ", fp32 lm_head" if self.settings.lm_head_dtype == "fp32" else ""
        return f"{self.engine} ({self.settings.dtype}, {self.settings.device}{strict}{exp}{head})"

    def record(self) -> dict:
        return {"engine": self.engine, **self.settings.to_dict()}


@dataclass(frozen=True)
class Sampling:
    """How the rollout engine samples and how the trainer replays it (RL trainers divide logits by the
    rollout temperature before the log-softmax; some apply the same top-k/top-p truncation).

    Attributes:
        max_new_tokens: tokens sampled per completion (at most, with ``stop_at_eos``).
        temperature: > 0. top_k: 0 = off. top_p: 1.0 = off.
        seed: request i is seeded with seed + i.
        group_size: completions per prompt, sampled as one request (vLLM's ``n``), as GRPO frameworks sample a
            group; the rollout's sequences are prompt 0's completions, then prompt 1's, ...
        stop_at_eos: EOS ends a completion (as frameworks sample); False: EOS neither stops nor is masked, so
            every completion has max_new_tokens tokens. None: the rollout engine's default (resolve_shape).
        prompt_logprobs: the rollout engine also records the prompt's logprobs (teacher-forced). False: the
            logprobs of the sampled tokens only, as frameworks ask for them; vLLM then reads its prefix cache,
            which it skips for a request that asks for prompt logprobs. None: the rollout engine's default.
        engine_mode: "offline": every request goes into the engine at once (vLLM's ``LLM``); "async": through
            the engine's asynchronous front end (vLLM's ``AsyncLLM``, the engine core in a process of its own, as
            verl, NeMo-RL and servers run it), request i arriving ``i * arrival_gap_s`` seconds after the first,
            so that requests join a batch that is already decoding.
        arrival_gap_s: seconds between two arrivals in async mode (>= 0); None in offline mode, where requests do
            not arrive one by one.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    group_size: int = 1
    stop_at_eos: bool | None = False
    prompt_logprobs: bool | None = True
    engine_mode: str = "offline"
    arrival_gap_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


REPLAYED = ("temperature", "top_k", "top_p")  # the sampling transform a trainer replays for processed logprobs


@dataclass(frozen=True)
class Replay:
    """The rollout's sampling transform, replayed by the trainer where the rollout engine recorded processed
    logprobs (vLLM's ``processed_logprobs``; alignaudit.engines.sampling): each generated token is scored under the
    same temperature, top-k and top-p. Built where the rollout is known (compare, rescore, capture --tokens-from,
    rl), sent to the trainer's worker as ``to_dict()`` and recorded in its manifest as such.

    Attributes:
        temperature: > 0. top_k: 0 = off. top_p: 1.0 = off (as Sampling).
        prompt_lengths: per sequence of the scored batch, its prompt's tokens: the generated rows start there.
    """

    temperature: float
    top_k: int
    top_p: float
    prompt_lengths: tuple[int, ...]

    @classmethod
    def of(cls, sampling: dict, prompt_lengths) -> Replay:
        """From a sampling record (Sampling.to_dict(), a capture's ``rollout``, a rollout file's sampling) and the
        prompt lengths. Raises KeyError for a record without temperature, top_k or top_p."""
        return cls(**{k: sampling[k] for k in REPLAYED}, prompt_lengths=tuple(prompt_lengths))

    @classmethod
    def from_dict(cls, record: dict | None) -> Replay | None:
        """``to_dict()``'s record back (None: nothing replayed)."""
        return None if record is None else cls.of(record, record["prompt_lengths"])

    def to_dict(self) -> dict:
        return {**asdict(self), "prompt_lengths": list(self.prompt_lengths)}

    def transform(self) -> dict:
        """The keyword arguments of alignaudit.engines.sampling's transform: temperature, top_k, top_p."""
        return {k: getattr(self, k) for k in REPLAYED}


ENGINE_MODES = ("offline", "async")
DEFAULT_ARRIVAL_GAP_S = 0.02


@dataclass(frozen=True)
class ISThresholds:
    """Importance-sampling thresholds of the IS diagnostics (alignaudit.comparison.importance), user settings.

    Attributes:
        tis: C, truncated IS: weights min(ratio, C), token and sequence level (verl's rollout_is_threshold,
            default 2.0; NeMo-RL's truncated_importance_sampling_ratio). ``--tis-threshold``.
        mask_low, mask_high: masked IS (IcePop) at token and sequence (product) level: a weight outside
            [low, high] is zeroed (verl's "lower_upper" rollout_is_threshold, preset 0.5_5.0; NeMo-RL's icepop,
            reference bounds 0.5-5). ``--mask-low`` / ``--mask-high``.
        geo_mask_low, geo_mask_high: the same for the per-sequence geometric mean ratio (verl's seq_mean_k1
            rejection, preset 0.999_1.001; NeMo-RL's seq-mask-tis, reference bounds 0.999-1.002).
            ``--geo-mask-low`` / ``--geo-mask-high``.
    """

    tis: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 5.0
    geo_mask_low: float = 0.999
    geo_mask_high: float = 1.001

    def check(self) -> ISThresholds:
        """Returns self; raises InputError naming the flag for a threshold no framework could use."""
        if isinstance(self.tis, bool) or not (
            isinstance(self.tis, (int, float)) and math.isfinite(self.tis) and self.tis > 0
        ):
            raise InputError(
                f"--tis-threshold {self.tis}: the truncation C must be a finite number > 0 (verl's default is 2.0)"
            )
        for flag, low, high, example in (
            ("mask", self.mask_low, self.mask_high, "0.5 and 5.0"),
            ("geo-mask", self.geo_mask_low, self.geo_mask_high, "0.999 and 1.001"),
        ):
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in (low, high)):
                raise InputError(f"--{flag}-low/--{flag}-high {low!r}, {high!r}: give numbers")
            if not (math.isfinite(low) and math.isfinite(high) and 0 <= low < high):
                raise InputError(
                    f"--{flag}-low {low} --{flag}-high {high}: the kept range needs 0 <= low < high, "
                    f"both finite (e.g. {example})"
                )
        return self

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    """A comparison to run.

    Attributes:
        spec: the checkpoint. batch: the prompts' token ids (identical for both engines).
        train, infer: the two engines; ``infer`` samples in rollout mode.
        rollout: None for prompt mode (teacher-forced prompts), else the sampling settings.
        clip_eps: PPO clip epsilon for the clip-fraction metric.
        importance: the thresholds of the importance-sampling diagnostics (summary.json's ``importance``).
        repeat: prompt mode: runs of each engine on the same token ids (alignaudit.workers.repeats); 1 = once.
        replay_routing: mixture-of-experts models, prompt mode: the train engine's router replays the infer
            engine's experts (alignaudit.engines.routing_replay), and the comparison is made with and without.
        full_vocab: prompt mode: each engine also records every scored position's full log-softmax row, and the
            comparison adds the divergence of the two distributions (alignaudit.comparison.vocab).
    """

    spec: ModelSpec
    batch: TokenBatch
    train: EngineRun
    infer: EngineRun
    rollout: Sampling | None = None
    clip_eps: float = 0.2
    repeat: int = 1
    replay_routing: bool = False
    full_vocab: bool = False
    importance: ISThresholds = field(default_factory=ISThresholds)

    @property
    def mode(self) -> str:
        return "rollout" if self.rollout else "prompt"

    @property
    def sampling(self) -> Sampling:
        """``rollout``, where only rollout mode makes sense (rl). Raises InputError in prompt mode."""
        if self.rollout is None:
            raise InputError("this runs rollout mode only (--mode rollout); the request is in prompt mode")
        return self.rollout

    def with_batch(self, batch: TokenBatch) -> Request:
        return replace(self, batch=batch)

    def record(self, command: str) -> dict:
        """The resolved configuration, as run.json records it first."""
        b = self.batch
        return {
            "command": command,
            "mode": self.mode,
            "rollout": self.rollout.to_dict() if self.rollout else None,
            "model": self.spec.to_dict(),
            "prompts": {
                "source": b.source,
                "sequences": len(b.sequences),
                "tokens": b.num_tokens,
                "digest": b.digest(),
            },
            "train": self.train.record(),
            "infer": self.infer.record(),
            "clip_eps": self.clip_eps,
            "importance": self.importance.to_dict(),
            "repeat": self.repeat,
            "replay_routing": self.replay_routing,
            "full_vocab": self.full_vocab,
        }
