"""``alignaudit gate``: a CI verdict on a finished comparison or rl run, or on one it runs itself (registered on the
app by alignaudit.commands.cli)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from alignaudit import errors
from alignaudit.capture import outdir
from alignaudit.commands.compare_commands import _run_compare
from alignaudit.commands.console import console, results, write_page
from alignaudit.commands.options import ClipEpsOpt, field_names, given_options
from alignaudit.pipelines.requests import ModelArgs, OutputArgs, PairArgs, PromptArgs, SamplingArgs


def gate(
    ctx: typer.Context,
    run: PairArgs,
    model: ModelArgs,
    prompts: PromptArgs,
    sampling: SamplingArgs,
    output: OutputArgs,
    run_dir: Annotated[
        Optional[Path],
        typer.Argument(metavar="[RUN_DIR]", help="A finished compare or rl run (omit to run a comparison now)."),
    ] = None,
    max_mismatch: Annotated[
        Optional[str],
        typer.Option(
            "--max-mismatch", metavar="N|FRAC", help="Allow N mismatching tokens, or a fraction (0.5% or 0.005)."
        ),
    ] = None,
    max_ulp: Annotated[
        Optional[int], typer.Option("--max-ulp", metavar="N", help="Allow tokens up to N ULP apart.")
    ] = None,
    max_abs: Annotated[
        Optional[float], typer.Option("--max-abs", metavar="X", help="Allow |lp_train - lp_infer| up to X.")
    ] = None,
    baseline: Annotated[
        Optional[Path],
        typer.Option(
            "--baseline", metavar="FILE", help="Fail only on regression against this verdict.json (or summary.json)."
        ),
    ] = None,
    junit: Annotated[
        Optional[Path], typer.Option("--junit", metavar="FILE", help="JUnit XML (default: RUN/junit.xml).")
    ] = None,
    json_out: Annotated[
        Optional[Path], typer.Option("--json", metavar="FILE", help="JSON verdict (default: RUN/verdict.json).")
    ] = None,
    md_out: Annotated[
        Optional[Path],
        typer.Option(
            "--markdown",
            metavar="FILE",
            help="Markdown summary, appended when the file exists ($GITHUB_STEP_SUMMARY); default RUN/summary.md.",
        ),
    ] = None,
    clip_eps: ClipEpsOpt = 0.2,
) -> None:
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
        given = given_options(
            ctx, field_names(PairArgs, ModelArgs, PromptArgs, SamplingArgs, OutputArgs) + ["clip_eps"]
        )
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            verb = "applies" if len(given) == 1 else "apply"
            raise errors.InputError(
                f"gate RUN_DIR judges a finished run; {flags} {verb} only when gate runs the "
                "comparison itself (without RUN_DIR): drop them"
            )
    rule = gating.make_rule(max_mismatch, max_ulp, max_abs, baseline)
    planned = run_dir if run_dir is not None else output.out  # None: a fresh default directory, nothing in it yet
    # before anything is written
    _check_verdict_files(Path(planned) if planned is not None else None, json_out, junit, md_out, baseline)
    if run_dir is None:
        run_dir, _ = _run_compare(run, model, prompts, sampling, output, clip_eps, COMPARE_OUTPUTS + GATE_OUTPUTS)
    _claim_verdict_files(
        Path(run_dir),
        targets := (json_out or run_dir / VERDICT, junit or run_dir / JUNIT, md_out or run_dir / SUMMARY_MD),
    )
    verdict = gating.judge_run(Path(run_dir), rule)
    gating.write_outputs(verdict, *targets, append_md=md_out is not None)
    style = "bold green" if verdict.passed else "bold red"
    console.print(
        f"[{style}]gate {verdict.label.upper()}[/] ({escape(verdict.rule)}): "
        f"{verdict.mismatches} of {verdict.tokens_compared} tokens differ, max ULP {verdict.ulp_max}",
        highlight=False,
        soft_wrap=True,
    )  # one line, whatever the width: CI logs grep it
    for reason in verdict.reasons:
        console.print(f"  {escape(reason)}", highlight=False, soft_wrap=True)
    for note in verdict.notes:
        console.print(f"  not judged: {escape(note)}", highlight=False, soft_wrap=True)
    if Path(targets[0]).resolve().parent == Path(run_dir).resolve():  # the verdict went into the run: so does the page
        results(*targets, *write_page(Path(run_dir)))
    if verdict.error:
        raise errors.EngineError(verdict.error)
    raise typer.Exit(verdict.exit_code)


def _check_verdict_files(
    run_dir: Path | None, json_out: Path | None, junit: Path | None, md_out: Path | None, baseline: Path | None
) -> None:
    """gate's outputs under the rule of outdir.check_file_outputs (defaults in the run, options anywhere else);
    ``run_dir`` None: a run gate is about to make in a fresh directory (only the given outputs are checked)."""
    from alignaudit.capture.rundir import JUNIT, SUMMARY_MD, VERDICT

    own = {"--json": VERDICT, "--junit": JUNIT, "--markdown": SUMMARY_MD}
    given = {"--json": json_out, "--junit": junit, "--markdown": md_out}
    targets = {
        flag: path if path is not None or run_dir is None else run_dir / own[flag] for flag, path in given.items()
    }
    outdir.check_file_outputs(targets, runs=(run_dir,) if run_dir is not None else (), inputs=(baseline,), own=own)


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
            outdir.check_replaceable(run_dir, inside, "or pass --json, --junit and --markdown to write elsewhere")
            outdir.claim(run_dir, inside)
        except errors.InputError as e:
            raise errors.InputError(
                f"{e}, or pass --json, --junit and --markdown to write the verdict elsewhere"
            ) from e
