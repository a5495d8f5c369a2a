"""The ``alignaudit`` command line: thin typer commands over the library, rendered with rich.

Exit codes (docs/cli.md): 0 success, 1 alignment failure (gate), 2 usage or input error, 3 engine
failure. Errors print one line; ``--debug`` (anywhere on the command line) shows the traceback.
"""

from __future__ import annotations

import json
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from alignaudit import errors
from alignaudit.cliargs import (
    DEFAULT_MODEL, ClipEpsOpt, DebugOpt, DeviceOpt, DtypeOpt, ForceOpt, InferDtypeOpt, InferOpt, InferSettingOpt,
    LayersOpt, ModelOpt, OpsOpt, OutOpt, PromptLenOpt, PromptsOpt, RandomPromptsOpt, RandomWeightsOpt, SeedOpt,
    StrictOpt, TrainDtypeOpt, TrainOpt, TrainSettingOpt, VerboseOpt, check_clip_eps, default_out, engine_runs,
    load_batch, resolve_model_arg,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP.",
)
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP."""


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
    mode: Annotated[str, typer.Option("--mode", metavar="MODE", help="prompt (teacher-forced prompts) or rollout "
                                      "(the inference engine samples, the training engine rescores).")] = "prompt",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N", help="Rollout mode: tokens sampled per prompt.")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", metavar="T", help="Rollout mode: sampling temperature.")] = 1.0,
    prompts: PromptsOpt = None,
    random_prompts: RandomPromptsOpt = None,
    prompt_len: PromptLenOpt = None,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    clip_eps: ClipEpsOpt = 0.2,
    out: OutOpt = None,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run the same token ids through a training and an inference engine and compare per-token logprobs.

    Prompt mode (default): every prompt token after the first gets a teacher-forced logprob from each
    engine (fp32). Rollout mode, the RL path: the inference engine samples --max-new-tokens per prompt
    (seeded, EOS ignored) and records each sampled token's logprob while decoding; the training engine
    rescores prompt + completion in one pass. Reports bitwise mismatches, ULP distances and the RL impact
    (importance ratio, clip fraction, token_mult_prob_error, probability differences, KL). Writes
    tokens.parquet and summary.json to --out. The exit code is 0 whatever the result; `alignaudit gate`
    turns results into a CI verdict.

    Examples:

    ```
    alignaudit compare                  # fixture, megatron vs vllm, bf16
    alignaudit compare --dtype fp32 --train megatron --infer hf
    alignaudit compare --strict --mode rollout --max-new-tokens 32
    alignaudit compare --model Qwen3-0.6B --random-weights \\
        --random-prompts 2 --prompt-len 64
    alignaudit compare --train vllm --infer vllm \\
        --infer-opt enforce_eager=true  # self-consistency
    ```
    """
    from alignaudit.pipeline import TOKENS
    from alignaudit.report import render_comparison

    check_clip_eps(clip_eps)
    out_dir, summary = _run_compare(model, train, infer, dtype, train_dtype, infer_dtype, device, train_opt, infer_opt,
                                    strict, mode, max_new_tokens, temperature, prompts, random_prompts, prompt_len,
                                    random_weights, seed, clip_eps, out or default_out("compare"), force, verbose)
    import pandas as pd

    render_comparison(console, summary, pd.read_parquet(out_dir / TOKENS))
    console.print(f"results: {out_dir}/summary.json, {out_dir}/tokens.parquet")


def _run_compare(model, train, infer, dtype, train_dtype, infer_dtype, device, train_opt, infer_opt, strict, mode,
                 max_new_tokens, temperature, prompts, random_prompts, prompt_len, random_weights, seed, clip_eps,
                 out, force, verbose):
    """Validate everything, then run compare into ``out``; returns (out, summary)."""
    from alignaudit.pipeline import compare as run_compare, prepare_output

    if mode not in ("prompt", "rollout"):
        raise errors.InputError(f"unknown --mode {mode!r}; choose prompt or rollout")
    if mode == "rollout" and (max_new_tokens < 1 or temperature <= 0):
        raise errors.InputError("rollout mode needs --max-new-tokens >= 1 and --temperature > 0")
    runs = engine_runs(train, infer, dtype, train_dtype, infer_dtype, device, seed, train_opt, infer_opt, strict)
    spec = resolve_model_arg(model, random_weights, seed)
    rollout = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed} if mode == "rollout" else None
    batch = load_batch(spec, prompts, random_prompts, prompt_len, seed, (train, infer), max_new_tokens if rollout else 0)
    out_dir = prepare_output(out, force)
    with console.status("") as status:
        summary = run_compare(spec, batch, runs[0], runs[1], out_dir, clip_eps=clip_eps, stream_log=verbose,
                              on_stage=status.update, rollout=rollout)
    return out_dir, summary


