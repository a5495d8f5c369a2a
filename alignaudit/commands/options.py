"""Shared CLI options, defined once as option groups, and the checks that turn them into a Request.

An option group is a dataclass whose fields are typer ``Annotated`` options. A command declares a
parameter of a group's type and ``@grouped`` expands it into the group's options on the command line, then
hands the command one instance:

    @app.command()
    @grouped
    def compare(run: RunArgs, sampling: SamplingArgs, output: OutputArgs, clip_eps: ClipEpsOpt = 0.2): ...

Everything here validates input before any engine starts, so a bad option costs a second, not an engine
run, and fails with one line (errors.InputError).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from alignaudit import errors

DEFAULT_MODEL = "qwen3-tiny"

ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", metavar="MODEL",
    help="Checkpoint directory, hub id in the local HF cache, or preset name with --random-weights "
         "(Qwen3-0.6B ... Qwen3-32B, Qwen2.5-0.5B/1.5B/7B, Llama-3.2-1B/3B, Llama-3.1-8B, Qwen3-30B-A3B), or an "
         "embedded fixture: qwen3-tiny (the default), qwen2-tiny, llama-tiny, qwen3-moe-tiny.")]
RandomWeightsOpt = Annotated[bool, typer.Option("--random-weights", metavar="",
                                                help="Synthesize a preset's checkpoint with random weights "
                                                "(once, cached).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights, random prompts and sampling.")]
PromptsOpt = Annotated[Optional[Path], typer.Option(
    "--prompts", metavar="FILE", help="Prompt file: JSONL with \"text\" or \"token_ids\", or plain text lines.")]
RandomPromptsOpt = Annotated[Optional[int], typer.Option("--random-prompts", metavar="N",
                                                         help="Use N random token-id prompts instead.")]
PromptLenOpt = Annotated[Optional[int], typer.Option("--prompt-len", metavar="L",
                                                     help="Tokens per random prompt (default 64).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32, for both engines.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda, or auto (cuda when available).")]
# A string, not a Path: typer turns "" into Path("."), and an empty --out must be refused, not read as ".".
OutOpt = Annotated[Optional[str], typer.Option("--out", "-o", metavar="DIR",
                                                help="Output directory (default: alignaudit-runs/COMMAND-TIME).")]
ForceOpt = Annotated[bool, typer.Option("--force", metavar="",
                                        help="Reuse a non-empty --out directory: alignaudit's own earlier outputs "
                                             "there are replaced, nothing else is touched.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="Stream the engine workers' logs.")]
DebugOpt = Annotated[bool, typer.Option("--debug", metavar="", help="Show tracebacks on errors.")]
TrainOpt = Annotated[str, typer.Option("--train", metavar="ENGINE", help="Training engine: megatron, hf or vllm.")]
InferOpt = Annotated[str, typer.Option("--infer", metavar="ENGINE",
                                       help="Inference (rollout) engine: vllm, hf or megatron.")]
TrainDtypeOpt = Annotated[Optional[str], typer.Option("--train-dtype", metavar="DTYPE",
                                                      help="Override --dtype for the training engine.")]
InferDtypeOpt = Annotated[Optional[str], typer.Option("--infer-dtype", metavar="DTYPE",
                                                      help="Override --dtype for the inference engine.")]
TrainSettingOpt = Annotated[Optional[list[str]], typer.Option("--train-opt", metavar="KEY=VALUE",
                                                              help="Setting for the training engine (repeatable).")]
InferSettingOpt = Annotated[Optional[list[str]], typer.Option("--infer-opt", metavar="KEY=VALUE",
                                                              help="Setting for the inference engine (repeatable).")]
StrictOpt = Annotated[Optional[str], typer.Option(
    "--strict", metavar="[OPS]",
    help="Strict kernels in both engines: --strict alone for every op, or a subset for ablation, e.g. "
         "--strict rmsnorm,rope (ops: linear, rmsnorm, rope, silu, attention, logprobs).")]
StrictExpOpt = Annotated[str, typer.Option(
    "--strict-exp", metavar="EXP",
    help="The exp inside strict attention, in both engines: portable (default; the same bits on the CPU and every "
         "GPU) or native (the GPU's exp2 instruction: faster, the same bits only where one GPU architecture runs "
         "both engines; CUDA, hf and megatron).")]
LmHeadOpt = Annotated[str, typer.Option("--lm-head-dtype", metavar="DTYPE", help="model (the lm_head in --dtype) or "
                                        "fp32 (hidden states and lm_head cast to fp32, as RL trainers and vLLM's "
                                        "head_dtype do), for both engines.")]
LayersOpt = Annotated[Optional[str], typer.Option("--layers", metavar="RANGES",
                                                  help="Layers to capture, e.g. 0-3,7 (default: all).")]
OpsOpt = Annotated[Optional[str], typer.Option("--ops", metavar="OPS", help="Canonical ops to capture, e.g. "
                                                "attn,o_proj (default: all; a mixture-of-experts model has router, "
                                                "routing, moe for gate_proj, up_proj, act, down_proj).")]
ClipEpsOpt = Annotated[float, typer.Option("--clip-eps", metavar="EPS",
                                           help="PPO clip epsilon: the clip-fraction metric's range, and in rl "
                                                "also the clip range of the loss.")]
TisThresholdOpt = Annotated[float, typer.Option(
    "--tis-threshold", metavar="C", help="Importance-sampling diagnostics: the truncation C of truncated IS, token and "
                                         "sequence level (verl's rollout_is_threshold; > 0).")]
MaskLowOpt = Annotated[float, typer.Option("--mask-low", metavar="L", help="Importance-sampling diagnostics: masked "
                                           "IS (IcePop) keeps token and sequence ratios in [L, H] (0 <= L < H).")]
MaskHighOpt = Annotated[float, typer.Option("--mask-high", metavar="H", help="The upper end of --mask-low's range.")]
GeoMaskLowOpt = Annotated[float, typer.Option("--geo-mask-low", metavar="L", help="Importance-sampling diagnostics: "
                                              "the geometric-mean sequence mask (NeMo-RL seq-mask-tis, verl Geo-RS) "
                                              "keeps sequences whose exp(mean log ratio) lies in [L, H].")]
GeoMaskHighOpt = Annotated[float, typer.Option("--geo-mask-high", metavar="H",
                                               help="The upper end of --geo-mask-low's range.")]
ModeOpt = Annotated[str, typer.Option("--mode", metavar="MODE", help="prompt (teacher-forced prompts) or rollout "
                                      "(the inference engine samples, the training engine rescores).")]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", metavar="N",
                                              help="Rollout: tokens sampled per prompt.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", metavar="T",
                                               help="Rollout: sampling temperature (> 0). With --infer-opt "
                                               "logprobs_mode=processed_logprobs the trainer replays it.")]
TopKOpt = Annotated[int, typer.Option("--top-k", metavar="K", help="Rollout: sample from the K most likely tokens "
                                      "(0 = off); replayed by the trainer with processed logprobs.")]
TopPOpt = Annotated[float, typer.Option("--top-p", metavar="P", help="Rollout: nucleus sampling (1.0 = off); replayed "
                                        "by the trainer with processed logprobs.")]
GroupSizeOpt = Annotated[Optional[int], typer.Option("--group-size", metavar="G", help="Rollout: completions per "
                                                     "prompt, sampled as one request (vLLM's n), as GRPO frameworks "
                                                     "sample a group (default 1).", show_default=False)]
StopAtEosOpt = Annotated[Optional[bool], typer.Option("--stop-at-eos/--ignore-eos", metavar="", help="Rollout: "
                                                      "EOS ends a completion, as frameworks sample (vLLM's default), "
                                                      "or is ignored, so every completion has --max-new-tokens "
                                                      "tokens (hf's default, the only shape it samples).",
                                                      show_default=False)]
PromptLogprobsOpt = Annotated[Optional[bool], typer.Option("--prompt-logprobs/--no-prompt-logprobs", metavar="",
                                                           help="Rollout: the rollout engine records the prompt's "
                                                           "logprobs too (hf's default), or the sampled tokens' only, "
                                                           "as frameworks do (vLLM's default; vLLM then reads its "
                                                           "prefix cache).", show_default=False)]
EngineModeOpt = Annotated[Optional[str], typer.Option("--engine-mode", metavar="MODE", help="Rollout: offline (every "
                                                      "request into vLLM's LLM at once; the default) or async "
                                                      "(vLLM's AsyncLLM, its engine core in a process of its own, "
                                                      "requests arriving one every --arrival-gap seconds while "
                                                      "earlier ones decode).", show_default=False)]
ArrivalGapOpt = Annotated[Optional[float], typer.Option("--arrival-gap", metavar="S", help="Rollout, --engine-mode "
                                                        "async: seconds between two requests' arrivals (default "
                                                        "0.02).", show_default=False)]


@dataclass
class ModelArgs:
    """Which checkpoint, and the seed of everything random."""

    model: ModelOpt = DEFAULT_MODEL
    random_weights: RandomWeightsOpt = False
    seed: SeedOpt = 0


@dataclass
class PromptArgs:
    """Where the token ids come from."""

    prompts: PromptsOpt = None
    random_prompts: RandomPromptsOpt = None
    prompt_len: PromptLenOpt = None


@dataclass
class PairArgs:
    """The two engines and their settings."""

    train: TrainOpt = "megatron"
    infer: InferOpt = "vllm"
    dtype: DtypeOpt = "bf16"
    train_dtype: TrainDtypeOpt = None
    infer_dtype: InferDtypeOpt = None
    device: DeviceOpt = "auto"
    train_opt: TrainSettingOpt = None
    infer_opt: InferSettingOpt = None
    strict: StrictOpt = None
    strict_exp: StrictExpOpt = "portable"
    lm_head_dtype: LmHeadOpt = "model"


@dataclass
class SamplingArgs:
    """Prompt or rollout mode, and how the rollout samples."""

    mode: ModeOpt = "prompt"
    max_new_tokens: MaxNewTokensOpt = 32
    temperature: TemperatureOpt = 1.0
    top_k: TopKOpt = 0
    top_p: TopPOpt = 1.0
    group_size: GroupSizeOpt = None
    stop_at_eos: StopAtEosOpt = None
    prompt_logprobs: PromptLogprobsOpt = None
    engine_mode: EngineModeOpt = None
    arrival_gap: ArrivalGapOpt = None


@dataclass
class OutputArgs:
    """Where results go."""

    out: OutOpt = None
    force: ForceOpt = False
    verbose: VerboseOpt = False


@dataclass
class ISArgs:
    """The thresholds of the importance-sampling diagnostics (summary.json's ``importance``; docs/rl-metrics.md).
    Defaults: verl's rollout_is_threshold 2.0, its IcePop preset 0.5_5.0 and its Geo-RS preset 0.999_1.001."""

    tis_threshold: TisThresholdOpt = 2.0
    mask_low: MaskLowOpt = 0.5
    mask_high: MaskHighOpt = 5.0
    geo_mask_low: GeoMaskLowOpt = 0.999
    geo_mask_high: GeoMaskHighOpt = 1.001

    def thresholds(self):
        """The checked ISThresholds. Raises InputError for C <= 0 or a range with low >= high."""
        from alignaudit.inputs.request import ISThresholds

        return ISThresholds(self.tis_threshold, self.mask_low, self.mask_high, self.geo_mask_low,
                            self.geo_mask_high).check()


GROUPS = (ModelArgs, PromptArgs, PairArgs, SamplingArgs, OutputArgs, ISArgs)


def grouped(fn):
    """Expand parameters annotated with an option group into the group's options (typer reads
    ``__signature__``), add ``--debug`` (read by cli.main), and call ``fn`` with one instance per group."""
    hints = typing.get_type_hints(fn, include_extras=True)
    groups, expanded = {}, []
    for name, param in inspect.signature(fn).parameters.items():  # in signature order, groups expanded in place
        cls = hints.get(name)
        if cls in GROUPS:
            groups[name] = cls
            field_hints = typing.get_type_hints(cls, include_extras=True)
            expanded += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                           annotation=field_hints[f.name]) for f in dataclasses.fields(cls)]
        else:
            expanded.append(param.replace(annotation=hints.get(name, param.annotation),
                                          kind=inspect.Parameter.KEYWORD_ONLY))
    expanded.append(inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=DebugOpt))

    @functools.wraps(fn)
    def wrapper(**kwargs):
        kwargs.pop("debug", None)
        for name, cls in groups.items():
            kwargs[name] = cls(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(cls)})
        return fn(**kwargs)

    wrapper.__signature__ = inspect.Signature(expanded)
    return wrapper


