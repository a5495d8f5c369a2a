"""The commands that compare two engines: compare, rescore, bisect, diff, ablate (registered on the app by
alignaudit.commands.cli; gate_command judges a comparison, report_command renders one)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from alignaudit import errors
from alignaudit.commands.console import console, render_summary, results, write_page
from alignaudit.commands.options import (
    ClipEpsOpt,
    DeviceOpt,
    LayersOpt,
    OpsOpt,
    StrictAttentionOpt,
    StrictExpOpt,
    StrictOpt,
)
from alignaudit.engines.checks import check_parallel_op_capture
from alignaudit.pipelines.requests import (
    ISArgs,
    ModelArgs,
    OutputArgs,
    PairArgs,
    PromptArgs,
    SamplingArgs,
    build_request,
    out_dir,
    resolve_model_arg,
)


def compare(
    run: PairArgs,
    model: ModelArgs,
    prompts: PromptArgs,
    sampling: SamplingArgs,
    output: OutputArgs,
    importance: ISArgs,
    clip_eps: ClipEpsOpt = 0.2,
    repeat: Annotated[
        int,
        typer.Option(
            "--repeat",
            metavar="N",
            help="Prompt mode: run each engine N times in "
            "one process on the same token ids, the first repeat on the same "
            "batch, later ones among random filler sequences; reports "
            "mismatches between runs.",
        ),
    ] = 1,
    replay_routing: Annotated[
        bool,
        typer.Option(
            "--replay-routing",
            metavar="",
            help="MoE models, prompt mode: the training engine's router replays "
            "the experts the inference engine chose for each token (R3); compares with and without "
            "(summary routing_replay).",
        ),
    ] = False,
    full_vocab: Annotated[
        bool,
        typer.Option(
            "--full-vocab",
            metavar="",
            help="Prompt mode: each engine also records its "
            "whole log-softmax row at every scored position (4 x vocabulary "
            "bytes each, in RUN/train/vocab, RUN/infer/vocab); adds "
            "KL both ways, total variation, top-1 agreement and top-5 "
            "overlap per token.",
        ),
    ] = False,
) -> None:
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

    out, summary = _run_compare(
        run, model, prompts, sampling, output, clip_eps, COMPARE_OUTPUTS, repeat, replay_routing, full_vocab, importance
    )
    render_summary(out, summary)
    results(out / SUMMARY, out / TOKENS, out / SEQUENCES, *write_page(out))


def _run_compare(
    pair,
    model,
    prompts,
    sampling,
    output,
    clip_eps,
    names,
    repeat: int = 1,
    replay_routing: bool = False,
    full_vocab: bool = False,
    importance: ISArgs | None = None,
) -> tuple[Path, dict]:
    """Validate everything, then run compare into the output directory; returns (out, summary)."""
    from alignaudit.pipelines.runs import compare as run_compare

    request = build_request(
        model,
        prompts,
        pair,
        sampling,
        clip_eps,
        importance,
        repeat=repeat,
        replay_routing=replay_routing,
        full_vocab=full_vocab,
    )
    out = out_dir(output, "compare", names)
    with console.status("") as status:
        summary = run_compare(request, out, stream_log=output.verbose, on_stage=status.update)
    return out, summary


def rescore(
    rollouts_file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE", help="Rollouts: JSONL or parquet, one row per rollout (token_ids, prompt_length, logprobs)."
        ),
    ],
    model: ModelArgs,
    output: OutputArgs,
    train: Annotated[str, typer.Option("--train", metavar="ENGINE", help="megatron or hf.")] = "megatron",
    dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", help="bf16, fp16 or fp32.")] = "bf16",
    device: DeviceOpt = "auto",
    train_opt: Annotated[
        Optional[list[str]],
        typer.Option("--train-opt", metavar="KEY=VALUE", help="Training-engine setting (repeatable)."),
    ] = None,
    strict: StrictOpt = None,
    strict_exp: StrictExpOpt = None,
    strict_attention: StrictAttentionOpt = None,
    clip_eps: ClipEpsOpt = 0.2,
    logprobs_mode: Annotated[
        Optional[str],
        typer.Option(
            "--logprobs-mode",
            metavar="MODE",
            help="raw or processed, for a file that does not record it (NeMo-RL's and slime's dumps do not).",
        ),
    ] = None,
    temperature: Annotated[
        Optional[float],
        typer.Option(
            "--temperature", metavar="T", help="The rollout's temperature, for a file that does not record it."
        ),
    ] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", metavar="K", help="Likewise its top-k.")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", metavar="P", help="Likewise its top-p.")] = None,
) -> None:
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
    from alignaudit.engines import kind_of, names_where
    from alignaudit.inputs.rollouts import read_rollouts
    from alignaudit.pipelines.requests import check_clip_eps, engine_runs
    from alignaudit.pipelines.runs import rescore as run_rescore

    check_clip_eps(clip_eps)
    if not kind_of(train).trains:
        raise errors.InputError(
            f"--train {train}: rescore scores with a training engine, {names_where(lambda k: k.trains)}"
        )
    spec = resolve_model_arg(model)
    pair = PairArgs(
        train=train,
        infer=train,
        dtype=dtype,
        device=device,
        train_opt=train_opt,
        strict=strict,
        strict_exp=strict_exp,
        strict_attention=strict_attention,
    )
    run = engine_runs(pair, model.seed, spec)[0]
    given = {"logprobs_mode": logprobs_mode, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    rollouts = read_rollouts(rollouts_file, spec.vocab_size, given, spec.max_position_embeddings)
    out = out_dir(output, "rescore", RESCORE_OUTPUTS, (Path(rollouts_file),))
    with console.status("") as status:
        summary = run_rescore(spec, rollouts, run, out, clip_eps, stream_log=output.verbose, on_stage=status.update)
    render_summary(out, summary)
    results(out / SUMMARY, out / "tokens.parquet", out / "sequences.parquet", out / "run.json")


def bisect(
    run: PairArgs,
    model: ModelArgs,
    prompts: PromptArgs,
    output: OutputArgs,
    mode: Annotated[str, typer.Option("--mode", metavar="MODE", help="natural, forced, or both.")] = "both",
    layers: LayersOpt = None,
    ops: OpsOpt = None,
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
    from alignaudit.pipelines.runs import MODES
    from alignaudit.pipelines.runs import bisect as run_bisect
    from alignaudit.reports.terminal import render_bisect

    if mode not in MODES:
        raise errors.InputError(f"unknown bisect mode {mode!r}; choose one of {', '.join(MODES)}")
    request = build_request(model, prompts, run)
    selection = parse_selection(layers, ops, OpGraph.of(request.spec))
    check_parallel_op_capture([request.train, request.infer], forced=mode != "natural")
    out = out_dir(output, "bisect", BISECT_OUTPUTS)
    with console.status("") as status:
        result = run_bisect(request, out, selection, mode=mode, stream_log=output.verbose, on_stage=status.update)
    render_bisect(console, result)
    results(out / BISECT, *(out / OPS_FILES[m] for m in ("natural", "forced") if m in result), *write_page(out))


def diff(
    train_dir: Annotated[
        Path, typer.Argument(metavar="TRAIN_CAPTURE", help="Capture directory playing the training engine.")
    ],
    infer_dir: Annotated[
        Path, typer.Argument(metavar="INFER_CAPTURE", help="Capture directory playing the inference engine.")
    ],
    out: Annotated[
        Optional[str],
        typer.Option("--out", "-o", metavar="DIR", help="Output directory (default: alignaudit-runs/diff-TIME)."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            metavar="",
            help="Reuse a non-empty --out (only alignaudit's own earlier outputs there are replaced).",
        ),
    ] = False,
    clip_eps: ClipEpsOpt = 0.2,
) -> None:
    """Compare two captures made anywhere: logprobs, and every op when both captured ops.

    Refuses captures of different checkpoints or token ids, and damaged captures (the same checks
    `alignaudit gate` makes).
    """
    from alignaudit.capture.rundir import DIFF_OUTPUTS, OPS_FILES, RUN, SUMMARY
    from alignaudit.comparison.integrity import load_pair
    from alignaudit.comparison.op_diff import first_divergence
    from alignaudit.pipelines.requests import check_clip_eps
    from alignaudit.pipelines.runs import diff_captures, diff_ops, finish_diff, write_ops
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
    render_summary(out_path, summary)
    if records is not None:
        mode = b.manifest["ops"].get("mode", "natural")
        render_ops(console, records, mode, first_divergence([r for r in records if r.get("forced", True)]))
        render_op_verdict(console, mode, records)
    results(out_path / SUMMARY, *([out_path / OPS_FILES["diff"]] if records is not None else []), out_path / RUN)


def ablate(
    run: PairArgs,
    model: ModelArgs,
    prompts: PromptArgs,
    sampling: SamplingArgs,
    output: OutputArgs,
    factors: Annotated[
        Optional[str],
        typer.Option(
            "--factors",
            metavar="OPS",
            help="Strict ops to ablate, e.g. linear,rmsnorm (default: all of linear, "
            "rmsnorm, rope, silu, attention, logprobs).",
        ),
    ] = None,
    no_ops: Annotated[
        bool,
        typer.Option(
            "--no-ops",
            metavar="",
            help="Skip op capture: no first diverging op per row, and vLLM keeps its compiled default.",
        ),
    ] = False,
) -> None:
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
    from alignaudit.inputs.strict_ops import STRICT_OPS, parse_strict
    from alignaudit.pipelines.ablate import ablate as run_ablate
    from alignaudit.pipelines.ablate import eager_for_op_capture, without_strict

    if run.strict is not None:
        raise errors.InputError("ablate sets the strict ops of each row itself; drop --strict")
    if run.strict_exp is not None:
        raise errors.InputError("ablate's rows without strict attention would not use --strict-exp; drop it")
    if run.strict_attention is not None:
        raise errors.InputError("ablate's rows without strict attention would not use --strict-attention; drop it")
    if factors is not None and not parse_strict(factors, "--factors"):
        raise errors.InputError(
            f"--factors {factors!r} names no op; give some of {', '.join(STRICT_OPS)}, or drop --factors for all"
        )
    chosen = parse_strict(factors, "--factors") if factors else frozenset(STRICT_OPS)
    ordered = tuple(op for op in STRICT_OPS if op in chosen)
    # validated with every op strict (the first row), run with each row's own strict ops
    request = build_request(model, prompts, dataclasses.replace(run, strict="all"), sampling)
    capture_ops = not no_ops and request.rollout is None
    if capture_ops:
        check_parallel_op_capture([request.train, request.infer], forced=False)
    out = out_dir(output, "ablate", ABLATE_OUTPUTS)
    with console.status("") as status:
        matrix = run_ablate(request, out, ordered, capture_ops, on_stage=status.update)
    eager = "" if capture_ops else ", no op capture"
    if capture_ops and (eager_names := eager_for_op_capture(request)):
        eager = f" ({eager_names} eager: op capture)"
    shown = without_strict(request)
    table = Table(
        title=f"Ablation: {escape(shown.train.label())} vs {escape(shown.infer.label())}, {request.mode} mode{eager}",
        title_justify="left",
    )
    for col in ("factor", "kind", "mismatching tokens", "max ULP", "max |Δ|", "first diverging op"):
        table.add_column(
            col, justify="right" if col in ("mismatching tokens", "max ULP", "max |Δ|") else "left", overflow="fold"
        )
    for r in matrix.itertuples():
        style = "green" if r.mismatches == 0 else None
        table.add_row(
            r.factor,
            r.kind,
            f"{r.mismatches} of {r.tokens}",
            str(r.max_ulp),
            f"{r.max_abs_diff:.3e}",
            escape(
                r.first_diverging_op
                if isinstance(r.first_diverging_op, str)
                else "-"
                if capture_ops
                else "(not captured)"
            ),
            style=style,
        )
    console.print(table)
    results(out / ABLATE_PARQUET, out / ABLATE_JSON, *write_page(out))
