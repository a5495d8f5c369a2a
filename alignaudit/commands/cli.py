"""The ``alignaudit`` command line: thin typer commands over the library, rendered with rich.

Exit codes (docs/cli.md): 0 success, 1 alignment failure (gate), 2 usage or input error, 3 engine
failure, 130 interrupted. Errors print one line; ``--debug`` (anywhere on the command line) shows the
traceback.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from alignaudit import __version__, errors
from alignaudit.capture import outdir
from alignaudit.commands import interrupts
from alignaudit.commands.options import (
    ClipEpsOpt,
    DeviceOpt,
    ISArgs,
    LayersOpt,
    MaxNewTokensOpt,
    ModelArgs,
    OpsOpt,
    OutputArgs,
    PairArgs,
    PromptArgs,
    SamplingArgs,
    StopAtEosOpt,
    StrictOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
    build_request,
    field_names,
    given_options,
    grouped,
    load_batch,
    out_dir,
    resolve_model_arg,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP.",
)
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader of our output went away (``| head``): rich exits 1 here, which is alignaudit's
        "alignment failure"; exit as a closed pipe instead (the files written so far are kept)."""
        try:
            super().on_broken_pipe()  # rich silences the stream and raises SystemExit(1)
        except SystemExit:
            raise SystemExit(EXIT_PIPE_CLOSED) from None


