"""`alignaudit capture`: one engine's capture, for a diff made elsewhere (registered by alignaudit.commands.cli)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from alignaudit import errors
from alignaudit.capture import outdir
from alignaudit.commands.console import console
from alignaudit.commands.options import DeviceOpt, LayersOpt, OpsOpt, StrictAttentionOpt, StrictExpOpt, StrictOpt
from alignaudit.engines.checks import check_parallel_op_capture
from alignaudit.pipelines.requests import (
    ModelArgs,
    OutputArgs,
    PairArgs,
    PromptArgs,
    SamplingArgs,
    load_batch,
    out_dir,
    resolve_model_arg,
)


def capture(
    model: ModelArgs,
    prompts: PromptArgs,
    output: OutputArgs,
    sample: SamplingArgs,
    engine: Annotated[str, typer.Option("--engine", "-e", metavar="ENGINE", help="megatron, vllm or hf.")] = "megatron",
    dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32.")] = "bf16",
    device: DeviceOpt = "auto",
    opt: Annotated[
        Optional[list[str]], typer.Option("--opt", metavar="KEY=VALUE", help="Engine setting (repeatable).")
    ] = None,
    layers: LayersOpt = None,
    ops: OpsOpt = None,
    no_ops: Annotated[bool, typer.Option("--no-ops", metavar="", help="Logprobs only, no per-op tensors.")] = False,
    reference: Annotated[
        Optional[Path],
        typer.Option("--reference", metavar="DIR", help="Forced mode: feed every op this capture's values."),
    ] = None,
    tokens_from: Annotated[
        Optional[Path],
        typer.Option(
            "--tokens-from",
            metavar="DIR",
            help="Score the token ids of another capture (e.g. a rollout made "
            "elsewhere) instead of --prompts; its sampling transform is replayed where it recorded processed "
            "logprobs.",
        ),
    ] = None,
    strict: StrictOpt = None,
    strict_exp: StrictExpOpt = None,
    strict_attention: StrictAttentionOpt = None,
    full_vocab: Annotated[
        bool,
        typer.Option(
            "--full-vocab",
            metavar="",
            help="Prompt mode: also write the engine's "
            "whole log-softmax row at every scored position (DIR/vocab); "
            "`diff` of two such captures compares the distributions.",
        ),
    ] = False,
) -> None:
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
    from alignaudit.pipelines.requests import (
        check_max_model_len,
        check_top_k,
        engine_runs,
        given_sampling_flags,
        sampling,
    )
    from alignaudit.pipelines.runs import capture as run_capture

    if tokens_from is not None and sample.mode == "prompt" and (given := given_sampling_flags(sample)):
        raise errors.InputError(
            f"{given[0]}: --tokens-from scores a rollout's tokens under the sampling settings its "
            f"capture recorded; drop {given[0]}"
        )
    rollout = sampling(sample, model.seed)
    if rollout is not None:
        _refuse_for_rollout(engine, layers, ops, no_ops, reference, tokens_from)
        no_ops = True
    # the engine samples as the inference side, and scores as the training side, of a comparison
    pair = PairArgs(
        train=engine,
        infer=engine,
        dtype=dtype,
        device=device,
        strict=strict,
        strict_exp=strict_exp,
        strict_attention=strict_attention,
        train_opt=None if rollout else opt,
        infer_opt=opt if rollout else None,
    )
    spec = resolve_model_arg(model)
    check_top_k(rollout, spec)
    with _spelled_as_opt():
        run = engine_runs(pair, model.seed, spec, sample.mode)[1 if rollout else 0]
        if rollout is not None:
            from alignaudit.engines.checks import rollout_shape

            rollout = rollout_shape(run, rollout, spec)
    if no_ops and (layers or ops):
        raise errors.InputError("--layers/--ops select ops to capture and --no-ops captures none; drop one")
    selection = None if no_ops else parse_selection(layers, ops, OpGraph.of(spec))
    if selection is not None:
        check_parallel_op_capture([run], forced=reference is not None)
    inputs: tuple[Path, ...] = ()
    replay = None
    if tokens_from is not None:
        batch, replay = _tokens_of(tokens_from, prompts, spec)
        inputs = (Path(tokens_from),)
    else:
        batch = load_batch(spec, prompts, model.seed, (engine,), rollout.max_new_tokens if rollout else 0)
    check_max_model_len(batch, {"--opt": run}, rollout.max_new_tokens if rollout else 0)
    if full_vocab:
        from alignaudit.engines.checks import check_full_vocab

        check_full_vocab(run, run, sample.mode)
        if reference is not None or replay is not None:
            raise errors.InputError(
                "--full-vocab records each engine's own rows: with --reference (forced inputs) or "
                "--tokens-from a rollout of processed logprobs (its sampling transform replayed) "
                "they would not be the rows its logprobs come from; drop one"
            )
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
        from alignaudit.inputs.checkpoint import checkpoint_sha256

        if ref.manifest["model"].get("checkpoint_sha256") != checkpoint_sha256(spec):
            raise errors.InputError(
                f"--reference {reference} was captured from another checkpoint than --model "
                f"{spec.name}; force the inputs of a capture of the same model"
            )
    out = out_dir(output, f"capture-{engine}", CAPTURE_OUTPUTS, inputs)
    with console.status(f"running {run.label()}") as status:
        result = run_capture(
            spec,
            batch,
            run,
            out,
            stream_log=output.verbose,
            ops=selection,
            reference=reference,
            rollout=rollout,
            replay=replay,
            full_vocab=full_vocab,
            on_progress=lambda done, total: status.update(f"running {run.label()}: {done}/{total} sequences"),
        )
    ops_info = result.manifest.get("ops")
    batch = result.token_batch()  # with the sampled tokens in rollout mode
    scored = int(result.logprobs["scored"].sum())  # read back: a rollout without prompt logprobs scores fewer
    console.print(
        f"capture of {escape(run.label())}: {len(batch.sequences)} sequences, {batch.num_tokens} token ids "
        f"({scored} scored)"
        + (f", {ops_info['ops']} ops ({ops_info['bytes'] / 2**20:.1f} MiB)" if ops_info else "")
        + f" -> {out}",
        highlight=False,
        soft_wrap=True,
    )


@contextlib.contextmanager
def _spelled_as_opt():
    """The engine checks word a refusal for a comparison's sides (--train-opt, --infer-opt); capture takes its one
    engine's options as --opt, so its refusals say --opt."""
    try:
        yield
    except errors.InputError as e:
        text = str(e).replace("--train-opt", "--opt").replace("--infer-opt", "--opt")
        if text == str(e):
            raise
        raise errors.InputError(text) from e