@app.command()
def bisect(
    model: ModelOpt = DEFAULT_MODEL,
    train: TrainOpt = "megatron",
    infer: InferOpt = "vllm",
    mode: Annotated[str, typer.Option("--mode", metavar="MODE", help="natural, forced, or both.")] = "both",
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
    prompt_len: PromptLenOpt = None,
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
    down_proj, mlp_residual; final_norm, logits, logprobs), converted to one layout, and compared bit
    by bit.

    **natural** mode: both engines run freely. Differences accumulate downstream; the table marks the
    first op whose outputs differ, with its worst element in decimal and hex.

    **forced** mode: the inference engine runs again with every op's inputs replaced by the training
    engine's captured values (converted to its layout). Each op's difference is then its own, so the
    table lists every op that computes differently, not only the first: what you need to fix all causes
    at once.

    vLLM is captured in eager mode with prefix caching off (hooks cannot see inside torch.compile
    graphs), so its numbers here can differ from a compiled `compare` run.

    Examples:

    ```
    alignaudit bisect --train megatron --infer hf --dtype bf16
    alignaudit bisect --train hf --infer vllm --mode forced \\
        --layers 0-1 --ops q_rope,k_rope,attn
    ```
    """
    from alignaudit.ops import parse_selection
    from alignaudit.pipeline import MODES, bisect as run_bisect, prepare_output
    from alignaudit.report import render_bisect

    if mode not in MODES:
        raise errors.InputError(f"unknown bisect mode {mode!r}; choose one of {', '.join(MODES)}")
    runs = engine_runs(train, infer, dtype, train_dtype, infer_dtype, device, seed, train_opt, infer_opt, strict)
    spec = resolve_model_arg(model, random_weights, seed)
    selection = parse_selection(layers, ops, spec.num_layers)
    batch = load_batch(spec, prompts, random_prompts, prompt_len, seed, (train, infer))
    out_dir = prepare_output(out or default_out("bisect"), force)
    with console.status("") as status:
        result = run_bisect(spec, batch, runs[0], runs[1], out_dir, selection, mode=mode, stream_log=verbose,
                            on_stage=status.update)
    render_bisect(console, result)
    console.print(f"results: {out_dir}/bisect.json, {out_dir}/ops-*.parquet")


@app.command()
def capture(
    engine: Annotated[str, typer.Option("--engine", "-e", metavar="ENGINE", help="megatron, vllm or hf.")] = "megatron",
    model: ModelOpt = DEFAULT_MODEL,
    dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32.")] = "bf16",
    device: DeviceOpt = "auto",
    opt: Annotated[Optional[list[str]], typer.Option("--opt", metavar="KEY=VALUE", help="Engine setting (repeatable).")] = None,
    layers: LayersOpt = None,
    ops: OpsOpt = None,
    no_ops: Annotated[bool, typer.Option("--no-ops", metavar="", help="Logprobs only, no per-op tensors.")] = False,
    reference: Annotated[Optional[Path], typer.Option("--reference", metavar="DIR",
                                                      help="Forced mode: feed every op this capture's values.")] = None,
    strict: StrictOpt = None,
    prompts: PromptsOpt = None,
    random_prompts: RandomPromptsOpt = None,
    prompt_len: PromptLenOpt = None,
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

    ```
    alignaudit capture --engine vllm --out runs/vllm
    alignaudit capture --engine megatron --layers 0-1 --ops attn,o_proj \\
        --out runs/megatron
    alignaudit diff runs/megatron runs/vllm
    ```
    """
    from alignaudit.capture import read_capture
    from alignaudit.ops import parse_selection
    from alignaudit.pipeline import capture as run_capture, prepare_output

    run = engine_runs(engine, engine, dtype, None, None, device, seed, opt, None, strict)[0]
    spec = resolve_model_arg(model, random_weights, seed)
    selection = None if no_ops else parse_selection(layers, ops, spec.num_layers)
    batch = load_batch(spec, prompts, random_prompts, prompt_len, seed, (engine,))
    out_dir = out or default_out(f"capture-{engine}")
    if reference is not None:
        if selection is None:
            raise errors.InputError("--reference needs op capture; drop --no-ops")
        if Path(reference).resolve() == Path(out_dir).resolve():
            raise errors.InputError("--reference and --out are the same directory; write the forced capture elsewhere")
        ref = read_capture(reference)
        if "ops" not in ref.manifest:
            raise errors.InputError(f"--reference {reference} has no per-op tensors; capture it without --no-ops")
        if ref.manifest["prompts"]["digest"] != batch.digest():
            raise errors.InputError(f"--reference {reference} was made on other token ids; use the same prompts")
    out_dir = prepare_output(out_dir, force)
    with console.status(f"running {run.label()}"):
        result = run_capture(spec, batch, run, out_dir, stream_log=verbose, ops=selection, reference=reference)
    ops_info = result.manifest.get("ops")
    scored = batch.num_tokens - len(batch.sequences)
    console.print(f"capture of {escape(run.label())}: {len(batch.sequences)} sequences, {batch.num_tokens} token ids "
                  f"({scored} scored)" + (f", {ops_info['ops']} ops ({ops_info['bytes'] / 2**20:.1f} MiB)" if ops_info else "")
                  + f" -> {out_dir}", highlight=False)


