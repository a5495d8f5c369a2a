"""rl's Request: compare's (pipelines.requests.build_request) with what the loop adds, each refused before any engine
starts where it cannot take effect: engines that train and roll out, a group as one request where the rollout engine
samples groups (vLLM's n), vLLM's sleep mode (--sleep-level), the task's own questions (--reward task), the held-out
prompts (--eval-prompts, --eval-every), and the sizes and models the loop does not run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from alignaudit.errors import InputError


def rl_request(model, prompts, run, sampling, clip_eps: float, importance, settings):
    """The Request of ``alignaudit rl`` (pipelines.requests argument groups; ``settings`` an rl.settings.RLSettings,
    already checked) and its held-out prompts (an alignaudit.rl.evaluation.HeldOut, or None). ``sampling.group_size``
    is set here: G where the rollout engine samples a group as one request (and --full-vocab is off: its rows are per
    request), else 1 (the loop then submits each prompt G times).

    Raises:
        InputError: a setting the loop or the engines cannot run with, with the fix.
    """
    from alignaudit.engines import kind_of, names_where
    from alignaudit.engines.checks import check_rl_full_vocab, refuse_parallel
    from alignaudit.inputs.capabilities import refuse_moe
    from alignaudit.pipelines.requests import build_request

    if not kind_of(run.train).trains or not kind_of(run.infer).rolls_out:
        trainers, rollers = names_where(lambda k: k.trains), names_where(lambda k: k.rolls_out)
        raise InputError(
            f"rl trains with {trainers} and rolls out with {rollers}; got --train {run.train} --infer {run.infer}"
        )
    grouped = kind_of(run.infer).samples_groups and not settings.full_vocab
    sampling = dataclasses.replace(sampling, group_size=settings.group_size if grouped else 1)
    request = build_request(
        model,
        prompts,
        run,
        sampling,
        clip_eps,
        importance,
        extra_check=check_rl_full_vocab if settings.full_vocab else None,
        trains=True,
    )
    _refuse_truncated_reference(request, settings.kl_coef)
    if settings.full_vocab and request.sampling.engine_mode == "async":
        raise InputError(
            "rl --full-vocab with --engine-mode async is not built (the sampler's rows stay in vLLM's "
            "engine process); drop one of them"
        )
    if settings.sleep_level:
        request = _with_sleep_mode(request)
    if settings.reward == "task":
        request = _task_prompts(request, prompts, model.seed, settings.prompts_per_step)
    from alignaudit.rl.step_prompts import StepPrompts

    StepPrompts.check(settings.prompts_per_step, len(request.batch.sequences))
    held = _held_out(request, settings, model.seed)
    refuse_moe(request.spec, "alignaudit rl")
    refuse_parallel(
        [request.infer],
        "alignaudit rl",
        "its ranks would take the new weights through collective "
        "calls alignaudit does not make yet; roll out at size 1 (megatron may train at any size)",
    )
    return request, held


def _held_out(request, settings, seed: int):
    """The HeldOut of the run (alignaudit.rl.evaluation.held_out): the --eval-prompts file (validated as --prompts
    is, with room for the completion), or under --reward task with --eval-every the task's EVAL_QUESTIONS held-out
    questions seeded by --seed; under the task every prompt checked to be a question; under a user's reward its
    import and the calls it will get, with each prompt file's columns (UserReward.check_call). Raises InputError."""
    from alignaudit.inputs.prompts import load_prompts, text_batch
    from alignaudit.rl.evaluation import held_out
    from alignaudit.rl.task import EVAL_QUESTIONS, TaskReward, questions
    from alignaudit.rl.user_reward import UserReward, is_user_reward

    task, reserve = settings.reward == "task", request.rollout.max_new_tokens
    batch = None
    if settings.eval_prompts is not None and settings.eval_every >= settings.steps:
        raise InputError(
            f"--eval-every {settings.eval_every} with --steps {settings.steps}: no evaluation falls "
            "between the one before the first step and the one after the last, which --eval-prompts "
            "makes with 0 too; use fewer steps between evaluations, or 0"
        )
    if settings.eval_prompts is not None:
        try:
            batch = load_prompts(request.spec, Path(settings.eval_prompts), reserve=reserve)
        except InputError as e:
            raise InputError(f"--eval-prompts {settings.eval_prompts}: {e}") from None
    elif task and settings.eval_every:
        batch = text_batch(
            request.spec,
            questions(EVAL_QUESTIONS, seed, "held_out"),
            f"task(addition, held-out set: {EVAL_QUESTIONS} questions, seed {seed})",
            reserve=reserve,
        )
    reward = TaskReward(request.spec.path) if task else None
    if batch is not None and reward:
        reward.check_prompts(batch.sequences, held_out=True)
    held = held_out(batch, settings.eval_every, request.batch, task, reward.operands if reward else None)
    if is_user_reward(settings.reward):
        user = UserReward(settings.reward, request.spec.path)  # imported, and its calls checked, before any engine
        for batch in (request.batch, *([held.batch] if held else [])):
            user.check_call(tuple(batch.columns), batch.source)
    return held


