"""Whole runs from Python, as the CLI runs them: ``compare``, ``rl``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from alignaudit.api.checks import argument_names, check_number
from alignaudit.errors import InputError


@dataclass
class Comparison:
    """A finished comparison (``compare``): summary.json's numbers as attributes, the tables as DataFrames.

    Attributes:
        path: the run directory (run.json, the captures, tokens.parquet, sequences.parquet, summary.json).
        tokens_compared, mismatches: tokens with a logprob on both sides, and those not bitwise equal.
        ulp_max, max_abs_diff: the largest fp32 ULP distance and |lp_train - lp_infer| (None without finite pairs).
        generated: the same record for the sampled tokens alone (rollout mode), else None.
        summary: all of summary.json (docs/output.md explains every field).
        tokens, sequences: tokens.parquet (one row per token) and sequences.parquet (one per sequence).
    """

    path: Path
    tokens_compared: int
    mismatches: int
    ulp_max: int | None
    max_abs_diff: float | None
    generated: dict | None
    summary: dict = field(repr=False)
    tokens: pd.DataFrame = field(repr=False)
    sequences: pd.DataFrame = field(repr=False)

    @property
    def bitwise_equal(self) -> bool:
        """Every compared token bitwise equal (and at least one compared)."""
        return self.tokens_compared > 0 and self.mismatches == 0


def compare(
    model: str | Path = "qwen3-tiny",
    *,
    train: str = "megatron",
    infer: str = "vllm",
    strict: str | None = None,
    mode: str = "prompt",
    prompts: str | Path | None = None,
    random_prompts: int | None = None,
    prompt_len: int | None = None,
    dtype: str = "bf16",
    device: str = "auto",
    train_options: dict[str, Any] | None = None,
    infer_options: dict[str, Any] | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    group_size: int | None = None,
    stop_at_eos: bool | None = None,
    prompt_logprobs: bool | None = None,
    engine_mode: str | None = None,
    arrival_gap: float | None = None,
    random_weights: bool = False,
    seed: int = 0,
    clip_eps: float = 0.2,
    out: str | Path | None = None,
    force: bool = False,
    replay_routing: bool = False,
    full_vocab: bool = False,
    repeat: int = 1,
) -> Comparison:
    """Run ``alignaudit compare`` from Python: the same validation, engines (each in its own worker process),
    outputs and sealed run.json, into ``out`` (default: a new alignaudit-runs/compare-<time> directory; an
    existing non-empty one needs ``force``; where the run fails, the complete results it replaced stay in
    ``out/.alignaudit-previous/``). Arguments are the CLI's options (docs/cli.md): ``strict`` "all" or a
    comma list; ``train_options`` / ``infer_options`` the ``--train-opt`` / ``--infer-opt`` settings;
    ``replay_routing`` is ``--replay-routing`` (summary["routing_replay"]).
    ``full_vocab`` is ``--full-vocab`` (the summary's ``vocab`` record and the tokens' ``vocab_*`` columns);
    ``repeat`` is ``--repeat`` (prompt mode: runs per engine on the same token ids, summary["repeats"]).
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``: None is 32, 1.0, 0 (off), 1.0 (off) in rollout mode; a
    value given in prompt mode is refused, the default's too.
    The rollout shape (mode "rollout"): ``group_size`` (``--group-size``), ``stop_at_eos`` and ``prompt_logprobs``
    (None: the rollout engine's default, vLLM's being EOS on and no prompt logprobs; ``--stop-at-eos/--ignore-eos``,
    ``--prompt-logprobs/--no-prompt-logprobs``), ``engine_mode`` "offline" or "async" and ``arrival_gap`` seconds
    (``--engine-mode``, ``--arrival-gap``; 0.02 in async mode). None leaves a setting unset: one given where it would
    not take effect (prompt mode, an offline arrival gap) is refused. The shape resolved is run.json's ``rollout``.

    Raises:
        InputError: any bad argument, before any engine starts. EngineError: an engine failed.
    """
    import json

    from alignaudit.capture import outdir
    from alignaudit.capture.rundir import COMPARE_OUTPUTS, SEQUENCES, TOKENS
    from alignaudit.pipelines.requests import (
        ModelArgs,
        OutputArgs,
        PairArgs,
        PromptArgs,
        SamplingArgs,
        build_request,
        out_dir,
    )
    from alignaudit.pipelines.runs import compare as run_compare

    if mode not in ("prompt", "rollout"):
        raise InputError(f"mode {mode!r}: choose prompt or rollout")
    if prompts is not None and not isinstance(prompts, (str, Path)):
        raise InputError(
            f"prompts: a file path (JSONL or text lines), not {type(prompts).__name__}; token ids go in "
            'a JSONL file of {"token_ids": [...]} lines'
        )
    value: object  # each argument in turn, checked as the caller may have passed anything
    for name, opts in (("train_options", train_options), ("infer_options", infer_options)):
        if opts is not None and not isinstance(opts, dict):
            raise InputError(f"{name}: a dict of engine settings, not {type(opts).__name__}")
    for name, value in (
        ("max_new_tokens", max_new_tokens),
        ("top_k", top_k),
        ("seed", seed),
        ("random_prompts", random_prompts),
        ("prompt_len", prompt_len),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{name} {value!r}: an integer")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("clip_eps", clip_eps)):
        if value is not None or name == "clip_eps":
            check_number(name, value)
    if out is not None and not isinstance(out, (str, Path)):
        raise InputError(f"out {out!r}: a directory path (str or pathlib.Path)")
    for name, value in (("force", force), ("random_weights", random_weights)):
        if not isinstance(value, bool):
            raise InputError(f"{name} {value!r}: True or False")
    try:
        options = [[f"{k}={json.dumps(v)}" for k, v in (opts or {}).items()] for opts in (train_options, infer_options)]
    except TypeError as e:
        raise InputError(f"engine options must be JSON values (numbers, strings, booleans, lists): {e}") from e
    pair = PairArgs(
        train=train,
        infer=infer,
        dtype=dtype,
        device=device,
        train_opt=options[0] or None,
        infer_opt=options[1] or None,
        strict=strict,
    )
    sampling = SamplingArgs(
        mode,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        group_size,
        stop_at_eos,
        prompt_logprobs,
        engine_mode,
        arrival_gap,
    )
    with argument_names(compare):
        request = build_request(
            ModelArgs(str(model), random_weights, seed),
            PromptArgs(Path(prompts) if prompts is not None else None, random_prompts, prompt_len),
            pair,
            sampling,
            clip_eps,
            replay_routing=replay_routing,
            full_vocab=full_vocab,
            repeat=repeat,
        )
        path = out_dir(OutputArgs(str(out) if out is not None else None, force), "compare", COMPARE_OUTPUTS)
    try:
        with argument_names(compare):
            summary = run_compare(request, path)
    finally:
        outdir.release(path)  # a failed run keeps the complete results force=True replaced (out/.alignaudit-previous)
    return Comparison(
        path,
        summary["tokens_compared"],
        summary["mismatches"],
        summary["ulp_max"],
        summary["max_abs_diff"],
        summary.get("generated"),
        summary,
        pd.read_parquet(path / TOKENS),
        pd.read_parquet(path / SEQUENCES),
    )


@dataclass
class RLRun:
    """A finished ``rl`` run.

    Attributes:
        path: the run directory (run.json, steps.parquet, tokens/, eval.parquet and eval/ where there were
            held-out prompts, steps.png; docs/rl.md "Records").
        steps: steps.parquet, one row per step (docs/rl.md explains every column).
        evals: eval.parquet (one row per held-out evaluation), or None where the run scored none.
        record: run.json (the sealed record: every setting, the engines' reports, the seal).
    """

    path: Path
    steps: pd.DataFrame = field(repr=False)
    evals: pd.DataFrame | None = field(repr=False)
    record: dict = field(repr=False)

    @property
    def aligned(self) -> bool:
        """Every step's tokens bitwise equal and every weight sync bit-equal (what ``alignaudit gate`` passes)."""
        return bool((self.steps["mismatches"] == 0).all() and self.steps["sync_bit_equal"].all())


def rl(
    model: str | Path = "qwen3-tiny",
    *,
    train: str = "megatron",
    infer: str = "vllm",
    strict: str | None = None,
    steps: int = 10,
    lr: float = 1e-4,
    group_size: int = 4,
    reward: str | Callable = "rotating-hash",
    prompts: str | Path | None = None,
    random_prompts: int | None = None,
    prompt_len: int | None = None,
    prompts_per_step: int = 0,
    eval_prompts: str | Path | None = None,
    eval_every: int = 0,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    kl_coef: float = 0.0,
    clip_eps: float = 0.2,
    seed: int = 0,
    dtype: str = "bf16",
    device: str = "auto",
    random_weights: bool = False,
    token_rows: bool = True,
    out: str | Path | None = None,
    force: bool = False,
) -> RLRun:
    """Run ``alignaudit rl`` from Python: the same checks (every one before any engine starts), engines (each in a
    worker process of its own), records and sealed run.json, into ``out`` (default: a new alignaudit-runs/rl-<time>
    directory; an existing non-empty one needs ``force``). Arguments are the CLI's options (``alignaudit rl --help``,
    docs/rl.md), with ``reward`` also a Python callable: called as TRL calls a reward function,
    ``reward(prompts=[str], completions=[str], prompt_ids=[[int]], completion_ids=[[int]], step=int, **columns)`` ->
    one finite number per completion (alignaudit.rl.user_reward; run.json names it MODULE:QUALNAME). ``prompts`` /
    ``eval_prompts``: files in the format of ``--prompts`` (JSONL columns reach the reward by name).

    Raises:
        InputError: any bad argument, before any engine starts; a reward that raises or returns other than one finite
            number per completion, at the step it does. EngineError: an engine failed.
    """
    from alignaudit.capture import outdir
    from alignaudit.capture.rundir import EVAL, rl_outputs
    from alignaudit.pipelines.requests import ISArgs, ModelArgs, OutputArgs, PairArgs, PromptArgs, SamplingArgs, out_dir
    from alignaudit.rl.loop import run_rl
    from alignaudit.rl.memory import rl_plan
    from alignaudit.rl.request import rl_request
    from alignaudit.rl.settings import RLSettings

    value: object  # each argument in turn, checked as the caller may have passed anything
    for name, value in (("prompts", prompts), ("eval_prompts", eval_prompts), ("out", out)):
        if value is not None and not isinstance(value, (str, Path)):
            raise InputError(f"{name} {value!r}: a path (str or pathlib.Path)")
    for name, value in (
        ("steps", steps),
        ("group_size", group_size),
        ("prompts_per_step", prompts_per_step),
        ("eval_every", eval_every),
        ("max_new_tokens", max_new_tokens),
        ("top_k", top_k),
        ("seed", seed),
        ("random_prompts", random_prompts),
        ("prompt_len", prompt_len),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{name} {value!r}: an integer")
    for name, value in (
        ("lr", lr),
        ("temperature", temperature),
        ("top_p", top_p),
        ("kl_coef", kl_coef),
        ("clip_eps", clip_eps),
    ):
        check_number(name, value)
    for name, value in (("force", force), ("random_weights", random_weights), ("token_rows", token_rows)):
        if not isinstance(value, bool):
            raise InputError(f"{name} {value!r}: True or False")
    if not (callable(reward) or isinstance(reward, str)):
        raise InputError(f"reward {reward!r}: a built-in reward's name, MODULE:FUNCTION, or a callable")
    settings = RLSettings(
        steps=steps,
        lr=lr,
        group_size=group_size,
        token_rows=token_rows,
        reward=reward,
        kl_coef=kl_coef,
        prompts_per_step=prompts_per_step,
        eval_every=eval_every,
        eval_prompts=str(eval_prompts) if eval_prompts is not None else None,
    )
    with argument_names(rl):
        settings.check()
        request, held = rl_request(
            ModelArgs(str(model), random_weights, seed),
            PromptArgs(Path(prompts) if prompts is not None else None, random_prompts, prompt_len),
            PairArgs(train=train, infer=infer, dtype=dtype, device=device, strict=strict),
            SamplingArgs("rollout", max_new_tokens, temperature, top_k, top_p),
            clip_eps,
            ISArgs(),
            settings,
        )
        memory = rl_plan(request, group_size, kl_coef > 0, prompts_per_step, held)
        path = out_dir(OutputArgs(str(out) if out is not None else None, force), "rl", rl_outputs(()))
    try:
        with argument_names(rl):
            table = run_rl(request, settings, path, memory=memory, held=held)
    finally:
        outdir.release(path)
    import json

    evals = pd.read_parquet(path / EVAL) if held else None
    return RLRun(path, table, evals, json.loads((path / "run.json").read_text()))