def field_names(*groups: type) -> list[str]:
    return [f.name for cls in groups for f in dataclasses.fields(cls)]


def given_options(ctx: typer.Context, names: list[str]) -> list[str]:
    """Of ``names``, the parameters the user gave on the command line (not left at their defaults)."""
    default = type(ctx.get_parameter_source(names[0])).DEFAULT if names else None
    return [n for n in names if ctx.get_parameter_source(n) not in (None, default)]


def resolve_model_arg(args: ModelArgs):
    from alignaudit.inputs.checkpoint import resolve_model

    return resolve_model(args.model, random_weights=args.random_weights, seed=args.seed)


def resolve_device(device: str) -> str:
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
    from alignaudit.inputs.request import DTYPES

    if dtype not in DTYPES:
        raise errors.InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def check_clip_eps(eps: float) -> float:
    if not 0 < eps < 1:
        raise errors.InputError(f"--clip-eps {eps}: the PPO clip epsilon must lie in (0, 1), e.g. 0.2")
    return eps


SAMPLING_FLAGS = {"--max-new-tokens": "max_new_tokens", "--temperature": "temperature", "--top-k": "top_k",
                  "--top-p": "top_p", "--group-size": "group_size", "--stop-at-eos/--ignore-eos": "stop_at_eos",
                  "--prompt-logprobs/--no-prompt-logprobs": "prompt_logprobs", "--engine-mode": "engine_mode",
                  "--arrival-gap": "arrival_gap"}


