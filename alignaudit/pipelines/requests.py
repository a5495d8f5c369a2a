"""The request builder: every option of a run, given on the command line (alignaudit.commands.options turns typer's
options into these groups), through the Python API (alignaudit.api) or by ``alignaudit rl`` (alignaudit.rl.request),
checked once, here, into the Request the pipelines trust. No typer: the API gets the CLI's checks by construction.

The groups are plain dataclasses; their defaults are the CLI's (the typer options add only flags and help).
Everything here validates input before any engine starts, so a bad option costs a second, not an engine run, and
fails with one line (errors.InputError) naming the flag as the CLI spells it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from alignaudit import errors
from alignaudit.capture import outdir
from alignaudit.engines import check_installed, kind_of
from alignaudit.engines.checks import (
    check_full_vocab,
    check_moe,
    check_parallel,
    check_routing_replay,
    check_runs,
    rollout_shape,
)
from alignaudit.inputs.capabilities import check_engine_features
from alignaudit.inputs.checkpoint import resolve_model
from alignaudit.inputs.prompts import load_prompts
from alignaudit.inputs.strict_ops import (
    check_kernel_switches,
    check_platform,
    check_strict_attention,
    check_strict_exp,
    format_strict,
    parse_strict,
)

if TYPE_CHECKING:
    from alignaudit.inputs.request import ISThresholds, Request

# torch and what imports it (inputs.request, workers.spawn) load where a check needs them: the CLI's --help and its
# one-line refusals of bad input stay fast (0.2 s, not 3).
DEFAULT_MODEL = "qwen3-tiny"


@dataclass
class ModelArgs:
    """Which checkpoint, and the seed of everything random."""

    model: str = DEFAULT_MODEL
    random_weights: bool = False
    seed: int = 0


@dataclass
class PromptArgs:
    """Where the token ids come from."""

    prompts: Path | None = None
    random_prompts: int | None = None
    prompt_len: int | None = None


@dataclass
class PairArgs:
    """The two engines and their settings."""

    train: str = "megatron"
    infer: str = "vllm"
    dtype: str = "bf16"
    train_dtype: str | None = None
    infer_dtype: str | None = None
    device: str = "auto"
    train_opt: list[str] | None = None
    infer_opt: list[str] | None = None
    strict: str | None = None
    strict_exp: str | None = None  # None: not given (the portable exp)
    strict_attention: str | None = None  # None: not given (the portable kernel)
    lm_head_dtype: str = "model"


@dataclass
class SamplingArgs:
    """Prompt or rollout mode, and how the rollout samples."""

    mode: str = "prompt"
    # None: not given (ROLLOUT_DEFAULTS in rollout mode); any value in prompt mode is refused, the default's too
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    group_size: int | None = None
    stop_at_eos: bool | None = None
    prompt_logprobs: bool | None = None
    engine_mode: str | None = None
    arrival_gap: float | None = None


@dataclass
class OutputArgs:
    """Where results go."""

    out: str | None = None
    force: bool = False
    verbose: bool = False


@dataclass
class ISArgs:
    """The thresholds of the importance-sampling diagnostics (summary.json's ``importance``; docs/rl-metrics.md).
    Defaults: verl's rollout_is_threshold 2.0, its IcePop preset 0.5_5.0 and its Geo-RS preset 0.999_1.001."""

    tis_threshold: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 5.0
    geo_mask_low: float = 0.999
    geo_mask_high: float = 1.001

    def thresholds(self) -> ISThresholds:
        """The checked ISThresholds. Raises InputError for C <= 0 or a range with low >= high."""
        from alignaudit.inputs.request import ISThresholds

        return ISThresholds(
            self.tis_threshold, self.mask_low, self.mask_high, self.geo_mask_low, self.geo_mask_high
        ).check()


GROUPS = (ModelArgs, PromptArgs, PairArgs, SamplingArgs, OutputArgs, ISArgs)


def resolve_model_arg(args: ModelArgs):
    """The ModelSpec of --model (alignaudit.inputs.checkpoint.resolve_model), after check_seed (every command
    resolves its model first). Raises InputError for a bad --seed or a model it cannot find or read."""
    check_seed(args.seed)
    return resolve_model(args.model, random_weights=args.random_weights, seed=args.seed)


def resolve_device(device: str) -> str:
    """ "cpu" or "cuda" for --device (auto: cuda where torch sees a GPU). Raises InputError for another name, for
    ROCm spellings (torch calls those GPUs cuda), and for cuda without a GPU."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device in ("hip", "rocm"):
        raise errors.InputError(f"--device {device}: torch names AMD (ROCm) GPUs cuda devices; pass --device cuda")
    if device not in ("cpu", "cuda"):
        raise errors.InputError(f"unknown device {device!r}; choose cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise errors.InputError("--device cuda: this torch build sees no CUDA GPU; use --device cpu")
    return device


def check_dtype(dtype: str) -> str:
    """``dtype`` if it is one of alignaudit.inputs.request.DTYPES (bf16, fp16, fp32), else InputError."""
    from alignaudit.inputs.request import DTYPES

    if dtype not in DTYPES:
        raise errors.InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


SEED_MAX = 2**32 - 1  # vLLM's bound (its engine config refuses others), numpy's too


def check_seed(seed: int) -> int:
    """``seed`` if it lies in [0, 2**32 - 1], else InputError (vLLM would refuse it only once its engine starts)."""
    if not 0 <= seed <= SEED_MAX:
        raise errors.InputError(f"--seed {seed}: a seed lies in [0, {SEED_MAX}]")
    return seed


def check_clip_eps(eps: float) -> float:
    """``eps`` if it lies in (0, 1) (the PPO clip range [1 - eps, 1 + eps]), else InputError."""
    if not 0 < eps < 1:
        raise errors.InputError(f"--clip-eps {eps}: the PPO clip epsilon must lie in (0, 1), e.g. 0.2")
    return eps


ROLLOUT_DEFAULTS = {"max_new_tokens": 32, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
SAMPLING_FLAGS = {
    "--max-new-tokens": "max_new_tokens",
    "--temperature": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--group-size": "group_size",
    "--stop-at-eos/--ignore-eos": "stop_at_eos",
    "--prompt-logprobs/--no-prompt-logprobs": "prompt_logprobs",
    "--engine-mode": "engine_mode",
    "--arrival-gap": "arrival_gap",
}


def sampling(args: SamplingArgs, seed: int):
    """The rollout Sampling of ``args``, or None in prompt mode. Raises InputError for a bad mode or value."""
    from alignaudit.inputs.request import DEFAULT_ARRIVAL_GAP_S, ENGINE_MODES, Sampling

    if args.mode not in ("prompt", "rollout"):
        raise errors.InputError(f"unknown --mode {args.mode!r}; choose prompt or rollout")
    if args.mode == "prompt":
        given = given_sampling_flags(args)
        if given:
            raise errors.InputError(
                f"{given[0]} applies to rollouts and would not take effect in prompt mode; add "
                f"--mode rollout or drop {given[0]}"
            )
        return None
    new, temperature, top_k, top_p = _sampled(args)
    group = 1 if args.group_size is None else args.group_size
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise errors.InputError(f"--group-size {group!r}: completions per prompt, an integer >= 1")
    for name in ("stop_at_eos", "prompt_logprobs"):
        if getattr(args, name) is not None and not isinstance(getattr(args, name), bool):
            raise errors.InputError(f"{name} {getattr(args, name)!r}: True, False or None (the engine's default)")
    engine_mode = "offline" if args.engine_mode is None else args.engine_mode
    if engine_mode not in ENGINE_MODES:
        raise errors.InputError(f"--engine-mode {engine_mode!r}: choose one of {', '.join(ENGINE_MODES)}")
    gap = args.arrival_gap
    if engine_mode != "async":
        if gap is not None:
            raise errors.InputError(
                "--arrival-gap spaces the arrivals of --engine-mode async and would not take "
                f"effect in {engine_mode} mode; add --engine-mode async or drop --arrival-gap"
            )
    elif gap is None:
        gap = DEFAULT_ARRIVAL_GAP_S
    elif isinstance(gap, bool) or not isinstance(gap, (int, float)) or not (0 <= gap < math.inf):
        raise errors.InputError(f"--arrival-gap {gap!r}: seconds between arrivals, a finite number >= 0")
    return Sampling(
        new,
        temperature,
        top_k,
        top_p,
        seed,
        group,
        args.stop_at_eos,
        args.prompt_logprobs,
        engine_mode,
        None if gap is None else float(gap),
    )


def given_sampling_flags(args: SamplingArgs) -> list[str]:
    """The rollout flags (SAMPLING_FLAGS) given a value, a default's included."""
    return [
        flag
        for flag, field in SAMPLING_FLAGS.items()
        if getattr(args, field) != SamplingArgs.__dataclass_fields__[field].default
    ]


def _sampled(args: SamplingArgs) -> tuple[int, float, int, float]:
    """(max_new_tokens, temperature, top_k, top_p) of a rollout, ROLLOUT_DEFAULTS where not given. Raises InputError
    naming the value out of range."""
    d = ROLLOUT_DEFAULTS
    new = int(d["max_new_tokens"]) if args.max_new_tokens is None else args.max_new_tokens
    temperature = d["temperature"] if args.temperature is None else args.temperature
    top_k = int(d["top_k"]) if args.top_k is None else args.top_k
    top_p = d["top_p"] if args.top_p is None else args.top_p
    if new < 1:
        raise errors.InputError(f"--max-new-tokens {new}: rollout mode samples 1 or more tokens per completion")
    if not 0 < temperature < math.inf:
        raise errors.InputError(f"--temperature {temperature}: rollout mode needs a finite temperature > 0")
    if top_k < 0:
        raise errors.InputError(f"--top-k {top_k}: 0 (off) or more")
    if not 0 < top_p <= 1:
        raise errors.InputError(f"--top-p {top_p}: in (0, 1] (1 = off)")
    return new, temperature, top_k, top_p


def check_top_k(rollout, spec) -> None:
    """Refuse a ``--top-k`` (``rollout.top_k``, a Sampling or None) that keeps every token of ``spec``'s vocabulary
    (``vocab_size`` rows of the LM head): it would sample as 0 (off) does while the run recorded a top-k.

    Raises:
        InputError: top_k >= spec.vocab_size.
    """
    if rollout is not None and rollout.top_k >= spec.vocab_size:
        raise errors.InputError(
            f"--top-k {rollout.top_k} keeps all {spec.vocab_size} tokens of {spec.name}'s "
            "vocabulary, the same as 0 (off); give a smaller value or 0"
        )


def engine_runs(pair: PairArgs, seed: int, spec, mode: str = "prompt", extra_check=None, trains: bool = False):
    """The two EngineRuns of a comparison, validated before anything starts: engines installed, dtypes,
    device, strict ops, every setting against what the engine implements (alignaudit.inputs.capabilities),
    ``extra_check(train, infer)`` (a command's own refusal, e.g. rl --full-vocab), and the engines' own
    configuration classes in a short worker (alignaudit.workers.spawn.check_options), last: it takes seconds.
    ``trains``: the command updates the trainer's weights (rl), so the strict ops' backward switch applies."""
    from alignaudit.inputs.request import EngineRun, EngineSettings, parse_options
    from alignaudit.workers.spawn import check_options

    check_installed(pair.train)
    check_installed(pair.infer)
    dev = resolve_device(pair.device)
    strict_ops = parse_strict(pair.strict)
    ops = format_strict(strict_ops)
    exp = check_strict_exp(pair.strict_exp, strict_ops, dev)
    dtypes = tuple(
        (flag if own else "--dtype", own or pair.dtype)
        for flag, own in (("--train-dtype", pair.train_dtype), ("--infer-dtype", pair.infer_dtype))
    )
    kernel = check_strict_attention(pair.strict_attention, strict_ops, dev, exp, dtypes, spec.head_dim, trains)
    check_kernel_switches(strict_ops, bool(spec.num_experts), trains, dev)
    if dev == "cuda" and (warning := check_platform(strict_ops)):
        print(warning, file=sys.stderr)
    if pair.lm_head_dtype not in ("model", "fp32"):
        raise errors.InputError(f"--lm-head-dtype {pair.lm_head_dtype!r}: choose model or fp32")
    runs = [
        EngineRun(
            name,
            EngineSettings(
                check_dtype(own or pair.dtype),
                dev,
                seed,
                parse_options(opts),
                strict=ops,
                lm_head_dtype=pair.lm_head_dtype,
                strict_exp=exp,
                strict_attention=kernel,
            ),
        )
        for name, own, opts in (
            (pair.train, pair.train_dtype, pair.train_opt),
            (pair.infer, pair.infer_dtype, pair.infer_opt),
        )
    ]
    check_engine_features(spec, (pair.train, pair.infer))
    check_moe(spec, runs)
    check_parallel(spec, runs, dev)
    check_runs(runs[0], runs[1], mode)
    if extra_check is not None:
        extra_check(runs[0], runs[1])
    check_options(runs, spec, mode)
    return runs


def load_batch(spec, args: PromptArgs, seed: int, engines, new_tokens: int = 0):
    """The TokenBatch, leaving room for ``new_tokens`` (rollout) and, with vLLM, one sampled token.

    Raises InputError for --prompt-len without --random-prompts (a --prompt-len below 2 is refused by load_prompts).
    """
    if args.prompt_len is not None and args.random_prompts is None:
        raise errors.InputError("--prompt-len applies to --random-prompts N; give both or neither")
    reserve = max(new_tokens, 1 if any(kind_of(e).reserves_a_token for e in engines) else 0)
    prompt_len = 64 if args.prompt_len is None else args.prompt_len
    return load_prompts(spec, args.prompts, args.random_prompts, prompt_len, seed, reserve=reserve)


def check_max_model_len(batch, runs: dict, new_tokens: int) -> None:
    """Refuse a vLLM ``max_model_len`` option (``runs``: flag -> EngineRun; "--train-opt" for the scoring side) that
    cannot hold a prompt and what follows it: the ``new_tokens`` a rollout samples, and the one token vLLM samples
    when it scores (prompt logprobs), which a trainer does after the sampled tokens. In prompt mode vLLM itself
    refuses such a request only once it runs it (VLLMValidationError "maximum context length"); in a rollout it would
    silently end completions at max_model_len (FINISHED_LENGTH_CAPPED), shorter than --max-new-tokens asks.

    Raises:
        InputError: naming the longest prompt, the option and the fix.
    """
    longest = max(range(len(batch.sequences)), key=lambda i: len(batch.sequences[i]))
    length = len(batch.sequences[longest])
    for flag, run in runs.items():
        limit = run.settings.options.get("max_model_len") if run.engine == "vllm" else None
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            continue  # absent, or -1 (fit to memory); other values are refused by the option check
        reserve = new_tokens + 1 if flag == "--train-opt" and new_tokens else max(new_tokens, 1)
        if length + reserve > limit:
            raise errors.InputError(
                f"prompt {longest} has {length} tokens plus {reserve} generated, longer than "
                f"{flag} max_model_len={limit}; raise it or shorten the prompts"
            )


def build_request(
    model: ModelArgs,
    prompts: PromptArgs,
    pair: PairArgs,
    sampling_args: SamplingArgs | None = None,
    clip_eps: float = 0.2,
    importance: ISArgs | None = None,
    extra_check=None,
    *,
    repeat: int = 1,
    replay_routing: bool = False,
    full_vocab: bool = False,
    trains: bool = False,
) -> Request:
    """Validate every option and build the Request (no engine starts here). ``extra_check``: see engine_runs.
    ``repeat`` (compare --repeat: runs per engine, prompt mode), ``replay_routing`` (--replay-routing) and
    ``full_vocab`` (--full-vocab) are checked against the engines and the mode (engines.checks); ``trains``: see
    engine_runs.

    Raises:
        InputError: any bad input, with the fix. EngineError: an engine is not installed.
    """
    from alignaudit.inputs.request import Request

    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise errors.InputError(f"--repeat {repeat!r}: give the number of runs per engine, 1 or more")
    if repeat > 1 and sampling_args is not None and sampling_args.mode != "prompt":
        raise errors.InputError("--repeat reruns teacher-forced prompts; use it in prompt mode (drop --mode rollout)")
    for flag, value in (("--replay-routing", replay_routing), ("--full-vocab", full_vocab)):
        if not isinstance(value, bool):
            raise errors.InputError(f"{flag} {value!r}: True or False")
    check_clip_eps(clip_eps)
    thresholds = (importance or ISArgs()).thresholds()
    rollout = sampling(sampling_args, model.seed) if sampling_args is not None else None
    spec = resolve_model_arg(model)
    check_top_k(rollout, spec)
    mode = "rollout" if rollout else "prompt"
    train, infer = engine_runs(pair, model.seed, spec, mode, extra_check, trains)
    if rollout is not None:
        rollout = rollout_shape(infer, rollout, spec)
    if replay_routing:
        check_routing_replay(spec, train, infer, mode, repeat)
    if full_vocab:
        check_full_vocab(train, infer, mode, replay_routing)
    batch = load_batch(spec, prompts, model.seed, (pair.train, pair.infer), rollout.max_new_tokens if rollout else 0)
    check_max_model_len(batch, {"--train-opt": train, "--infer-opt": infer}, rollout.max_new_tokens if rollout else 0)
    return Request(
        spec,
        batch,
        train,
        infer,
        rollout,
        clip_eps,
        importance=thresholds,
        repeat=repeat,
        replay_routing=replay_routing,
        full_vocab=full_vocab,
    )


def out_dir(output: OutputArgs, command: str, names: tuple[str, ...], inputs: tuple[Path, ...] = ()) -> Path:
    """Prepare the output directory (alignaudit.capture.outdir.prepare): ``--out`` or a fresh default name."""
    target = output.out if output.out is not None else outdir.default_out(command)
    return outdir.prepare(target, output.force, names, inputs)
