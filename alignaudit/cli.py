"""The ``alignaudit`` command line: thin typer commands over the library, rendered with rich.

Exit codes: 0 success, 1 alignment failure (gate), 2 usage or input error, 3 engine failure.
Errors print one line; ``--debug`` (anywhere on the command line) shows the traceback.
"""

from __future__ import annotations

import sys
import traceback
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from alignaudit import errors

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    help="Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP.",
)
console = Console()
err_console = Console(stderr=True)

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"
DEFAULT_MODEL = "qwen3-tiny"

# Shared options, defined once.
ModelOpt = Annotated[str, typer.Option(
    "--model", "-m",
    help="Checkpoint directory, hub id in the local HF cache, or preset name (Qwen3-0.6B ... Qwen3-32B) "
         "with --random-weights. Default: the embedded tiny Qwen3 fixture.")]
RandomWeightsOpt = Annotated[bool, typer.Option("--random-weights", help="Synthesize a preset's checkpoint with random weights (once, cached).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for random weights, random prompts and sampling.")]
PromptsOpt = Annotated[Optional[Path], typer.Option("--prompts", help="Prompt file: JSONL with \"text\" or \"token_ids\", or plain text lines.")]
RandomPromptsOpt = Annotated[Optional[int], typer.Option("--random-prompts", help="Use N random token-id prompts instead.")]
PromptLenOpt = Annotated[int, typer.Option("--prompt-len", help="Length of each random prompt, in tokens.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="bf16, fp16 or fp32, for both engines.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, or auto (cuda when available).")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Output directory (default: alignaudit-runs/<command>-<time>).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Write into a non-empty --out directory.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Stream the engine workers' logs.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]


def resolve_model_arg(model: str, random_weights: bool, seed: int):
    from alignaudit.models import resolve_model

    if model == DEFAULT_MODEL and not Path(model).exists():
        model = str(FIXTURES_DIR / DEFAULT_MODEL)
    return resolve_model(model, random_weights=random_weights, seed=seed)


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise errors.InputError(f"unknown device {device!r}; choose cpu, cuda or auto")
    return device


def check_dtype(dtype: str) -> str:
    from alignaudit.engines.base import DTYPES

    if dtype not in DTYPES:
        raise errors.InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def default_out(command: str) -> Path:
    return Path("alignaudit-runs") / f"{command}-{datetime.now():%Y%m%d-%H%M%S}"


@app.callback()
def _root() -> None:
    """Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP."""


TrainOpt = Annotated[str, typer.Option("--train", help="Training engine: megatron, hf or vllm.")]
InferOpt = Annotated[str, typer.Option("--infer", help="Inference (rollout) engine: vllm, hf or megatron.")]
TrainDtypeOpt = Annotated[Optional[str], typer.Option("--train-dtype", help="Override --dtype for the training engine.")]
InferDtypeOpt = Annotated[Optional[str], typer.Option("--infer-dtype", help="Override --dtype for the inference engine.")]
TrainSettingOpt = Annotated[Optional[list[str]], typer.Option("--train-opt", help="KEY=VALUE setting for the training engine (repeatable).")]
InferSettingOpt = Annotated[Optional[list[str]], typer.Option("--infer-opt", help="KEY=VALUE setting for the inference engine (repeatable).")]
StrictOpt = Annotated[Optional[str], typer.Option(
    "--strict", help="Strict kernels in both engines: --strict alone for every op, or a subset for ablation, "
                     "e.g. --strict rmsnorm,rope (ops: linear, rmsnorm, rope, silu, attention, logprobs).")]
LayersOpt = Annotated[Optional[str], typer.Option("--layers", help="Layers to capture, e.g. 0-3,7 (default: all).")]
OpsOpt = Annotated[Optional[str], typer.Option("--ops", help="Canonical ops to capture, e.g. attn,o_proj (default: all).")]


def engine_runs(train, infer, dtype, train_dtype, infer_dtype, device, seed, train_opt, infer_opt, strict=None):
    """The two EngineRuns of a comparison, validated before anything starts."""
    from alignaudit.engines import check_installed
    from alignaudit.engines.base import EngineSettings, parse_options
    from alignaudit.pipeline import EngineRun
    from alignaudit.strict import format_strict, parse_strict

    check_installed(train), check_installed(infer)
    dev = resolve_device(device)
    ops = format_strict(parse_strict(strict))
    return [
        EngineRun(name, EngineSettings(check_dtype(own or dtype), dev, seed, parse_options(opts), strict=ops))
        for name, own, opts in ((train, train_dtype, train_opt), (infer, infer_dtype, infer_opt))
    ]


@app.command()
def compare(
    model: ModelOpt = DEFAULT_MODEL,
    train: TrainOpt = "megatron",
    infer: InferOpt = "vllm",
    dtype: DtypeOpt = "bf16",
    train_dtype: TrainDtypeOpt = None,
    infer_dtype: InferDtypeOpt = None,
    device: DeviceOpt = "auto",
    train_opt: TrainSettingOpt = None,
    infer_opt: InferSettingOpt = None,
    strict: StrictOpt = None,
    mode: Annotated[str, typer.Option("--mode", help="prompt (teacher-forced prompts) or rollout (the inference "
                                                       "engine samples, the training engine rescores).")] = "prompt",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Rollout mode: tokens sampled per prompt.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="Rollout mode: sampling temperature.")] = 1.0,
    prompts: PromptsOpt = None,
    random_prompts: RandomPromptsOpt = None,
    prompt_len: PromptLenOpt = 64,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    clip_eps: Annotated[float, typer.Option("--clip-eps", help="PPO clip epsilon for the clip-fraction metric.")] = 0.2,
    out: OutOpt = None,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run the same token ids through a training and an inference engine and compare per-token logprobs.

    Prompt mode (default): every prompt token after the first gets a teacher-forced logprob from each engine
    (fp32). Rollout mode, the RL path: the inference engine samples --max-new-tokens per prompt (seeded,
    EOS ignored) and records each sampled token's logprob while decoding; the training engine rescores
    prompt + completion in one pass. Reports bitwise mismatches, ULP distances and the RL impact
    (importance ratio, clip fraction, token_mult_prob_error, probability differences, KL).
    Writes tokens.parquet and summary.json to --out.

    Examples:
      alignaudit compare                                     # tiny fixture, megatron vs vllm, bf16
      alignaudit compare --dtype fp32 --train megatron --infer hf
      alignaudit compare --model Qwen3-0.6B --random-weights --random-prompts 2 --prompt-len 64
      alignaudit compare --train vllm --infer vllm --infer-opt enforce_eager=true   # self-consistency
      alignaudit compare --strict --mode rollout --max-new-tokens 32                 # strict kernels, RL path
    """
    from alignaudit.pipeline import TOKENS, compare as run_compare, prepare_output
    from alignaudit.prompts import load_prompts
    from alignaudit.report import render_comparison

    if mode not in ("prompt", "rollout"):
        raise errors.InputError(f"unknown --mode {mode!r}; choose prompt or rollout")
    if mode == "rollout" and (max_new_tokens < 1 or temperature <= 0):
        raise errors.InputError("rollout mode needs --max-new-tokens >= 1 and --temperature > 0")
    runs = engine_runs(train, infer, dtype, train_dtype, infer_dtype, device, seed, train_opt, infer_opt, strict)
    spec = resolve_model_arg(model, random_weights, seed)
    batch = load_prompts(spec, prompts, random_prompts, prompt_len, seed)
    out_dir = prepare_output(out or default_out("compare"), force)
    with console.status("") as status:
        rollout = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed} if mode == "rollout" else None
        summary = run_compare(spec, batch, runs[0], runs[1], out_dir, clip_eps=clip_eps, stream_log=verbose,
                              on_stage=status.update, rollout=rollout)
    import pandas as pd

    render_comparison(console, summary, pd.read_parquet(out_dir / TOKENS))
    console.print(f"results: {out_dir}/summary.json, {out_dir}/tokens.parquet")


@app.command()
def bisect(
    model: ModelOpt = DEFAULT_MODEL,
    train: TrainOpt = "megatron",
    infer: InferOpt = "vllm",
    mode: Annotated[str, typer.Option("--mode", help="natural, forced, or both.")] = "both",
    layers: LayersOpt = None,
    ops: OpsOpt = None,
    dtype: DtypeOpt = "bf16",
    train_dtype: TrainDtypeOpt = None,
    infer_dtype: InferDtypeOpt = None,
    device: DeviceOpt = "auto",
    train_opt: TrainSettingOpt = None,
    infer_opt: InferSettingOpt = None,
    strict: StrictOpt = None,
    prompts: PromptsOpt = None,
    random_prompts: RandomPromptsOpt = None,
    prompt_len: PromptLenOpt = 64,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    out: OutOpt = None,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Find the ops where two engines compute differently, layer by layer, down to the ULP.

    Both engines run the same token ids with every canonical op captured (embed; per layer input_norm,
    q/k/v_proj, q/k_norm, q/k_rope, attn, o_proj, attn_residual, post_attn_norm, gate/up_proj, act,
    down_proj, mlp_residual; final_norm, logits, logprobs), converted to one layout, and compared bit by bit.

    [bold]natural[/] mode: both engines run freely. Differences accumulate downstream; the table marks the
    first op whose outputs differ, with its worst element in decimal and hex.

    [bold]forced[/] mode: the inference engine runs again with every op's inputs replaced by the training
    engine's captured values (converted to its layout). Each op's difference is then its own, so the table
    lists every op that computes differently, not only the first: what you need to fix all causes at once.

    vLLM is captured in eager mode with prefix caching off (hooks cannot see inside torch.compile graphs),
    so its numbers here can differ from a compiled `compare` run.

    Examples:
      alignaudit bisect --train megatron --infer hf --dtype bf16
      alignaudit bisect --train hf --infer vllm --mode forced --layers 0-1 --ops q_rope,k_rope,attn
    """
    from alignaudit.ops import parse_selection
    from alignaudit.pipeline import bisect as run_bisect, prepare_output
    from alignaudit.prompts import load_prompts
    from alignaudit.report import render_bisect

    runs = engine_runs(train, infer, dtype, train_dtype, infer_dtype, device, seed, train_opt, infer_opt, strict)
    spec = resolve_model_arg(model, random_weights, seed)
    selection = parse_selection(layers, ops, spec.num_layers)
    batch = load_prompts(spec, prompts, random_prompts, prompt_len, seed)
    out_dir = prepare_output(out or default_out("bisect"), force)
    with console.status("") as status:
        result = run_bisect(spec, batch, runs[0], runs[1], out_dir, selection, mode=mode, stream_log=verbose,
                            on_stage=status.update)
    render_bisect(console, result)
    console.print(f"results: {out_dir}/bisect.json, {out_dir}/ops-*.parquet")


@app.command()
def capture(
    engine: Annotated[str, typer.Option("--engine", "-e", help="megatron, vllm or hf.")] = "megatron",
    model: ModelOpt = DEFAULT_MODEL,
    dtype: DtypeOpt = "bf16",
    device: DeviceOpt = "auto",
    opt: Annotated[Optional[list[str]], typer.Option("--opt", help="KEY=VALUE engine setting (repeatable).")] = None,
    layers: LayersOpt = None,
    ops: OpsOpt = None,
    no_ops: Annotated[bool, typer.Option("--no-ops", help="Logprobs only, no per-op tensors.")] = False,
    reference: Annotated[Optional[Path], typer.Option("--reference", help="Forced mode: feed every op this capture's inputs.")] = None,
    strict: StrictOpt = None,
    prompts: PromptsOpt = None,
    random_prompts: RandomPromptsOpt = None,
    prompt_len: PromptLenOpt = 64,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    out: OutOpt = None,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run one engine and write its capture: manifest, logprobs and (by default) every canonical op.

    Make one capture where each engine lives (e.g. in the vLLM container, then in the Megatron
    container), then compare them anywhere with `alignaudit diff`.

    Examples:
      alignaudit capture --engine vllm --out runs/vllm
      alignaudit capture --engine megatron --layers 0-1 --ops attn,o_proj --out runs/megatron
      alignaudit diff runs/megatron runs/vllm
    """
    from alignaudit.capture import read_capture
    from alignaudit.engines.base import EngineSettings, parse_options
    from alignaudit.ops import parse_selection
    from alignaudit.pipeline import EngineRun, capture as run_capture, prepare_output
    from alignaudit.prompts import load_prompts

    run = engine_runs(engine, engine, dtype, None, None, device, seed, opt, None, strict)[0]
    spec = resolve_model_arg(model, random_weights, seed)
    selection = None if no_ops else parse_selection(layers, ops, spec.num_layers)
    if reference is not None:
        if selection is None:
            raise errors.InputError("--reference needs op capture; drop --no-ops")
        ref = read_capture(reference)
        if "ops" not in ref.manifest:
            raise errors.InputError(f"--reference {reference} has no per-op tensors; capture it without --no-ops")
    batch = load_prompts(spec, prompts, random_prompts, prompt_len, seed)
    if reference is not None and ref.manifest["prompts"]["digest"] != batch.digest():
        raise errors.InputError(f"--reference {reference} was made on other token ids; use the same prompts")
    out_dir = prepare_output(out or default_out(f"capture-{engine}"), force)
    with console.status(f"running {run.label()}"):
        result = run_capture(spec, batch, run, out_dir, stream_log=verbose, ops=selection, reference=reference)
    ops_info = result.manifest.get("ops")
    console.print(f"capture of {escape(run.label())}: {batch.num_tokens} tokens in {len(batch.sequences)} sequences"
                  + (f", {ops_info['ops']} ops ({ops_info['bytes'] / 2**20:.1f} MiB)" if ops_info else "")
                  + f" -> {out_dir}", highlight=False)


@app.command()
def diff(
    train_dir: Annotated[Path, typer.Argument(help="Capture directory playing the training engine.")],
    infer_dir: Annotated[Path, typer.Argument(help="Capture directory playing the inference engine.")],
    out: OutOpt = None,
    force: ForceOpt = False,
    clip_eps: Annotated[float, typer.Option("--clip-eps", help="PPO clip epsilon for the clip-fraction metric.")] = 0.2,
    debug: DebugOpt = False,
) -> None:
    """Compare two captures made anywhere: logprobs, and every op when both captured ops.

    Refuses captures of different checkpoints or token ids.
    """
    import pandas as pd

    from alignaudit.capture import read_capture
    from alignaudit.opdiff import first_divergence
    from alignaudit.pipeline import TOKENS, diff_captures, diff_ops, prepare_output, write_ops
    from alignaudit.report import render_comparison, render_ops

    a, b = read_capture(train_dir), read_capture(infer_dir)
    out_dir = prepare_output(out or default_out("diff"), force)
    summary = diff_captures(a, b, out_dir, clip_eps=clip_eps)
    render_comparison(console, summary, pd.read_parquet(out_dir / TOKENS))
    if "ops" in a.manifest and "ops" in b.manifest:
        records = diff_ops(a, b)
        write_ops(records, out_dir / "ops.parquet")
        mode = b.manifest["ops"].get("mode", "natural")
        render_ops(console, records, mode, first_divergence(records))
    console.print(f"results: {out_dir}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the typer app, turn library errors into one line and an exit code."""
    args = _optional_values(sys.argv[1:] if argv is None else list(argv), {"--strict": "all"})
    debug = "--debug" in args
    try:
        result = app(args=args, standalone_mode=False, prog_name="alignaudit")
        return result if isinstance(result, int) else errors.EXIT_OK
    except errors.AlignAuditError as e:
        if debug:
            traceback.print_exc()
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("interrupted")
        return 130
    except Exception as e:
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # click/typer usage errors
            if type(e).__name__ == "NoArgsIsHelpError":
                console.print(e.ctx.get_help(), highlight=False)
                return errors.EXIT_OK
            err_console.print(f"[bold red]error:[/] {escape(e.format_message())}", highlight=False, soft_wrap=True)
            return errors.EXIT_USAGE
        return _unexpected(e, debug)


def _optional_values(args: list[str], defaults: dict[str, str]) -> list[str]:
    """Let ``--strict`` stand alone: insert its default value when no value follows it."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg in defaults and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append(defaults[arg])
    return out


def _unexpected(e: Exception, debug: bool) -> int:
    """An unexpected bug: one line unless --debug."""
    if debug:
        traceback.print_exc()
    err_console.print(f"[bold red]error:[/] unexpected {type(e).__name__}: {escape(str(e))} (run with --debug for the traceback)",
                      highlight=False, soft_wrap=True)
    return errors.EXIT_ENGINE


def entrypoint() -> None:
    sys.exit(main())