def sampling(args: SamplingArgs, seed: int):
    """The rollout Sampling of ``args``, or None in prompt mode. Raises InputError for a bad mode or value."""
    from alignaudit.inputs.request import DEFAULT_ARRIVAL_GAP_S, ENGINE_MODES, Sampling

    if args.mode not in ("prompt", "rollout"):
        raise errors.InputError(f"unknown --mode {args.mode!r}; choose prompt or rollout")
    if args.mode == "prompt":
        given = [flag for flag, field in SAMPLING_FLAGS.items()
                 if getattr(args, field) != SamplingArgs.__dataclass_fields__[field].default]
        if given:
            raise errors.InputError(f"{given[0]} applies to rollouts and would not take effect in prompt mode; add "
                                    f"--mode rollout or drop {given[0]}")
        return None
    if args.max_new_tokens < 1 or not args.temperature > 0:
        raise errors.InputError("rollout mode needs --max-new-tokens >= 1 and --temperature > 0")
    if args.top_k < 0 or not 0 < args.top_p <= 1:
        raise errors.InputError("--top-k must be >= 0 (0 = off) and --top-p in (0, 1] (1 = off)")
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
            raise errors.InputError("--arrival-gap spaces the arrivals of --engine-mode async and would not take "
                                    f"effect in {engine_mode} mode; add --engine-mode async or drop --arrival-gap")
    elif gap is None:
        gap = DEFAULT_ARRIVAL_GAP_S
    elif isinstance(gap, bool) or not isinstance(gap, (int, float)) or not (0 <= gap < math.inf):
        raise errors.InputError(f"--arrival-gap {gap!r}: seconds between arrivals, a finite number >= 0")
    return Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, seed, group,
                    args.stop_at_eos, args.prompt_logprobs, engine_mode, None if gap is None else float(gap))