@app.command()
def diff(
    train_dir: Annotated[Path, typer.Argument(metavar="TRAIN_CAPTURE", help="Capture directory playing the training engine.")],
    infer_dir: Annotated[Path, typer.Argument(metavar="INFER_CAPTURE", help="Capture directory playing the inference engine.")],
    out: OutOpt = None,
    force: ForceOpt = False,
    clip_eps: ClipEpsOpt = 0.2,
    debug: DebugOpt = False,
) -> None:
    """Compare two captures made anywhere: logprobs, and every op when both captured ops.

    Refuses captures of different checkpoints or token ids, and damaged captures.
    """
    import pandas as pd

    from alignaudit.capture import read_capture
    from alignaudit.opdiff import first_divergence
    from alignaudit.pipeline import TOKENS, diff_captures, diff_ops, prepare_output, write_ops
    from alignaudit.report import render_comparison, render_op_verdict, render_ops

    check_clip_eps(clip_eps)
    a, b = read_capture(train_dir), read_capture(infer_dir)
    with_ops = "ops" in a.manifest and "ops" in b.manifest
    records = diff_ops(a, b) if with_ops else None  # reads and verifies every op before anything is written
    out_dir = prepare_output(out or default_out("diff"), force)
    summary = diff_captures(a, b, out_dir, clip_eps=clip_eps)
    render_comparison(console, summary, pd.read_parquet(out_dir / TOKENS))
    if records is not None:
        write_ops(records, out_dir / "ops.parquet")
        mode = b.manifest["ops"].get("mode", "natural")
        render_ops(console, records, mode, first_divergence(records))
        render_op_verdict(console, mode, records)
    console.print(f"results: {out_dir}")