def _refuse_truncated_reference(request, kl_coef: float) -> None:
    """--kl-coef with processed logprobs under top-k / top-p: the trainer replays the truncation for the policy and
    the reference alike, and a sampled token outside the reference's kept set has reference logprob -inf, so the
    k3 KL (exp(ref - lp) - (ref - lp) - 1) is +inf at that token and the loss with it (seen on the fixture: loss
    and kl_ref inf from step 2). Raises InputError before any engine starts."""
    from alignaudit.engines.checks import processed_logprobs

    rollout = request.rollout
    if kl_coef > 0 and processed_logprobs(request.infer) and (rollout.top_k > 0 or rollout.top_p < 1):
        raise InputError(
            f"--kl-coef {kl_coef:g} with processed logprobs and --top-k {rollout.top_k} / --top-p "
            f"{rollout.top_p:g}: the reference's truncation gives -inf logprobs to tokens the policy "
            "sampled, so the KL term is infinite; drop --kl-coef, the truncation, or "
            "logprobs_mode=processed_logprobs"
        )


def _task_prompts(request, prompts, seed: int, per_step: int):
    """rl --reward task: the task's own questions unless prompts were given (``prompts``: a PromptArgs),
    each checked to be a question; refused where completions cannot end at EOS (the answer ends there). The task's
    own: DEFAULT_QUESTIONS of its training set (alignaudit.rl.task.questions, seeded by --seed), asked every step, or
    with --prompts-per-step (``per_step`` > 0) the whole training set, drawn from step by step. Raises InputError."""
    from alignaudit.inputs.prompts import text_batch
    from alignaudit.rl.task import DEFAULT_QUESTIONS, TaskReward, questions

    if not request.rollout.stop_at_eos:
        from alignaudit.engines import kind_of

        stops = kind_of(request.infer.engine).rollout_defaults["stop_at_eos"] is not False
        raise InputError(
            "--reward task scores answers that end at EOS, and "
            + (
                "--ignore-eos makes the rollout ignore it; drop --ignore-eos"
                if stops
                else f"{request.infer.engine} rollouts ignore it; use --infer vllm"
            )
        )
    if prompts.prompts is None and prompts.random_prompts is None:
        count = 0 if per_step else DEFAULT_QUESTIONS  # 0: all of them
        texts = questions(count, seed)
        source = f"task(addition, training set: {len(texts)} questions, seed {seed})"
        request = request.with_batch(text_batch(request.spec, texts, source, reserve=request.rollout.max_new_tokens))
    TaskReward(request.spec.path).check_prompts(request.batch.sequences)
    return request


def _with_sleep_mode(request):
    """``request`` with vLLM's ``enable_sleep_mode=true`` among the rollout engine's options (rl --sleep-level),
    after refusing an engine or device that cannot sleep. Raises InputError."""
    from alignaudit.engines import kind_of, names_where

    infer = request.infer
    if not kind_of(infer.engine).sleeps:
        raise InputError(
            f"--sleep-level: {infer.engine} does not sleep; use --infer "
            f"{names_where(lambda k: k.sleeps)} or drop --sleep-level"
        )
    if infer.settings.device != "cuda":
        raise InputError(
            "--sleep-level needs --device cuda: vLLM's sleep mode frees GPU memory through its "
            "CUDA allocator, and its CPU worker ignores sleep; drop --sleep-level"
        )
    settings = dataclasses.replace(infer.settings, options={**infer.settings.options, "enable_sleep_mode": True})
    return dataclasses.replace(request, infer=dataclasses.replace(infer, settings=settings))
