"""`alignaudit rl`: the GRPO loop with the alignment checked at every step (registered by alignaudit.commands.cli;
the loop itself: alignaudit.rl)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from alignaudit.commands.console import console, err_console, results, write_page
from alignaudit.commands.options import (
    ArrivalGapOpt,
    ClipEpsOpt,
    EngineModeOpt,
    MaxNewTokensOpt,
    StopAtEosOpt,
    TemperatureOpt,
    TopKOpt,
    TopPOpt,
)
from alignaudit.pipelines.requests import ISArgs, ModelArgs, OutputArgs, PairArgs, PromptArgs, SamplingArgs, out_dir


def rl(
    run: PairArgs,
    model: ModelArgs,
    prompts: PromptArgs,
    output: OutputArgs,
    importance: ISArgs,
    steps: Annotated[int, typer.Option("--steps", metavar="N", help="GRPO steps.")] = 10,
    lr: Annotated[
        float,
        typer.Option(
            "--lr", metavar="LR", help="Adam learning rate (0: weights never change, the weight-sync control)."
        ),
    ] = 1e-4,
    group_size: Annotated[
        int, typer.Option("--group-size", metavar="G", help="Completions per prompt (GRPO group).")
    ] = 4,
    max_new_tokens: MaxNewTokensOpt = 16,
    temperature: TemperatureOpt = 1.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    stop_at_eos: StopAtEosOpt = None,
    engine_mode: EngineModeOpt = None,
    arrival_gap: ArrivalGapOpt = None,
    sleep_level: Annotated[
        int,
        typer.Option(
            "--sleep-level",
            metavar="L",
            help="vLLM on CUDA: sleep after each "
            "rollout and wake before the sync, as colocated frameworks free the "
            "GPU for the trainer; 1: weights to host memory, KV cache freed "
            "(steps.parquet sleep_freed_gib). 0: never sleeps.",
        ),
    ] = 0,
    clip_eps: ClipEpsOpt = 0.2,
    reward: Annotated[
        str,
        typer.Option(
            "--reward",
            metavar="NAME|MODULE:FUNCTION",
            help="task (the addition "
            "task of --model qwen3-tiny-trained: 1 for a correct answer ending at EOS, "
            "0.1 for a wrong number; rl asks the task's own questions), "
            "rotating-hash (a score per token id "
            "from a table that changes every 10 steps), "
            "token-hash (one fixed table) or even (the fraction of even token ids); "
            "each collapses a policy in time; --kl-coef keeps the gradient "
            "non-zero (docs/rl.md); or your own, MODULE:FUNCTION "
            "(rewards.py:my_reward), called as TRL calls a reward function: "
            "f(prompts, completions, **kwargs) -> one float per completion.",
        ),
    ] = "rotating-hash",
    kl_coef: Annotated[
        float,
        typer.Option(
            "--kl-coef",
            metavar="BETA",
            help="Weight of the k3 KL to the starting "
            "weights in the loss (GRPO's KL term; DeepSeekMath used 0.04). 0: none. "
            "> 0 keeps a copy of the starting weights on the trainer's device.",
        ),
    ] = 0.0,
    no_token_rows: Annotated[
        bool,
        typer.Option(
            "--no-token-rows",
            metavar="",
            help="Skip tokens/step-*.parquet (one row per generated token per step) on long runs.",
        ),
    ] = False,
    log_to: Annotated[
        Optional[str],
        typer.Option(
            "--log-to",
            metavar="SINKS",
            help="Also log every step's "
            "numbers to tensorboard (RUN/tensorboard/) and/or wandb "
            "(offline, RUN/wandb/), comma-separated; each needs its "
            "package (pip install tensorboard wandb).",
        ),
    ] = None,
    full_vocab: Annotated[
        bool,
        typer.Option(
            "--full-vocab",
            metavar="",
            help="Also compare, at every generated token of "
            "every step, the trainer's whole log-softmax row with the one vLLM's "
            "sampler computed while decoding: exact KL both ways, total "
            "variation, top-1 agreement, top-5 overlap (steps.parquet vocab_*, "
            "per token in tokens/). Cost: each side's rows, 4 x vocabulary bytes "
            "per generated token (Qwen3: 594 KiB; 2048 tokens a step: 1.2 GB a "
            "side), held by its worker, written to RUN/vocab/, read by the "
            "parent and deleted after the step.",
        ),
    ] = False,
    keep_vocab_rows: Annotated[
        bool,
        typer.Option(
            "--keep-vocab-rows",
            help="With --full-vocab: keep every "
            "step's rows in RUN/vocab/step-N-{train,infer}.safetensors "
            "(the disk cost above, per step).",
        ),
    ] = False,
    max_seconds: Annotated[
        float,
        typer.Option(
            "--max-seconds",
            metavar="S",
            help="Stop after the step during "
            "which S seconds (engine start-up included) have passed, and "
            "close the run as a finished one of fewer steps (run.json "
            "stopped, steps_run); for a job's time limit, leave room for "
            "the engines' shutdown. 0: every step.",
        ),
    ] = 0.0,
    prompts_per_step: Annotated[
        int,
        typer.Option(
            "--prompts-per-step",
            metavar="N",
            help="Draw N of the prompts "
            "each step (a shuffle seeded by --seed, a new one each epoch; "
            "steps.parquet epoch, prompts_digest). 0: every prompt every "
            "step.",
        ),
    ] = 0,
    eval_prompts: Annotated[
        Optional[Path],
        typer.Option(
            "--eval-prompts",
            metavar="FILE",
            help="Held-out prompts "
            "(the format of --prompts; JSONL columns reach your "
            "reward function), answered greedily by the rollout "
            "engine and scored by --reward before the first step, "
            "every --eval-every steps and after the last "
            "(eval.parquet, eval/). --reward task without it: the "
            "task's own held-out questions.",
        ),
    ] = None,
    eval_every: Annotated[
        int,
        typer.Option(
            "--eval-every",
            metavar="K",
            help="Score the held-out prompts after "
            "every K steps (also before the first and after the last). 0: "
            "only then, where --eval-prompts is given.",
        ),
    ] = 0,
) -> None:
    """N GRPO steps with the train/rollout alignment checked at every step.

    Each step the inference engine samples --group-size completions per prompt (every prompt, or
    --prompts-per-step of them drawn from the set; request i seeded with --seed + i) and records their
    logprobs while decoding; the trainer rescores them (old_logprobs); every generated token is compared
    bit for bit; the reward (--reward: the task, a toy, or your own function) gives GRPO advantages;
    the trainer takes one clipped-loss step (Adam on fp32 main weights, grad clipping at 1.0) with the
    ratio exp(lp_train - lp_rollout); its new weights go into the running inference engine
    through model.load_weights (a file on the CPU, CUDA IPC handles on the GPU), and every tensor the
    engine then holds is checked bit for bit against the trainer's.
    Both engines stay up for the whole run. Writes steps.parquet (after every step), tokens/, steps.png
    and run.json; with --eval-prompts / --eval-every, held-out prompts answered greedily and scored
    (eval.parquet). `alignaudit gate RUN` passes only if every step had 0 mismatching tokens and every
    sync was bit-equal. docs/rl.md explains each metric.

    Examples:

    ```
    alignaudit rl --steps 200 --strict                 # fixture, megatron trains, vllm rolls out
    alignaudit rl --steps 5 --lr 0                     # control: weights fixed, sync still runs
    alignaudit rl --train hf --infer hf --steps 20 --strict
    alignaudit rl --steps 50 --log-to tensorboard      # tensorboard --logdir RUN/tensorboard
    alignaudit rl --steps 20 --strict --engine-mode async   # vLLM's AsyncLLM, requests arriving 20 ms apart
    alignaudit rl --model qwen3-tiny-trained --reward task --prompts-per-step 8 --eval-every 10 --strict
    ```
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from alignaudit.capture.rundir import PLOT, RUN, STEPS, rl_outputs
    from alignaudit.rl.export import parse_sinks
    from alignaudit.rl.loop import run_rl
    from alignaudit.rl.settings import RLSettings

    settings = RLSettings(
        steps=steps,
        lr=lr,
        group_size=group_size,
        token_rows=not no_token_rows,
        reward=reward,
        kl_coef=kl_coef,
        log_to=parse_sinks(log_to),
        full_vocab=full_vocab,
        keep_vocab_rows=keep_vocab_rows,
        sleep_level=sleep_level,
        max_seconds=max_seconds,
        prompts_per_step=prompts_per_step,
        eval_every=eval_every,
        eval_prompts=str(eval_prompts) if eval_prompts is not None else None,
    )
    settings.check()
    from alignaudit.rl.request import rl_request

    request, held = rl_request(
        model,
        prompts,
        run,
        SamplingArgs(
            "rollout",
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            stop_at_eos=stop_at_eos,
            engine_mode=engine_mode,
            arrival_gap=arrival_gap,
        ),
        clip_eps,
        importance,
        settings,
    )
    from alignaudit.rl.memory import rl_plan

    memory = rl_plan(request, group_size, kl_coef > 0, prompts_per_step, held)  # refuses what cannot fit, first
    if held and held.overlap:
        same = "ask training questions" if held.overlap_by == "question" else "have a training prompt's token ids"
        err_console.print(
            f"[yellow]warning:[/] {held.overlap} of the {len(held.batch.sequences)} held-out prompts "
            f"{same}: their score is not a held-out one",
            highlight=False,
            soft_wrap=True,
        )
    out = out_dir(output, "rl", rl_outputs(settings.log_to))
    columns = (
        TextColumn("step"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[last]}"),
    )
    # transient: the step lines above the bar stay; the bar's last frame is not printed again (cut to the width)
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("rl", total=steps, last="starting engines")

        def on_step(row: dict) -> None:  # a line per step above the bar (a log or CI keeps each one whole)
            line = _step_line(row)
            progress.console.print(f"step {row['step']}: {line}", highlight=False, soft_wrap=True)
            progress.update(task, advance=1, last=line)

        def on_eval(row: dict) -> None:
            progress.console.print(
                f"held-out after step {row['step']}: {_eval_line(row)}", highlight=False, soft_wrap=True
            )

        table = run_rl(
            request,
            settings,
            out,
            on_step=on_step,
            on_stage=lambda text: progress.update(task, last=escape(text)),
            memory=memory,
            held=held,
            on_eval=on_eval,
        )
    bad = int((table["mismatches"] > 0).sum())
    unsynced = int((~table["sync_bit_equal"]).sum())
    style = "bold green" if bad == 0 and unsynced == 0 else "bold red"
    console.print(
        f"[{style}]{bad} of {len(table)} steps with mismatching tokens; {unsynced} weight syncs not "
        f"bit-equal[/]; reward {table['reward_mean'].iloc[0]:.3f} -> {table['reward_mean'].iloc[-1]:.3f}",
        highlight=False,
        soft_wrap=True,
    )
    if held:
        import pandas as pd

        from alignaudit.capture.rundir import EVAL
        from alignaudit.comparison.held_out import headline

        evals = pd.read_parquet(out / EVAL)
        measure = headline(evals)
        console.print(
            f"held-out {measure.replace('_mean', '')} (greedy, {len(held.batch.sequences)} prompts): "
            f"{evals[measure].iloc[0]:.3f} before step 1 -> {evals[measure].iloc[-1]:.3f} after step "
            f"{evals['step'].iloc[-1]}",
            highlight=False,
            soft_wrap=True,
        )
    if len(table) < steps:
        console.print(
            f"stopped after step {len(table)} of {steps}: --max-seconds {max_seconds:g} had passed", highlight=False
        )
    results(out / STEPS, out / PLOT, out / RUN, *write_page(out))