console = _Console()
err_console = _Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        console.print(f"alignaudit {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP."""


def _results(*paths) -> None:
    """The result paths, never wrapped (they are copied and pasted)."""
    console.print("results: " + ", ".join(str(p) for p in paths), highlight=False, soft_wrap=True)


@app.command()
@grouped
def compare(run: PairArgs, model: ModelArgs, prompts: PromptArgs, sampling: SamplingArgs, output: OutputArgs,
            importance: ISArgs, clip_eps: ClipEpsOpt = 0.2,
            repeat: Annotated[int, typer.Option("--repeat", metavar="N", help="Prompt mode: run each engine N times in "
                                                "one process on the same token ids, the first repeat on the same "
                                                "batch, later ones among random filler sequences; reports "
                                                "mismatches between runs.")] = 1,
            replay_routing: Annotated[bool, typer.Option(
                "--replay-routing", help="MoE models, prompt mode: the training engine's router replays the "
                "experts the inference engine chose for each token (R3); compares with and without "
                "(summary routing_replay).")] = False,
            full_vocab: Annotated[bool, typer.Option("--full-vocab", help="Prompt mode: each engine also records its "
                                                     "whole log-softmax row at every scored position (4 x vocabulary "
                                                     "bytes each, in RUN/train/vocab, RUN/infer/vocab); adds "
                                                     "KL both ways, total variation, top-1 agreement and top-5 "
                                                     "overlap per token.")] = False) -> None:
    """Run the same token ids through a training and an inference engine and compare per-token logprobs.

    Prompt mode (default): every prompt token after the first gets a teacher-forced logprob from each
    engine (fp32). Rollout mode, the RL path: the inference engine samples up to --max-new-tokens per prompt
    (seeded; with vLLM shaped as RL frameworks sample: EOS ends a completion, sampled tokens' logprobs only, so
    the prefix cache is read; --ignore-eos, --prompt-logprobs, --group-size, --engine-mode async change that) and
    records each sampled token's logprob while decoding; the training engine rescores prompt + completion in one
    pass. Reports bitwise mismatches, ULP
    distances and the RL impact (importance ratio, clip fraction, token_mult_prob_error, probability
    differences, KL, mean signed difference) and the importance-sampling diagnostics of RL frameworks (truncated
    and masked IS at token, sequence and geometric level at --tis-threshold, --mask-low/--mask-high and
    --geo-mask-low/--geo-mask-high; docs/rl-metrics.md). --full-vocab compares the engines' whole distributions at
    each position as well (exact KL both ways, total variation, top-1 agreement, top-5 overlap: summary.json's
    "vocab"). Writes tokens.parquet, sequences.parquet and summary.json to --out. The exit code is 0 whatever the
    result; `alignaudit gate` turns results into a CI verdict.

    Examples:

    ```
    alignaudit compare                  # fixture, megatron vs vllm, bf16
    alignaudit compare --dtype fp32 --train megatron --infer hf
    alignaudit compare --strict --mode rollout --max-new-tokens 32
    alignaudit compare --full-vocab     # whole distributions: KL, TV, top-k
    alignaudit compare --model Qwen3-0.6B --random-weights \\
        --random-prompts 2 --prompt-len 64
    alignaudit compare --train vllm --infer vllm \\
        --infer-opt enforce_eager=true  # self-consistency
    ```
    """
    from alignaudit.capture.rundir import COMPARE_OUTPUTS, SEQUENCES, SUMMARY, TOKENS

    out, summary = _run_compare(run, model, prompts, sampling, output, clip_eps, COMPARE_OUTPUTS, repeat,
                                replay_routing, full_vocab, importance)
    _render_summary(out, summary)
    _results(out / SUMMARY, out / TOKENS, out / SEQUENCES, *_report(out))


def _run_compare(pair, model, prompts, sampling, output, clip_eps, names, repeat: int = 1,
                 replay_routing: bool = False, full_vocab: bool = False,
                 importance: ISArgs | None = None) -> tuple[Path, dict]:
    """Validate everything, then run compare into the output directory; returns (out, summary)."""
    from alignaudit.commands.pipeline import compare as run_compare
    from alignaudit.engines.checks import check_full_vocab, check_routing_replay

    if repeat < 1:
        raise errors.InputError(f"--repeat {repeat}: give the number of runs per engine, 1 or more")
    if repeat > 1 and sampling.mode != "prompt":
        raise errors.InputError("--repeat reruns teacher-forced prompts; use it in prompt mode (drop --mode rollout)")
    request = dataclasses.replace(build_request(model, prompts, pair, sampling, clip_eps, importance), repeat=repeat,
                                  replay_routing=replay_routing, full_vocab=full_vocab)
    if replay_routing:
        check_routing_replay(request.spec, request.train, request.infer, request.mode, repeat)
    if full_vocab:
        check_full_vocab(request.train, request.infer, request.mode, replay_routing)
    out = out_dir(output, "compare", names)
    with console.status("") as status:
        summary = run_compare(request, out, stream_log=output.verbose, on_stage=status.update)
    return out, summary


@app.command()
@grouped
def rescore(rollouts_file: Annotated[Path, typer.Argument(metavar="FILE", help="Rollouts: JSONL or parquet, one "
                                                          "row per rollout (token_ids, prompt_length, logprobs).")],
            model: ModelArgs, output: OutputArgs,
            train: Annotated[str, typer.Option("--train", metavar="ENGINE", help="megatron or hf.")] = "megatron",
            dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32.")] = "bf16",
            device: DeviceOpt = "auto",
            train_opt: Annotated[Optional[list[str]], typer.Option(
                "--train-opt", metavar="KEY=VALUE", help="Training-engine setting (repeatable).")] = None,
            strict: StrictOpt = None, clip_eps: ClipEpsOpt = 0.2,
            logprobs_mode: Annotated[Optional[str], typer.Option(
                "--logprobs-mode", metavar="MODE", help="raw or processed, for a file that does not record it "
                "(NeMo-RL's and slime's dumps do not).")] = None,
            temperature: Annotated[Optional[float], typer.Option(
                "--temperature", metavar="T", help="The rollout's temperature, for a file that does not record it.")]
            = None,
            top_k: Annotated[Optional[int], typer.Option("--top-k", metavar="K", help="Likewise its top-k.")] = None,
            top_p: Annotated[Optional[float], typer.Option("--top-p", metavar="P", help="Likewise its top-p.")]
            = None) -> None:
    """Score rollouts your RL framework recorded with the training engine, and compare its logprobs of the
    sampled tokens with the rollout engine's, as `compare --mode rollout` does.

    FILE holds, per rollout, the token ids (prompt then sampled tokens), the prompt length and the rollout
    engine's logprob of each sampled token; optionally temperature, top_k, top_p and logprobs_mode (raw or
    processed: processed logprobs are scored under the same sampling transform). NeMo-RL's train_data_step*.jsonl
    and slime's --save-debug-rollout-data .pt files are read as they are written; they record no sampling
    settings, which --logprobs-mode, --temperature, --top-k and --top-p then give. docs/cli.md "rescore" has
    the schema. The run directory is `alignaudit gate`'s and `alignaudit report`'s input.

    Examples:

    ```
    alignaudit rescore rollouts.jsonl --model /ckpt/step-100 --train megatron --out runs/step-100
    alignaudit gate runs/step-100
    alignaudit rescore logs/exp_001/train_data_step3.jsonl --logprobs-mode processed --temperature 1.0 \
        --top-k -1 --top-p 1.0 --model /ckpt/step-3 --out runs/nemo-step-3
    ```
    """
    from alignaudit.capture.rundir import RESCORE_OUTPUTS, SUMMARY
    from alignaudit.commands.options import check_clip_eps, engine_runs
    from alignaudit.commands.pipeline import rescore as run_rescore
    from alignaudit.engines import kind_of, names_where
    from alignaudit.inputs.rollouts import read_rollouts

    check_clip_eps(clip_eps)
    if not kind_of(train).trains:
        raise errors.InputError(f"--train {train}: rescore scores with a training engine, "
                                f"{names_where(lambda k: k.trains)}")
    spec = resolve_model_arg(model)
    pair = PairArgs(train=train, infer=train, dtype=dtype, device=device, train_opt=train_opt, strict=strict)
    run = engine_runs(pair, model.seed, spec)[0]
    given = {"logprobs_mode": logprobs_mode, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    rollouts = read_rollouts(rollouts_file, spec.vocab_size, given)
    out = out_dir(output, "rescore", RESCORE_OUTPUTS, (Path(rollouts_file),))
    with console.status("") as status:
        summary = run_rescore(spec, rollouts, run, out, clip_eps, stream_log=output.verbose, on_stage=status.update)
    _render_summary(out, summary)
    _results(out / SUMMARY, out / "tokens.parquet", out / "sequences.parquet", out / "run.json")


def _render_summary(out: Path, summary: dict) -> None:
    import pandas as pd

    from alignaudit.capture.rundir import SEQUENCES, TOKENS
    from alignaudit.reports.terminal import render_comparison

    render_comparison(console, summary, pd.read_parquet(out / TOKENS), pd.read_parquet(out / SEQUENCES))


@app.command()
@grouped
def bisect(run: PairArgs, model: ModelArgs, prompts: PromptArgs, output: OutputArgs,
           mode: Annotated[str, typer.Option("--mode", metavar="MODE", help="natural, forced, or both.")] = "both",
           layers: LayersOpt = None, ops: OpsOpt = None) -> None:
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
    at once. An op whose inputs an engine cannot replace (e.g. vLLM's fused add+norm when the previous
    layer is not selected) is marked "inputs not forced" and kept out of the verdict.

    vLLM is captured in eager mode with prefix caching off (hooks cannot see inside torch.compile
    graphs), so its numbers here can differ from a compiled `compare` run.

    Examples:

    ```
    alignaudit bisect --train megatron --infer hf --dtype bf16
    alignaudit bisect --train hf --infer vllm --mode forced \\
        --layers 0-1 --ops q_rope,k_rope,attn
    ```
    """
    from alignaudit.capture.ops import OpGraph, parse_selection
    from alignaudit.capture.rundir import BISECT, BISECT_OUTPUTS, OPS_FILES
    from alignaudit.commands.pipeline import MODES
    from alignaudit.commands.pipeline import bisect as run_bisect
    from alignaudit.reports.terminal import render_bisect

    if mode not in MODES:
        raise errors.InputError(f"unknown bisect mode {mode!r}; choose one of {', '.join(MODES)}")
    request = build_request(model, prompts, run)
    selection = parse_selection(layers, ops, OpGraph.of(request.spec))
    _refuse_parallel_capture([request.train, request.infer], forced=mode != "natural")
    out = out_dir(output, "bisect", BISECT_OUTPUTS)
    with console.status("") as status:
        result = run_bisect(request, out, selection, mode=mode, stream_log=output.verbose, on_stage=status.update)
    render_bisect(console, result)
    _results(out / BISECT, *(out / OPS_FILES[m] for m in ("natural", "forced") if m in result), *_report(out))


@app.command()
@grouped
def capture(model: ModelArgs, prompts: PromptArgs, output: OutputArgs, sample: SamplingArgs,
            engine: Annotated[str, typer.Option("--engine", "-e", metavar="ENGINE",
                                                help="megatron, vllm or hf.")] = "megatron",
            dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32.")] = "bf16",
            device: DeviceOpt = "auto",
            opt: Annotated[Optional[list[str]], typer.Option("--opt", metavar="KEY=VALUE",
                                                             help="Engine setting (repeatable).")] = None,
            layers: LayersOpt = None,
            ops: OpsOpt = None,
            no_ops: Annotated[bool, typer.Option("--no-ops", metavar="",
                                                 help="Logprobs only, no per-op tensors.")] = False,
            reference: Annotated[Optional[Path], typer.Option("--reference", metavar="DIR",
                                                              help="Forced mode: feed every op "
                                                              "this capture's values.")] = None,
            tokens_from: Annotated[Optional[Path], typer.Option(
                "--tokens-from", metavar="DIR", help="Score the token ids of another capture (e.g. a rollout made "
                "elsewhere) instead of --prompts; its sampling transform is replayed where it recorded processed "
                "logprobs.")] = None,
            strict: StrictOpt = None,
            full_vocab: Annotated[bool, typer.Option("--full-vocab", help="Prompt mode: also write the engine's "
                                                     "whole log-softmax row at every scored position (DIR/vocab); "
                                                     "`diff` of two such captures compares the distributions.")]
            = False) -> None:
    """Run one engine and write its capture: manifest, logprobs and (by default, prompt mode) every canonical op.

    Make one capture where each engine lives (e.g. in the vLLM container, then in the Megatron
    container), then compare them anywhere with `alignaudit diff`. A rollout audit across containers:
    the rollout engine samples (`--mode rollout`), the trainer scores its tokens (`--tokens-from`).

    Examples:

    ```
    alignaudit capture --engine vllm --out runs/vllm
    alignaudit capture --engine megatron --layers 0-1 --ops attn,o_proj \\
        --out runs/megatron
    alignaudit diff runs/megatron runs/vllm
    alignaudit capture --engine vllm --mode rollout --out runs/rollout
    alignaudit capture --engine megatron --tokens-from runs/rollout --out runs/train
    alignaudit diff runs/train runs/rollout --out runs/d && alignaudit gate runs/d
    ```
    """
    from alignaudit.capture.directory import read_capture
    from alignaudit.capture.ops import OpGraph, parse_selection
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS
    from alignaudit.commands.options import engine_runs, sampling
    from alignaudit.commands.pipeline import capture as run_capture

    rollout = sampling(sample, model.seed)
    if rollout is not None:
        _refuse_for_rollout(engine, layers, ops, no_ops, reference, tokens_from)
        no_ops = True
    # the engine samples as the inference side, and scores as the training side, of a comparison
    pair = PairArgs(train=engine, infer=engine, dtype=dtype, device=device, strict=strict,
                    **({"infer_opt": opt} if rollout else {"train_opt": opt}))
    spec = resolve_model_arg(model)
    run = engine_runs(pair, model.seed, spec, sample.mode)[1 if rollout else 0]
    if rollout is not None:
        from alignaudit.engines.checks import rollout_shape

        rollout = rollout_shape(run, rollout)
    selection = None if no_ops else parse_selection(layers, ops, OpGraph.of(spec))
    if selection is not None:
        _refuse_parallel_capture([run], forced=reference is not None)
    inputs, replay = (), None
    if tokens_from is not None:
        batch, replay = _tokens_of(tokens_from, prompts, spec)
        inputs = (Path(tokens_from),)
    else:
        batch = load_batch(spec, prompts, model.seed, (engine,), rollout.max_new_tokens if rollout else 0)
    if full_vocab:
        from alignaudit.engines.checks import check_full_vocab

        check_full_vocab(run, run, sample.mode)
        if reference is not None or replay is not None:
            raise errors.InputError("--full-vocab records each engine's own rows: with --reference (forced inputs) or "
                                    "--tokens-from a rollout of processed logprobs (its sampling transform replayed) "
                                    "they would not be the rows its logprobs come from; drop one")
    if reference is not None:
        inputs = (*inputs, Path(reference))
        if output.out is not None:
            outdir.check_overlap(output.out, inputs)
        if selection is None:
            raise errors.InputError("--reference needs op capture; drop --no-ops")
        ref = read_capture(reference)
        if "ops" not in ref.manifest:
            raise errors.InputError(f"--reference {reference} has no per-op tensors; capture it without --no-ops")
        if ref.manifest["prompts"]["digest"] != batch.digest():
            raise errors.InputError(f"--reference {reference} was made on other token ids; use the same prompts")
    out = out_dir(output, f"capture-{engine}", CAPTURE_OUTPUTS, inputs)
    with console.status(f"running {run.label()}") as status:
        result = run_capture(spec, batch, run, out, stream_log=output.verbose, ops=selection, reference=reference,
                             rollout=rollout.to_dict() if rollout else None, replay=replay, full_vocab=full_vocab,
                             on_progress=lambda done, total: status.update(f"running {run.label()}: "
                                                                           f"{done}/{total} sequences"))
    ops_info = result.manifest.get("ops")
    batch = result.token_batch()  # with the sampled tokens in rollout mode
    scored = int(result.logprobs["scored"].sum())  # read back: a rollout without prompt logprobs scores fewer
    console.print(f"capture of {escape(run.label())}: {len(batch.sequences)} sequences, {batch.num_tokens} token ids "
                  f"({scored} scored)" + (f", {ops_info['ops']} ops ({ops_info['bytes'] / 2**20:.1f} MiB)"
                                          if ops_info else "")
                  + f" -> {out}", highlight=False, soft_wrap=True)



def _refuse_for_rollout(engine: str, layers, ops, no_ops: bool, reference, tokens_from) -> None:
    """What capture --mode rollout does not do, refused before any engine starts (an engine that does not sample:
    engines.checks.check_runs). Raises InputError."""
    if reference is not None or tokens_from is not None:
        raise errors.InputError(f"{'--reference' if reference is not None else '--tokens-from'} scores given tokens; "
                                "a rollout samples its own: drop --mode rollout or the option")
    if (layers or ops) and not no_ops:
        raise errors.InputError("op capture is prompt mode only (a rollout records its logprobs while decoding); "
                                "drop --layers/--ops or --mode rollout")


def _tokens_of(directory: Path, prompts: PromptArgs, spec):
    """(the token ids of the capture in ``directory``, the sampling transform to replay or None): the trainer's
    side of a rollout audit. A rollout whose engine recorded processed logprobs is scored under its temperature,
    top-k and top-p, as compare does.

    Raises:
        InputError: prompts given as well, not a capture, or a capture of another checkpoint.
    """
    from alignaudit.capture.directory import read_capture
    from alignaudit.engines.checks import processed_logprobs
    from alignaudit.inputs.checkpoint import checkpoint_sha256
    from alignaudit.inputs.request import EngineRun, EngineSettings

    if prompts.prompts is not None or prompts.random_prompts is not None:
        raise errors.InputError("--tokens-from gives the token ids; drop --prompts / --random-prompts")
    source = read_capture(directory)
    if source.manifest["model"].get("checkpoint_sha256") != checkpoint_sha256(spec):
        raise errors.InputError(f"--tokens-from {directory} was captured from another checkpoint than --model "
                                f"{spec.name}; score it with the model it was made with")
    replay, rollout = None, source.manifest.get("rollout")
    if rollout and processed_logprobs(EngineRun(source.engine, EngineSettings(**source.manifest["settings"]))):
        replay = {k: rollout[k] for k in ("temperature", "top_k", "top_p", "prompt_lengths")}
    return source.token_batch(), replay

@app.command()
@grouped
def diff(train_dir: Annotated[Path, typer.Argument(metavar="TRAIN_CAPTURE",
                                                   help="Capture directory playing the training engine.")],
         infer_dir: Annotated[Path, typer.Argument(metavar="INFER_CAPTURE",
                                                   help="Capture directory playing the inference engine.")],
         out: Annotated[Optional[str], typer.Option("--out", "-o", metavar="DIR",
                                                    help="Output directory (default: "
                                                    "alignaudit-runs/diff-TIME).")] = None,
         force: Annotated[bool, typer.Option("--force", metavar="", help="Reuse a non-empty --out (only alignaudit's "
                                             "own earlier outputs there are replaced).")] = False,
         clip_eps: ClipEpsOpt = 0.2) -> None:
    """Compare two captures made anywhere: logprobs, and every op when both captured ops.

    Refuses captures of different checkpoints or token ids, and damaged captures (the same checks
    `alignaudit gate` makes).
    """
    from alignaudit.capture.rundir import DIFF_OUTPUTS, OPS_FILES, RUN, SUMMARY
    from alignaudit.commands.options import check_clip_eps
    from alignaudit.commands.pipeline import diff_captures, diff_ops, finish_diff, write_ops
    from alignaudit.comparison.integrity import load_pair
    from alignaudit.comparison.op_diff import first_divergence
    from alignaudit.reports.terminal import render_op_verdict, render_ops

    check_clip_eps(clip_eps)
    a, b = load_pair(train_dir, infer_dir)
    with_ops = "ops" in a.manifest and "ops" in b.manifest
    records = diff_ops(a, b) if with_ops else None  # reads and verifies every op before anything is written
    target = OutputArgs(out=out, force=force)
    out_path = out_dir(target, "diff", DIFF_OUTPUTS + (RUN,), (Path(train_dir), Path(infer_dir)))
    summary = diff_captures(a, b, out_path, clip_eps=clip_eps)
    if records is not None:
        write_ops(records, out_path / OPS_FILES["diff"])
    finish_diff(out_path, a, b, clip_eps)
    _render_summary(out_path, summary)
    if records is not None:
        mode = b.manifest["ops"].get("mode", "natural")
        render_ops(console, records, mode, first_divergence([r for r in records if r.get("forced", True)]))
        render_op_verdict(console, mode, records)
    _results(out_path / SUMMARY, *([out_path / OPS_FILES["diff"]] if records is not None else []), out_path / RUN)


@app.command()
@grouped
def gate(ctx: typer.Context, run: PairArgs, model: ModelArgs, prompts: PromptArgs, sampling: SamplingArgs,
         output: OutputArgs,
         run_dir: Annotated[Optional[Path], typer.Argument(metavar="[RUN_DIR]",
                            help="A finished compare or rl run (omit to run a comparison now).")] = None,
         max_mismatch: Annotated[Optional[str], typer.Option("--max-mismatch", metavar="N|FRAC",
                                 help="Allow N mismatching tokens, or a fraction (0.5% or 0.005).")] = None,
         max_ulp: Annotated[Optional[int], typer.Option("--max-ulp", metavar="N",
                            help="Allow tokens up to N ULP apart.")] = None,
         max_abs: Annotated[Optional[float], typer.Option("--max-abs", metavar="X",
                            help="Allow |lp_train - lp_infer| up to X.")] = None,
         baseline: Annotated[Optional[Path], typer.Option("--baseline", metavar="FILE",
                             help="Fail only on regression against this verdict.json (or summary.json).")] = None,
         junit: Annotated[Optional[Path], typer.Option("--junit", metavar="FILE",
                          help="JUnit XML (default: RUN/junit.xml).")] = None,
         json_out: Annotated[Optional[Path], typer.Option("--json", metavar="FILE",
                             help="JSON verdict (default: RUN/verdict.json).")] = None,
         md_out: Annotated[Optional[Path], typer.Option("--markdown", metavar="FILE",
                           help="Markdown summary, appended when the file exists ($GITHUB_STEP_SUMMARY); "
                           "default RUN/summary.md.")] = None,
         clip_eps: ClipEpsOpt = 0.2) -> None:
    """CI gate on bitwise equality of per-token logprobs.

    Judges a finished comparison (RUN_DIR, as written by `alignaudit compare`), or runs one with the
    compare options and judges it. The run is validated first, with the checks `alignaudit diff` makes
    (complete, undamaged captures of one checkpoint and one set of token ids) plus the run's own record
    (each capture is the one the run wrote, with the engine, role and settings it names); summary.json
    is never trusted. Default rule: every compared token bitwise equal. Relaxations combine:
    --max-mismatch, --max-ulp, --max-abs, --baseline.

    Exit codes: **0** pass, **1** alignment failure, **2** usage or input error (including zero tokens
    compared, a run that did not finish, altered or damaged captures, compare options given with
    RUN_DIR), **3** engine failure (including NaN logprobs, and an rl step with a non-finite loss or grad
    norm). Writes verdict.json, junit.xml (one test case per sequence; per step for an rl run) and
    summary.md.

    Examples:

    ```
    alignaudit gate --strict --train megatron --infer vllm --out runs/ci
    alignaudit gate runs/nightly --max-ulp 2 --junit reports/align.xml
    alignaudit gate runs/today --baseline runs/yesterday/verdict.json
    ```
    """
    from alignaudit.capture.rundir import COMPARE_OUTPUTS, GATE_OUTPUTS, JUNIT, SUMMARY_MD, VERDICT
    from alignaudit.comparison import gate as gating

    if run_dir is not None:
        given = given_options(ctx,
                              field_names(PairArgs, ModelArgs, PromptArgs, SamplingArgs, OutputArgs) + ["clip_eps"])
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise errors.InputError(f"gate RUN_DIR judges a finished run; {flags} apply only when gate runs the "
                                    "comparison itself (without RUN_DIR): drop them")
    rule = gating.make_rule(max_mismatch, max_ulp, max_abs, baseline)
    if run_dir is None:
        run_dir, _ = _run_compare(run, model, prompts, sampling, output, clip_eps, COMPARE_OUTPUTS + GATE_OUTPUTS)
    _claim_verdict_files(Path(run_dir), targets := (json_out or run_dir / VERDICT,
                                                    junit or run_dir / JUNIT, md_out or run_dir / SUMMARY_MD))
    verdict = gating.judge_run(Path(run_dir), rule)
    gating.write_outputs(verdict, *targets, append_md=md_out is not None)
    style = "bold green" if verdict.passed else "bold red"
    console.print(f"[{style}]gate {verdict.label.upper()}[/] ({escape(verdict.rule)}): "
                  f"{verdict.mismatches} of {verdict.tokens_compared} tokens differ, max ULP {verdict.ulp_max}",
                  highlight=False)
    for reason in verdict.reasons:
        console.print(f"  {escape(reason)}", highlight=False)
    for note in verdict.notes:
        console.print(f"  not judged: {escape(note)}", highlight=False)
    if Path(targets[0]).resolve().parent == Path(run_dir).resolve():  # the verdict went into the run: so does the page
        _results(*targets, *_report(Path(run_dir)))
    if verdict.error:
        raise errors.EngineError(verdict.error)
    raise typer.Exit(verdict.exit_code)


@app.command()
@grouped
def rl(run: PairArgs, model: ModelArgs, prompts: PromptArgs, output: OutputArgs, importance: ISArgs,
       steps: Annotated[int, typer.Option("--steps", metavar="N", help="GRPO steps.")] = 10,
       lr: Annotated[float, typer.Option("--lr", metavar="LR", help="Adam learning rate (0: weights never change, "
                                         "the weight-sync control).")] = 1e-4,
       group_size: Annotated[int, typer.Option("--group-size", metavar="G",
                                               help="Completions per prompt (GRPO group).")] = 4,
       max_new_tokens: MaxNewTokensOpt = 16,
       temperature: TemperatureOpt = 1.0,
       top_k: TopKOpt = 0,
       top_p: TopPOpt = 1.0,
       stop_at_eos: StopAtEosOpt = None,
       sleep_level: Annotated[int, typer.Option("--sleep-level", metavar="L", help="vLLM on CUDA: sleep after each "
                                                "rollout and wake before the sync, as colocated frameworks free the "
                                                "GPU for the trainer; 1: weights to host memory, KV cache freed "
                                                "(steps.parquet sleep_freed_gib). 0: never sleeps.")] = 0,
       clip_eps: ClipEpsOpt = 0.2,
       reward: Annotated[str, typer.Option("--reward", metavar="NAME", help="task (the addition task of "
                                           "--model qwen3-tiny-trained: 1 for a correct answer ending at EOS, "
                                           "0.1 for a wrong number; rl asks the task's own questions), "
                                           "rotating-hash (a score per token id "
                                           "from a table that changes every 10 steps), "
                                           "token-hash (one fixed table) or even (the fraction of even token ids); "
                                           "each collapses a policy in time; --kl-coef keeps the gradient "
                                           "non-zero (docs/rl.md).")] = "rotating-hash",
       kl_coef: Annotated[float, typer.Option("--kl-coef", metavar="BETA", help="Weight of the k3 KL to the starting "
                                              "weights in the loss (GRPO's KL term; DeepSeekMath used 0.04). 0: none. "
                                              "> 0 keeps a copy of the starting weights on the trainer's device."
                                              )] = 0.0,
       no_token_rows: Annotated[bool, typer.Option("--no-token-rows", metavar="", help="Skip tokens/step-*.parquet "
                                                   "(one row per generated token per step) "
                                                   "on long runs.")] = False,
       log_to: Annotated[Optional[str], typer.Option("--log-to", metavar="SINKS", help="Also log every step's "
                                                     "numbers to tensorboard (RUN/tensorboard/) and/or wandb "
                                                     "(offline, RUN/wandb/), comma-separated; each needs its "
                                                     "package (pip install tensorboard wandb).")] = None,
       full_vocab: Annotated[bool, typer.Option("--full-vocab", help="Also compare, at every generated token of "
                                                "every step, the trainer's whole log-softmax row with the one vLLM's "
                                                "sampler computed while decoding: exact KL both ways, total "
                                                "variation, top-1 agreement, top-5 overlap (steps.parquet vocab_*, "
                                                "per token in tokens/). Cost: each side's rows, 4 x vocabulary bytes "
                                                "per generated token (Qwen3: 594 KiB; 2048 tokens a step: 1.2 GB a "
                                                "side), held by its worker, written to RUN/vocab/, read by the "
                                                "parent and deleted after the step.")] = False,
       keep_vocab_rows: Annotated[bool, typer.Option("--keep-vocab-rows", help="With --full-vocab: keep every "
                                                     "step's rows in RUN/vocab/step-N-{train,infer}.safetensors "
                                                     "(the disk cost above, per step).")] = False) -> None:
    """N GRPO steps with the train/rollout alignment checked at every step.

    Each step the inference engine samples --group-size completions per prompt (seeded; the same seeds
    every step) and records their logprobs while decoding; the trainer rescores them (old_logprobs);
    every generated token is compared bit for bit; a verifiable toy reward (--reward) gives GRPO
    advantages; the trainer takes one clipped-loss step (Adam on fp32 main weights, grad clipping at 1.0)
    with the ratio exp(lp_train - lp_rollout); its new weights go into the running inference engine
    through model.load_weights (a file on the CPU, CUDA IPC handles on the GPU), and every tensor the
    engine then holds is checked bit for bit against the trainer's.
    Both engines stay up for the whole run. Writes steps.parquet (after every step), tokens/, steps.png
    and run.json; `alignaudit gate RUN` passes only if every step had 0 mismatching tokens and every sync
    was bit-equal. docs/rl.md explains each metric.

    Examples:

    ```
    alignaudit rl --steps 200 --strict                 # fixture, megatron trains, vllm rolls out
    alignaudit rl --steps 5 --lr 0                     # control: weights fixed, sync still runs
    alignaudit rl --train hf --infer hf --steps 20 --strict
    alignaudit rl --steps 50 --log-to tensorboard      # tensorboard --logdir RUN/tensorboard
    ```
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from alignaudit.capture.rundir import PLOT, RL_OUTPUTS, RUN, STEPS
    from alignaudit.rl.export import parse_sinks
    from alignaudit.rl.loop import RLSettings, run_rl

    settings = RLSettings(steps=steps, lr=lr, group_size=group_size, token_rows=not no_token_rows, reward=reward,
                          kl_coef=kl_coef, log_to=parse_sinks(log_to), full_vocab=full_vocab,
                          keep_vocab_rows=keep_vocab_rows, sleep_level=sleep_level)
    settings.check()
    from alignaudit.rl.request import rl_request

    request = rl_request(model, prompts, run, SamplingArgs("rollout", max_new_tokens, temperature, top_k, top_p,
                                                           stop_at_eos=stop_at_eos), clip_eps, importance, settings)
    from alignaudit.rl.memory import rl_plan

    memory = rl_plan(request, group_size, kl_coef > 0)  # refuses a model that cannot fit, before any engine starts
    out = out_dir(output, "rl", RL_OUTPUTS)
    columns = (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
               TextColumn("{task.fields[last]}"))
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("rl", total=steps, last="starting engines")

        def on_step(row: dict) -> None:  # a line per step above the bar (a log or CI keeps each one whole)
            line = _step_line(row)
            progress.console.print(f"step {row['step']}: {line}", highlight=False, soft_wrap=True)
            progress.update(task, advance=1, last=line)

        table = run_rl(request, settings, out, on_step=on_step,
                       on_stage=lambda text: progress.update(task, last=escape(text)), memory=memory)
    bad = int((table["mismatches"] > 0).sum())
    unsynced = int((~table["sync_bit_equal"]).sum())
    style = "bold green" if bad == 0 and unsynced == 0 else "bold red"
    console.print(f"[{style}]{bad} of {len(table)} steps with mismatching tokens; {unsynced} weight syncs not "
                  f"bit-equal[/]; reward {table['reward_mean'].iloc[0]:.3f} -> {table['reward_mean'].iloc[-1]:.3f}",
                  highlight=False)
    _results(out / STEPS, out / PLOT, out / RUN, *_report(out))


@app.command()
@grouped
def ablate(run: PairArgs, model: ModelArgs, prompts: PromptArgs, sampling: SamplingArgs, output: OutputArgs,
           factors: Annotated[Optional[str], typer.Option(
               "--factors", metavar="OPS", help="Strict ops to ablate, e.g. linear,rmsnorm (default: all of linear, "
                                                "rmsnorm, rope, silu, attention, logprobs).")] = None,
           no_ops: Annotated[bool, typer.Option("--no-ops", metavar="", help="Skip op capture: no first diverging op "
                                                "per row, and vLLM keeps its compiled default.")] = False) -> None:
    """Which op's kernel makes the two engines disagree, and how much: one comparison per configuration.

    Rows: all strict; each op left at its default with every other op strict; each op alone strict; all
    default. Each row reports mismatching tokens, max ULP, max |d logprob| and (prompt mode) the first
    diverging op from a natural-mode op capture, for which vLLM runs eager. The strict kernels fix the four
    sources (reduction order, precision, rounding points, math primitives) together per op, so the factors
    are ops. Writes configs/ROW/ (each row's comparison), ablate.parquet, ablate.json and report.html.

    Examples:

    ```
    alignaudit ablate                                   # fixture, megatron vs vllm, bf16, every op
    alignaudit ablate --train megatron --infer hf --factors linear,rmsnorm
    alignaudit ablate --mode rollout --max-new-tokens 16 --no-ops
    ```
    """
    from rich.table import Table

    from alignaudit.capture.rundir import ABLATE_JSON, ABLATE_OUTPUTS, ABLATE_PARQUET
    from alignaudit.commands.ablate import ablate as run_ablate
    from alignaudit.commands.ablate import eager_for_op_capture, without_strict
    from alignaudit.inputs.strict_ops import STRICT_OPS, parse_strict

    if run.strict is not None:
        raise errors.InputError("ablate sets the strict ops of each row itself; drop --strict")
    if run.strict_exp != "portable":
        raise errors.InputError("ablate's rows without strict attention would not use --strict-exp; drop it")
    if factors is not None and not parse_strict(factors, "--factors"):
        raise errors.InputError(f"--factors {factors!r} names no op; give some of {', '.join(STRICT_OPS)}, or drop "
                                "--factors for all")
    chosen = parse_strict(factors, "--factors") if factors else frozenset(STRICT_OPS)
    ordered = tuple(op for op in STRICT_OPS if op in chosen)
    # validated with every op strict (the first row), run with each row's own strict ops
    request = build_request(model, prompts, dataclasses.replace(run, strict="all"), sampling)
    capture_ops = not no_ops and request.rollout is None
    if capture_ops:
        _refuse_parallel_capture([request.train, request.infer], forced=False)
    out = out_dir(output, "ablate", ABLATE_OUTPUTS)
    with console.status("") as status:
        matrix = run_ablate(request, out, ordered, capture_ops, on_stage=status.update)
    eager = "" if capture_ops else ", no op capture"
    if capture_ops and (eager_names := eager_for_op_capture(request)):
        eager = f" ({eager_names} eager: op capture)"
    shown = without_strict(request)
    table = Table(title=f"Ablation: {escape(shown.train.label())} vs {escape(shown.infer.label())}, "
                        f"{request.mode} mode{eager}", title_justify="left")
    for col in ("factor", "kind", "mismatching tokens", "max ULP", "max |Δ|", "first diverging op"):
        table.add_column(col, justify="right" if col in ("mismatching tokens", "max ULP", "max |Δ|") else "left",
                         overflow="fold")
    for r in matrix.itertuples():
        style = "green" if r.mismatches == 0 else None
        table.add_row(r.factor, r.kind, f"{r.mismatches} of {r.tokens}", str(r.max_ulp), f"{r.max_abs_diff:.3e}",
                      escape(r.first_diverging_op if isinstance(r.first_diverging_op, str)
                             else "-" if capture_ops else "(not captured)"), style=style)
    console.print(table)
    _results(out / ABLATE_PARQUET, out / ABLATE_JSON, *_report(out))


@app.command()
@grouped
def report(run_dirs: Annotated[list[Path], typer.Argument(
               metavar="RUN_DIR", help="A run directory of compare, bisect, gate, rl or diff; two or more "
               "comparisons (compare, gate, diff, rescore): side by side.")],
           html: Annotated[Optional[Path], typer.Option("--html", metavar="FILE",
                                                        help="Write the page here (default: RUN_DIR/report.html; "
                                                        "several runs: alignaudit-runs/report-TIME.html).")] = None
           ) -> None:
    """One self-contained HTML page of a run, or of several comparisons side by side; opens offline.

    compare and gate: the summary grouped (alignment, RL impact, importance weights, distribution, routing),
    the fp32 ULP distances in log2 buckets, |d logprob| along each sequence (rollout: where each prompt
    ends), the worst tokens with their text, the sequences worst first (sortable), the settings and
    environment. bisect: layer x op heatmaps (share of bitwise-equal elements, max ULP), the first
    diverging op outlined, natural and forced mode. rl: every per-step series. An ablation matrix
    (ablate.parquet): table and bars. The kind of run is read from its files. compare, bisect, gate and rl
    write RUN_DIR/report.html themselves when they finish; this command makes it again, or elsewhere.

    Several runs: one column per run (engines, strict ops, mismatches, ULP, KL, clip fraction, ...) and
    their ULP histograms together; runs of different models, prompts or modes are refused.

    Examples:

    ```
    alignaudit report alignaudit-runs/compare-20260101-120000
    alignaudit report runs/ci --html reports/alignment.html
    alignaudit report runs/default runs/strict --html default-vs-strict.html
    ```
    """
    if len(run_dirs) > 1:
        from alignaudit.reports.html.side_by_side import write_side_by_side

        _results(write_side_by_side(run_dirs, html))
        return
    from alignaudit.reports.html import write_report

    _results(write_report(run_dirs[0], html))


def _report(run_dir: Path) -> tuple[Path, ...]:
    """RUN_DIR/report.html at the end of a run: (its path,), or () and one warning line when it cannot be
    written (the run's results and exit code stand without it)."""
    from alignaudit.reports.html import write_report

    try:
        return (write_report(run_dir),)
    except Exception as e:  # noqa: BLE001 - the page is an extra; the run has already succeeded
        err_console.print(f"[yellow]warning:[/] report.html not written: {escape(str(e))} (retry with `alignaudit "
                          f"report {escape(str(run_dir))}`)", highlight=False, soft_wrap=True)
        return ()


def _step_line(row: dict) -> str:
    """One rl step as the progress bar shows it: mismatching tokens, max |d|, k3 KL, (--full-vocab) the exact mean
    KL(train || rollout) over the whole vocabulary and top-1 agreement, and the clip fraction first (what the
    mismatch costs the optimizer), then the sync, the reward and the time."""
    sync = "sync ok" if row["sync_bit_equal"] else f"[red]sync: {row['sync_tensors_differing']} tensors differ[/]"
    mism = f"{row['mismatches']}/{row['tokens']} tokens differ"
    vocab = (f"vocab KL {_num(row['vocab_kl_train_infer_mean'])}, top-1 {_num(row['vocab_top1_agreement'], '.3f')}, "
             if "vocab_kl_train_infer_mean" in row else "")
    return (f"{'[green]' if row['mismatches'] == 0 else '[red]'}{mism}[/], max |d| {_num(row['max_abs_diff'])}, "
            f"KL {_num(row['kl_k3'])}, {vocab}clip {_num(row['clip_fraction'], '.3f')}, {sync}, "
            f"reward {row['reward_mean']:.3f}, {row['seconds']:.1f}s")


def _num(x, spec: str = ".2e") -> str:
    """A step-line number; "n/a" where the step had none (no finite pair)."""
    return "n/a" if x is None or x != x else format(x, spec)


def _refuse_parallel_capture(runs, forced: bool) -> None:
    """Op capture at tensor parallel size > 1: Megatron in natural mode only (its ranks gather sharded ops);
    not vLLM, whose ranks run in worker processes its hooks cannot reach."""
    from alignaudit.engines import kind_of
    from alignaudit.engines.checks import refuse_parallel

    unreachable = [r for r in runs if not kind_of(r.engine).hooks_reach_ranks]
    refuse_parallel(unreachable, "op capture", "vLLM's ranks run in worker processes that alignaudit's hooks cannot "
                    "reach; capture vLLM at size 1 (under --strict, the same bits)")
    if forced:
        refuse_parallel(runs, "forced-mode op capture", "sharded ops would need the reference split per rank; "
                        "use --mode natural")


def _claim_verdict_files(run_dir: Path, targets: tuple[Path, ...]) -> None:
    """Lock the run directory and claim the verdict files gate writes into it (none when all go elsewhere,
    so a read-only run can be judged)."""
    from alignaudit.capture.rundir import JUDGED
    from alignaudit.comparison.integrity import read_run_record

    # a missing or unfinished run: said so, not "unwritable"
    read_run_record(run_dir, commands=JUDGED)
    inside = tuple(Path(t).name for t in targets if Path(t).resolve().parent == run_dir.resolve())
    if inside:
        try:
            outdir.lock(run_dir)
            outdir.claim(run_dir, inside)
        except errors.InputError as e:
            raise errors.InputError(f"{e}, or pass --json, --junit and --markdown "
                                    "to write the verdict elsewhere") from e


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the typer app, turn library errors into one line and an exit code."""
    args = _optional_values(sys.argv[1:] if argv is None else list(argv), {"--strict": "all"})
    debug = "--debug" in args
    outdir.command_name = next((a for a in args if not a.startswith("-")), "?")
    try:
        with interrupts.unwinding():  # Ctrl-C and SIGTERM unwind, stopping engine workers (commands/interrupts.py)
            result = app(args=args, standalone_mode=False, prog_name="alignaudit")
        if interrupts.signalled:
            return _interrupted()
        return result if isinstance(result, int) else errors.EXIT_OK
    except errors.AlignAuditError as e:
        if debug:
            traceback.print_exc()
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return e.exit_code
    except typer.Exit as e:
        return _interrupted() if interrupts.signalled else e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return _interrupted()
    except Exception as e:
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # click/typer usage errors
            if type(e).__name__ == "NoArgsIsHelpError":
                console.print(e.ctx.get_help(), highlight=False)
                return errors.EXIT_OK
            err_console.print(f"[bold red]error:[/] {escape(e.format_message())}", highlight=False, soft_wrap=True)
            return errors.EXIT_USAGE
        return _unexpected(e, debug)
    finally:
        outdir.release_all()


def _interrupted() -> int:
    err_console.print("interrupted; the files written so far are kept", highlight=False, soft_wrap=True)
    return interrupts.EXIT_INTERRUPTED


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
    err_console.print(f"[bold red]error:[/] unexpected {type(e).__name__}: {escape(str(e))} "
                      "(run with --debug for the traceback)",
                      highlight=False, soft_wrap=True)
    return errors.EXIT_ENGINE


def entrypoint() -> None:
    sys.exit(main())