def _refuse_for_rollout(engine: str, layers, ops, no_ops: bool, reference, tokens_from) -> None:
    """What capture --mode rollout does not do, refused before any engine starts (an engine that does not sample:
    engines.checks.check_runs). Raises InputError."""
    if reference is not None or tokens_from is not None:
        raise errors.InputError(
            f"{'--reference' if reference is not None else '--tokens-from'} scores given tokens; "
            "a rollout samples its own: drop --mode rollout or the option"
        )
    if (layers or ops) and not no_ops:
        raise errors.InputError(
            "op capture is prompt mode only (a rollout records its logprobs while decoding); "
            "drop --layers/--ops or --mode rollout"
        )


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
    from alignaudit.inputs.request import EngineRun, EngineSettings, Replay

    if prompts.prompts is not None or prompts.random_prompts is not None:
        raise errors.InputError("--tokens-from gives the token ids; drop --prompts / --random-prompts")
    source = read_capture(directory)
    if source.manifest["model"].get("checkpoint_sha256") != checkpoint_sha256(spec):
        raise errors.InputError(
            f"--tokens-from {directory} was captured from another checkpoint than --model "
            f"{spec.name}; score it with the model it was made with"
        )
    replay, rollout = None, source.manifest.get("rollout")
    if rollout and processed_logprobs(EngineRun(source.engine, EngineSettings(**source.manifest["settings"]))):
        replay = Replay.of(rollout, rollout["prompt_lengths"])
    return source.token_batch(), replay
