"""Shared CLI options (typer ``Annotated`` aliases, defined once) and the checks behind them.

Everything here validates input before any engine starts, so a bad option costs a second, not an
engine run, and fails with one line (errors.InputError).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer

from alignaudit import errors

DEFAULT_MODEL = "qwen3-tiny"

ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", metavar="MODEL",
    help="Checkpoint directory, hub id in the local HF cache, or preset name (Qwen3-0.6B ... Qwen3-32B) "
         "with --random-weights. Default: the embedded tiny Qwen3 fixture.")]
RandomWeightsOpt = Annotated[bool, typer.Option("--random-weights", metavar="",
                                                help="Synthesize a preset's checkpoint with random weights (once, cached).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights, random prompts and sampling.")]
PromptsOpt = Annotated[Optional[Path], typer.Option(
    "--prompts", metavar="FILE", help="Prompt file: JSONL with \"text\" or \"token_ids\", or plain text lines.")]
RandomPromptsOpt = Annotated[Optional[int], typer.Option("--random-prompts", metavar="N", help="Use N random token-id prompts instead.")]
PromptLenOpt = Annotated[Optional[int], typer.Option("--prompt-len", metavar="L", help="Tokens per random prompt (default 64).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32, for both engines.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda, or auto (cuda when available).")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", metavar="DIR",
                                                help="Output directory (default: alignaudit-runs/<command>-<time>).")]
ForceOpt = Annotated[bool, typer.Option("--force", metavar="", help="Reuse a non-empty --out directory (its alignaudit outputs are replaced).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", metavar="", help="Stream the engine workers' logs.")]
DebugOpt = Annotated[bool, typer.Option("--debug", metavar="", help="Show tracebacks on errors.")]
TrainOpt = Annotated[str, typer.Option("--train", metavar="ENGINE", help="Training engine: megatron, hf or vllm.")]
InferOpt = Annotated[str, typer.Option("--infer", metavar="ENGINE", help="Inference (rollout) engine: vllm, hf or megatron.")]
TrainDtypeOpt = Annotated[Optional[str], typer.Option("--train-dtype", metavar="DTYPE", help="Override --dtype for the training engine.")]
InferDtypeOpt = Annotated[Optional[str], typer.Option("--infer-dtype", metavar="DTYPE", help="Override --dtype for the inference engine.")]
TrainSettingOpt = Annotated[Optional[list[str]], typer.Option("--train-opt", metavar="KEY=VALUE",
                                                              help="Setting for the training engine (repeatable).")]
InferSettingOpt = Annotated[Optional[list[str]], typer.Option("--infer-opt", metavar="KEY=VALUE",
                                                              help="Setting for the inference engine (repeatable).")]
StrictOpt = Annotated[Optional[str], typer.Option(
    "--strict", metavar="[OPS]",
    help="Strict kernels in both engines: --strict alone for every op, or a subset for ablation, e.g. "
         "--strict rmsnorm,rope (ops: linear, rmsnorm, rope, silu, attention, logprobs).")]
LayersOpt = Annotated[Optional[str], typer.Option("--layers", metavar="RANGES", help="Layers to capture, e.g. 0-3,7 (default: all).")]
OpsOpt = Annotated[Optional[str], typer.Option("--ops", metavar="OPS", help="Canonical ops to capture, e.g. attn,o_proj (default: all).")]
ClipEpsOpt = Annotated[float, typer.Option("--clip-eps", metavar="EPS", help="PPO clip epsilon for the clip-fraction metric.")]


def fixtures_dir() -> Path:
    """The embedded fixtures (packaged as alignaudit_fixtures; the repository's fixtures/ folder)."""
    import alignaudit_fixtures

    return Path(alignaudit_fixtures.__file__).resolve().parent


def resolve_model_arg(model: str, random_weights: bool, seed: int):
    from alignaudit.models import resolve_model

    if model == DEFAULT_MODEL and not Path(model).exists():
        if random_weights:
            raise errors.InputError("--random-weights needs --model PRESET, e.g. --model Qwen3-0.6B --random-weights")
        model = str(fixtures_dir() / DEFAULT_MODEL)
    return resolve_model(model, random_weights=random_weights, seed=seed)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise errors.InputError(f"unknown device {device!r}; choose cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise errors.InputError("--device cuda: this torch build sees no CUDA GPU; use --device cpu")
    return device


def check_dtype(dtype: str) -> str:
    from alignaudit.engines.base import DTYPES

    if dtype not in DTYPES:
        raise errors.InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def check_clip_eps(eps: float) -> float:
    if not 0 < eps < 1:
        raise errors.InputError(f"--clip-eps {eps}: the PPO clip epsilon must lie in (0, 1), e.g. 0.2")
    return eps


def default_out(command: str) -> Path:
    return Path("alignaudit-runs") / f"{command}-{datetime.now():%Y%m%d-%H%M%S}"


def engine_runs(train, infer, dtype, train_dtype, infer_dtype, device, seed, train_opt, infer_opt, strict=None):
    """The two EngineRuns of a comparison, validated before anything starts."""
    from alignaudit.engines import check_installed
    from alignaudit.engines.base import EngineSettings, parse_options
    from alignaudit.pipeline import EngineRun
    from alignaudit.runner import check_options
    from alignaudit.strict import format_strict, parse_strict

    check_installed(train), check_installed(infer)
    dev = resolve_device(device)
    ops = format_strict(parse_strict(strict))
    runs = [
        EngineRun(name, EngineSettings(check_dtype(own or dtype), dev, seed, parse_options(opts), strict=ops))
        for name, own, opts in ((train, train_dtype, train_opt), (infer, infer_dtype, infer_opt))
    ]
    check_options([(run.engine, run.settings.options) for run in runs])
    return runs


def load_batch(spec, prompts, random_prompts, prompt_len, seed, engines, new_tokens: int = 0):
    """The TokenBatch, leaving room for ``new_tokens`` (rollout) and, with vLLM, one sampled token.

    Raises InputError for --prompt-len without --random-prompts.
    """
    from alignaudit.prompts import load_prompts

    if prompt_len is not None and random_prompts is None:
        raise errors.InputError("--prompt-len applies to --random-prompts N; give both or neither")
    reserve = max(new_tokens, 1 if "vllm" in engines else 0)
    return load_prompts(spec, prompts, random_prompts, prompt_len or 64, seed, reserve=reserve)