@app.command()
def gate(
    run_dir: Annotated[Optional[Path], typer.Argument(metavar="[RUN_DIR]", help="A finished compare run (omit to run one now).")] = None,
    max_mismatch: Annotated[Optional[str], typer.Option("--max-mismatch", metavar="N|FRAC",
                            help="Allow N mismatching tokens, or a fraction (0.5% or 0.005).")] = None,
    max_ulp: Annotated[Optional[int], typer.Option("--max-ulp", metavar="N", help="Allow tokens up to N ULP apart.")] = None,
    max_abs: Annotated[Optional[float], typer.Option("--max-abs", metavar="X", help="Allow |lp_train - lp_infer| up to X.")] = None,
    baseline: Annotated[Optional[Path], typer.Option("--baseline", metavar="FILE",
                        help="Fail only on regression against this verdict.json (or summary.json).")] = None,
    junit: Annotated[Optional[Path], typer.Option("--junit", metavar="FILE", help="JUnit XML (default: RUN/junit.xml).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", metavar="FILE", help="JSON verdict (default: RUN/verdict.json).")] = None,
    md_out: Annotated[Optional[Path], typer.Option("--markdown", metavar="FILE",
                      help="Markdown summary, appended when the file exists ($GITHUB_STEP_SUMMARY); default RUN/summary.md.")] = None,
    model: ModelOpt = DEFAULT_MODEL,
    train: TrainOpt = "megatron",
    infer: InferOpt = "vllm",
    dtype: DtypeOpt = "bf16",
    device: DeviceOpt = "auto",
    train_opt: TrainSettingOpt = None,
    infer_opt: InferSettingOpt = None,
    strict: StrictOpt = None,
    mode: Annotated[str, typer.Option("--mode", metavar="MODE", help="prompt or rollout (when running a comparison).")] = "prompt",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N", help="Rollout mode: tokens per prompt.")] = 32,
    prompts: PromptsOpt = None,
    random_prompts: RandomPromptsOpt = None,
    prompt_len: PromptLenOpt = None,
    random_weights: RandomWeightsOpt = False,
    seed: SeedOpt = 0,
    out: OutOpt = None,
    force: ForceOpt = False,
    verbose: VerboseOpt = False,
    debug: DebugOpt = False,
) -> None:
    """CI gate on bitwise equality of per-token logprobs.

    Judges a finished comparison (RUN_DIR, as written by `alignaudit compare`), or runs one with the
    compare options and judges it. The captures are re-read and re-validated, never trusted from
    summary.json. Default rule: every compared token bitwise equal. Relaxations combine: --max-mismatch,
    --max-ulp, --max-abs, --baseline.

    Exit codes: **0** pass, **1** alignment failure, **2** usage or input error (including zero tokens
    compared, missing sequences, mismatched token ids, truncated or corrupt files), **3** engine failure
    (including NaN logprobs). Writes verdict.json, junit.xml (one test case per sequence) and summary.md.

    Examples:

    ```
    alignaudit gate --strict --train megatron --infer vllm --out runs/ci
    alignaudit gate runs/nightly --max-ulp 2 --junit reports/align.xml
    alignaudit gate runs/today --baseline runs/yesterday/verdict.json
    ```
    """
    from alignaudit import gate as gating
    from alignaudit.capture import read_capture
    from alignaudit.diff import align_tokens, compare_tokens

    count, fraction = gating.parse_max_mismatch(max_mismatch)
    if max_ulp is not None and max_ulp < 0 or max_abs is not None and max_abs < 0:
        raise errors.InputError("--max-ulp and --max-abs must not be negative")
    rule = gating.Rule(count, fraction, max_ulp, max_abs, gating.read_baseline(baseline) if baseline else None)
    if run_dir is None:
        run_dir, _ = _run_compare(model, train, infer, dtype, None, None, device, train_opt, infer_opt, strict, mode,
                                  max_new_tokens, 1.0, prompts, random_prompts, prompt_len, random_weights, seed, 0.2,
                                  out or default_out("gate"), force, verbose)
    elif not (Path(run_dir) / "run.json").is_file():
        raise errors.InputError(f"{run_dir} is not a compare run directory (no run.json); give the --out of `alignaudit compare`")
    train_cap, infer_cap = read_capture(Path(run_dir) / "train"), read_capture(Path(run_dir) / "infer")
    if train_cap.manifest["prompts"]["digest"] != infer_cap.manifest["prompts"]["digest"]:
        raise errors.InputError("the two captures were made on different token ids; run the comparison again")
    verdict = gating.evaluate(compare_tokens(align_tokens(train_cap.logprobs, infer_cap.logprobs)), rule, str(run_dir))
    (json_out or Path(run_dir) / "verdict.json").write_text(json.dumps(verdict.to_dict(), indent=2) + "\n")
    (junit or Path(run_dir) / "junit.xml").write_text(gating.junit_xml(verdict))
    md_path = md_out or Path(run_dir) / "summary.md"
    with open(md_path, "a" if md_out is not None and md_path.exists() else "w") as f:
        f.write(gating.markdown(verdict))
    style = "bold green" if verdict.passed else "bold red"
    console.print(f"[{style}]gate {'PASS' if verdict.passed else 'FAIL'}[/] ({escape(verdict.rule)}): "
                  f"{verdict.mismatches} of {verdict.tokens_compared} tokens differ, max ULP {verdict.ulp_max}", highlight=False)
    for reason in verdict.reasons:
        console.print(f"  {escape(reason)}", highlight=False)
    raise typer.Exit(verdict.exit_code)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the typer app, turn library errors into one line and an exit code."""
    args = _optional_values(sys.argv[1:] if argv is None else list(argv), {"--strict": "all"})
    debug = "--debug" in args
    previous = signal.signal(signal.SIGTERM, _terminate)  # unwind (and stop engine workers) on SIGTERM
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
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise KeyboardInterrupt


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