def engine_runs(pair: PairArgs, seed: int, spec, mode: str = "prompt", extra_check=None):
    """The two EngineRuns of a comparison, validated before anything starts: engines installed, dtypes,
    device, strict ops, every setting against what the engine implements (alignaudit.inputs.capabilities),
    ``extra_check(train, infer)`` (a command's own refusal, e.g. rl --full-vocab), and the engines' own
    configuration classes in a short worker (alignaudit.workers.spawn.check_options), last: it takes seconds."""
    from alignaudit.engines import check_installed
    from alignaudit.engines.checks import check_moe, check_parallel, check_runs
    from alignaudit.inputs.capabilities import check_engine_features
    from alignaudit.inputs.request import EngineRun, EngineSettings, parse_options
    from alignaudit.inputs.strict_ops import check_platform, check_strict_exp, format_strict, parse_strict
    from alignaudit.workers.spawn import check_options

    check_installed(pair.train), check_installed(pair.infer)
    dev = resolve_device(pair.device)
    strict_ops = parse_strict(pair.strict)
    ops = format_strict(strict_ops)
    exp = check_strict_exp(pair.strict_exp, strict_ops, dev)
    if dev == "cuda" and (warning := check_platform(strict_ops)):
        typer.echo(warning, err=True)
    if pair.lm_head_dtype not in ("model", "fp32"):
        raise errors.InputError(f"--lm-head-dtype {pair.lm_head_dtype!r}: choose model or fp32")
    runs = [
        EngineRun(name, EngineSettings(check_dtype(own or pair.dtype), dev, seed, parse_options(opts), strict=ops,
                                       lm_head_dtype=pair.lm_head_dtype, strict_exp=exp))
        for name, own, opts in ((pair.train, pair.train_dtype, pair.train_opt),
                                (pair.infer, pair.infer_dtype, pair.infer_opt))
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
    from alignaudit.engines import kind_of
    from alignaudit.inputs.prompts import load_prompts

    if args.prompt_len is not None and args.random_prompts is None:
        raise errors.InputError("--prompt-len applies to --random-prompts N; give both or neither")
    reserve = max(new_tokens, 1 if any(kind_of(e).reserves_a_token for e in engines) else 0)
    prompt_len = 64 if args.prompt_len is None else args.prompt_len
    return load_prompts(spec, args.prompts, args.random_prompts, prompt_len, seed, reserve=reserve)


def build_request(model: ModelArgs, prompts: PromptArgs, pair: PairArgs, sampling_args: SamplingArgs | None = None,
                  clip_eps: float = 0.2, importance: ISArgs | None = None, extra_check=None):
    """Validate every option and build the Request (no engine starts here). ``extra_check``: see engine_runs.

    Raises:
        InputError: any bad input, with the fix. EngineError: an engine is not installed.
    """
    from alignaudit.inputs.request import Request

    check_clip_eps(clip_eps)
    thresholds = (importance or ISArgs()).thresholds()
    rollout = sampling(sampling_args, model.seed) if sampling_args is not None else None
    spec = resolve_model_arg(model)
    train, infer = engine_runs(pair, model.seed, spec, "rollout" if rollout else "prompt", extra_check)
    if rollout is not None:
        from alignaudit.engines.checks import rollout_shape

        rollout = rollout_shape(infer, rollout)
    batch = load_batch(spec, prompts, model.seed, (pair.train, pair.infer), rollout.max_new_tokens if rollout else 0)
    return Request(spec, batch, train, infer, rollout, clip_eps, importance=thresholds)


def out_dir(output: OutputArgs, command: str, names: tuple[str, ...], inputs: tuple[Path, ...] = ()) -> Path:
    """Prepare the output directory (alignaudit.capture.outdir.prepare): ``--out`` or a fresh default name."""
    from alignaudit.capture import outdir

    target = output.out if output.out is not None else outdir.default_out(command)
    return outdir.prepare(target, output.force, names, inputs)