def _step_line(row: dict) -> str:
    """One rl step as the progress bar shows it: mismatching tokens, max |d|, k3 KL, (--full-vocab) the exact mean
    KL(train || rollout) over the whole vocabulary and top-1 agreement, and the clip fraction first (what the
    mismatch costs the optimizer), then the sync, the reward and the time."""
    sync = "sync ok" if row["sync_bit_equal"] else f"[red]sync: {row['sync_tensors_differing']} tensors differ[/]"
    mism = f"{row['mismatches']}/{row['tokens']} tokens differ"
    vocab = (
        f"vocab KL {_num(row['vocab_kl_train_infer_mean'])}, top-1 {_num(row['vocab_top1_agreement'], '.3f')}, "
        if "vocab_kl_train_infer_mean" in row
        else ""
    )
    return (
        f"{'[green]' if row['mismatches'] == 0 else '[red]'}{mism}[/], max |d| {_num(row['max_abs_diff'])}, "
        f"KL {_num(row['kl_k3'])}, {vocab}clip {_num(row['clip_fraction'], '.3f')}, {sync}, "
        f"reward {row['reward_mean']:.3f}, {row['seconds']:.1f}s"
    )


def _eval_line(row: dict) -> str:
    """One held-out evaluation as rl prints it: its prompts, the greedy reward and (the task) the accuracy."""
    accuracy = f", accuracy {row['accuracy']:.3f}" if row["accuracy"] is not None else ""
    return (
        f"{row['prompts']} prompts, reward {row['reward_mean']:.3f}{accuracy}, {row['completions_ended_early']} "
        f"ended early, {row['seconds']:.1f}s"
    )


def _num(x, spec: str = ".2e") -> str:
    """A step-line number; "n/a" where the step had none (no finite pair)."""
    return "n/a" if x is None or x != x else format(x, spec)
